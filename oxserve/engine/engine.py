"""The engine: `step()` is schedule -> run -> postprocess."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from oxserve.cache.manager import CacheManager
from oxserve.cache.tensors import allocate_layer_caches, kda_slot_bytes, mla_token_bytes
from oxserve.config import EngineConfig
from oxserve.engine.request import Request
from oxserve.engine.runner import ModelRunner, StepResult
from oxserve.engine.scheduler import Scheduler, SchedulerOutput
from oxserve.engine.stop import StopChecker
from oxserve.model.config import TextModelConfig
from oxserve.model.loader import load_model
from oxserve.outputs import CompletionOutput, RequestOutput
from oxserve.sampling_params import SamplingParams
from oxserve.telemetry import span
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 32768

Prompt = str | list[int] | dict


@dataclass
class CacheLayout:
    num_blocks: int
    block_size: int
    num_slots: int


def plan_cache(config: EngineConfig, model_cfg: TextModelConfig, dtype: torch.dtype) -> CacheLayout:
    """Split the memory budget: one KDA slot per running request, the rest to blocks."""
    c = config.cache
    block_size = c.block_size or math.lcm(64, model_cfg.index_kpool)
    if block_size % model_cfg.index_kpool:
        raise ValueError(f"block_size {block_size} must be a multiple of index_kpool {model_cfg.index_kpool}")
    num_slots = c.num_slots or config.scheduler.max_num_seqs
    budget = c.cache_memory_gb * 2**30
    if c.num_blocks is not None:
        num_blocks = c.num_blocks
    else:
        left = budget - num_slots * kda_slot_bytes(model_cfg, dtype)
        num_blocks = int(left // (mla_token_bytes(model_cfg, dtype) * block_size))
        if num_blocks < 1:
            raise ValueError(
                f"cache_memory_gb={c.cache_memory_gb} cannot hold {num_slots} KDA state slots plus one block; "
                "raise it or lower max_num_seqs"
            )
    return CacheLayout(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.model.threads:
            torch.set_num_threads(config.model.threads)
        path = Path(config.model.model) if config.model.model else _default_model()
        self.model_path = path
        self.dtype = DTYPES[config.model.dtype]
        self.device = torch.device(config.model.device)
        loaded = load_model(path, dtype=self.dtype, device=self.device)
        self.model_config = loaded.config
        self.tokenizer = Tokenizer.from_dir(path)
        layout = plan_cache(config, loaded.config, self.dtype)
        caches = allocate_layer_caches(
            loaded.config, layout.num_blocks, layout.block_size, layout.num_slots, self.dtype, self.device
        )
        self.cache = CacheManager(layout.num_blocks, layout.block_size, layout.num_slots)
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.runner = ModelRunner(
            loaded.model, caches, layout.block_size, self.device, deterministic=config.scheduler.deterministic
        )
        self.max_model_len = self._max_model_len(layout)
        self.eos_token_ids = self._eos_ids(path)
        torch.manual_seed(config.model.seed)  # requests without their own seed draw from this
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._next_id = 0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.last_step = StepShape(0, 0)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Validate and queue a request. Raises ValueError naming the problem; nothing else changes."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("the engine takes n=1 requests; LLM.generate and the server fan out n > 1")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.check_prompt(prompt)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_total_tokens=self.max_model_len,
            prompt=text,
        )
        self.requests[request_id] = request
        self._texts[request_id] = OutputText(self.tokenizer, StopChecker(params, self.eos_token_ids))
        self.scheduler.add(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        request.finish("abort")
        return self._retire(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        tracer = self.runner.tracer
        with span(tracer, "schedule", track="engine"):
            scheduled = self.scheduler.schedule()
        self.last_step = StepShape.of(scheduled)
        if not scheduled.scheduled:
            return []
        result = self.runner.execute(scheduled)
        with span(tracer, "postprocess", track="engine"):
            return self._postprocess(scheduled, result)

    def _postprocess(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        for s in scheduled.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for request_id, token, logprobs in zip(result.request_ids, result.sampled.token_ids, result.sampled.logprobs):
            request = self.requests[request_id]
            if request.first_token_time is None:
                request.first_token_time = now
                self.stats["prompt_tokens"] += len(request.prompt_token_ids)
            self._append(request, token, logprobs)
            outputs.append(self._retire(request) if request.is_finished else self._output(request))
        return outputs

    def _append(self, request: Request, token: int, logprobs: dict[int, float] | None) -> None:
        request.output_token_ids.append(token)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        self.stats["generation_tokens"] += 1
        verdict = self._texts[request.request_id].push(request, token)
        if verdict is not None:
            request.finish(*verdict)
        elif request.num_tokens >= request.max_total_tokens:
            request.finish("length")

    def _retire(self, request: Request) -> RequestOutput:
        self.scheduler.finish(request)
        self.runner.forget(request.request_id)
        output = self._output(request)
        del self.requests[request.request_id]
        del self._texts[request.request_id]
        return output

    def _output(self, request: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self._texts[request.request_id].visible,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time or 0.0},
        )

    # ---- validation -------------------------------------------------------------------------
    def check_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, or ValueError naming what is wrong with it.

        A dict may carry `prompt_token_ids` (and optionally the `prompt` text they came from)."""
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        return text, token_ids

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), self._tokenize(list(ids))[1]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt_token_ids must be a list of integers")
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )

    def _max_model_len(self, layout: CacheLayout) -> int:
        limit = self.config.model.max_model_len or min(self.model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        capacity = layout.num_blocks * layout.block_size
        if limit > capacity:
            log.warning("max_model_len %d exceeds the cache capacity; using %d tokens", limit, capacity)
            limit = capacity
        return limit

    def _eos_ids(self, path: Path) -> set[int]:
        ids = set(self.model_config.eos_token_id)
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


@dataclass(frozen=True)
class StepShape:
    """What the last step computed: tokens of prompts (or recomputed history) and decode tokens."""

    prefill_tokens: int
    decode_tokens: int

    @staticmethod
    def of(out: SchedulerOutput) -> "StepShape":
        decode = sum(s.num_new_tokens for s in out.scheduled if s.is_decode)
        return StepShape(out.num_tokens - decode, decode)


class OutputText:
    """A request's decoded text so far and its stop conditions."""

    def __init__(self, tokenizer: Tokenizer | None, stop: StopChecker):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = stop

    def push(self, request: Request, token: int) -> tuple[str, int | str | None] | None:
        """Take the token just appended; (finish_reason, stop_reason) if the request must stop."""
        delta = self.detok.push(token) if self.detok else ""
        return self.stop.check(request, token, self.detok.text if self.detok else "", delta)

    @property
    def visible(self) -> str:
        return self.stop.visible_text(self.detok.text) if self.detok else ""


def _default_model() -> Path:
    from oxserve.default_model import ensure_default_model

    return ensure_default_model()
