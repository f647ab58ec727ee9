"""The engine: `step()` is schedule -> run -> update.

    scheduler.schedule()            -> SchedulerOutput      (plain data: ids, tokens, blocks)
    runner.execute(...)             -> ModelRunnerOutput    (plain data: accepted tokens)
    scheduler.update_from_output()  -> RequestUpdates       (the scheduler changes request state)
    self._outputs(updates)          -> [RequestOutput]      (text, stop strings, what callers see)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from oxserve.cache.manager import CacheManager
from oxserve.cache.planner import plan_prefix_caching, plan_split_cache
from oxserve.cache.precision import CachePlan, LayerCachePrecision
from oxserve.cache.spec import CacheLayout
from oxserve.config import EngineConfig
from oxserve.disagg.connector import embedding_description, model_fingerprint
from oxserve.disagg.snapshot import CacheSnapshot, layout_of, whole_layout
from oxserve.engine.interface import SchedulerOutput
from oxserve.engine.memory import keep_freed_memory
from oxserve.engine.prefill_cost import prefill_cost
from oxserve.engine.request import Request
from oxserve.engine.runner import ModelRunner
from oxserve.engine.scheduler import RequestUpdate, Scheduler
from oxserve.engine.speculative import SpeculativeConfig, make_proposer
from oxserve.engine.output_text import OutputText, TextDeltas
from oxserve.engine.threads import choose_threads
from oxserve.faults import Faults
from oxserve.kernels.onednn import choose_linear_kernel
from oxserve.model.loader import load_model, load_vision_tower
from oxserve.model.vision import MultiModalConfig
from oxserve.multimodal.embedder import MultiModalEmbedder
from oxserve.multimodal.inputs import MultiModalItem, place_media
from oxserve.multimodal.processor import MediaProcessor, ProcessorConfig, expand_placeholders
from oxserve.outputs import CompletionOutput, RequestOutput
from oxserve.parallel.groups import ALONE
from oxserve.parallel.workers import ParallelError, RankPlan, WorkerGroup
from oxserve.quantization.on_load import choose_quantization, load_transform
from oxserve.quantization.plan import QuantizationPlan
from oxserve.sampling_params import RequestOutputKind, SamplingParams
from oxserve.structured.grammar import GrammarCompiler, check_constraint
from oxserve.telemetry import span
from oxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 32768

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class EngineStats:
    """Counters for the server's metrics and for benchmarks."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # tokens the waiting requests have still to compute
    cache_usage: float  # fraction of cache blocks in use
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of requests that produced their first token
    generation_tokens: int
    spec_drafts: int = 0  # speculative decoding: verifying steps (per request)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # ... and accepted; mean accept length = 1 + accepted / drafts
    grammar_mask_seconds: float = 0.0  # structured outputs: time computing and applying masks
    grammar_mask_steps: int = 0  # steps that masked at least one request
    prefix_queries: int = 0  # prefix caching: prompt tokens looked up (all but each prompt's last)
    prefix_hits: int = 0  # ... found in the cache, not computed
    prefix_requests: int = 0  # requests that looked
    prefix_hit_requests: int = 0  # ... and found a prefix
    prefix_checkpoints: int = 0  # KDA checkpoints held
    prefix_checkpoint_capacity: int = 0
    prefix_checkpoint_evictions: int = 0
    prefix_cached_blocks: int = 0  # blocks holding a hashed prefix (in use or free)
    prefix_block_evictions: int = 0  # hashed blocks reused for other content
    mm_items_encoded: int = 0  # images and videos the vision tower encoded
    mm_items_cached: int = 0  # ... found in the encoder cache instead


@dataclass(frozen=True)
class StepShape:
    """What the last step computed: tokens of prompts (or recomputed history) and decode tokens."""

    prefill_tokens: int
    decode_tokens: int

    @staticmethod
    def of(out: SchedulerOutput) -> StepShape:
        decode = out.num_decode_tokens
        return StepShape(out.num_tokens - decode, decode)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.model.device)
        check_parallel(config)
        self.workers = WorkerGroup(config.parallel, self.device) if config.parallel.world_size > 1 else None
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the parallel ranks, if any (a no-op otherwise, and when called again)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _build(self, config: EngineConfig) -> None:
        placement = self.workers.placement if self.workers is not None else ALONE
        self.threads = 0
        if self.device.type == "cpu":
            threads, why = choose_threads(config.model.threads)
            if placement.world_size > 1 and config.model.threads is None:
                ranks = placement.world_size
                threads, why = max(1, threads // ranks), f"{why}, shared among {ranks} parallel ranks"
            self.threads = threads
            torch.set_num_threads(threads)
            log.info("oxserve: %d intra-op thread(s), %s", threads, why)
            if keep_freed_memory():
                log.info("oxserve: freed activation memory stays mapped between steps (glibc mallopt)")
        path = Path(config.model.model) if config.model.model else _default_model()
        self.model_path = path
        self.dtype = DTYPES[config.model.dtype]
        plan_file = config.model.quantization_plan
        self.quantization_plan = QuantizationPlan.load(plan_file) if plan_file else None
        quantize = choose_quantization(config.model.quantization, self.device, config.model.smoothquant_alpha, self.quantization_plan)
        self.linear_kernel, kernel = choose_linear_kernel(config.model.linear_kernel, self.device, self.dtype)
        self.speculative = SpeculativeConfig.parse(config.scheduler.speculative_config)
        mtp = self.speculative is not None and self.speculative.method == "mtp"
        if mtp and placement.world_size > 1:
            raise ValueError("MTP speculative decoding runs on one rank; use the ngram method with parallel ranks")
        loaded = load_model(path, dtype=self.dtype, device=self.device, transform=load_transform(quantize, kernel),
                            tp=placement.tp, ls=placement.ls, with_mtp=mtp)  # fmt: skip
        log.info("oxserve: high-precision projection and LM head products through %s", self.linear_kernel)
        self.model_config = loaded.config
        Faults.from_env().plant_in_model(loaded.model)  # none unless the reliability suite asks
        self.tokenizer = Tokenizer.from_dir(path)
        embedder = self._vision(config, path, placement.world_size)
        if quantize is not None and self.workers is None:  # (parallel ranks calibrate together, once started)
            log.info("oxserve: %s", quantize.finish(loaded.model, self.tokenizer))
        limit = config.model.max_model_len or min(self.model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        kv = config.cache.kv_cache_dtype
        default = LayerCachePrecision(latent=kv, index_keys=kv, kda_state=config.cache.kda_state_dtype,
                                      kda_conv=config.cache.kda_conv_dtype)
        self.cache_plan = self.quantization_plan.cache_plan(default) if self.quantization_plan else CachePlan(default)
        self.kda_replay = config.cache.kda_replay_len if config.cache.kda_decode == "replay" else 0  # ring length
        if self.speculative:  # drafts are undone by moving ring counts: rings that hold a token and its drafts
            self.kda_replay = max(self.kda_replay, self.speculative.num_speculative_tokens + 1)
        # Under Layer Split each rank caches its own MLA layers: blocks that fit on every rank.
        specs_by_rank = [loaded.model.cache_specs(self.dtype, self.cache_plan, kda_replay=self.kda_replay, ls_rank=s)
                         for s in range(placement.ls.size)]  # fmt: skip
        if mtp:  # the MTP layer's own MLA cache, after the decoder layers' (one rank: see above), planned with them
            specs_by_rank[0].append(loaded.model.mtp.cache_spec(self.dtype, self.cache_plan.for_layer(len(loaded.model.layers))))
        cache_specs = specs_by_rank[placement.ls.rank]
        # Captured decode steps (one process only): their padding rows' block and slot are planned
        # with the rest
        capture_sizes = (() if config.model.enforce_eager or self.workers is not None
                         else config.model.capture_sizes(config.scheduler.max_num_seqs))
        layout = plan_split_cache(config.cache, config.scheduler, specs_by_rank, limit, spare=1 if capture_sizes else 0)
        # Disaggregation hands over the whole model's caches, however the ranks cut them
        self.kv_layout = whole_layout([layout_of([spec.allocate(layout, "meta") for spec in specs], layout.num_blocks,
                                                 layout.block_size) for specs in specs_by_rank], placement.tp.size)  # fmt: skip
        self.prefix_caching = plan_prefix_caching(config.cache, cache_specs, layout, prefill_cost(loaded.model))
        self.cache = CacheManager(layout.num_blocks, layout.block_size, layout.num_slots, self.prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.max_model_len = _fit_to_cache(limit, layout)
        self.eos_token_ids = frozenset(self._eos_ids(path))
        self.grammars = self._grammar_compiler()
        num_checkpoints = self.prefix_caching.num_checkpoints if self.prefix_caching else 0
        if self.workers is not None:
            self.workers.start(RankPlan(str(path), config.model.dtype, str(self.device), config.model.linear_kernel,
                                        max(1, self.threads), self.cache_plan, self.kda_replay, layout,
                                        config.scheduler.deterministic, num_checkpoints, config.model.seed,
                                        config.model.quantization, config.model.smoothquant_alpha, plan_file,
                                        embedder is not None),
                               loaded.model)  # fmt: skip
            if quantize is not None:  # SmoothQuant's calibration passes run on every rank in step
                with self.workers.guard("calibrating W8A8"):
                    log.info("oxserve: %s", quantize.finish(loaded.model, self.tokenizer))
                self.workers.compare(loaded.model, layout)  # every rank quantized the same modules (each smoothed its own)
        self.runner = ModelRunner(loaded.model, layout, cache_specs, self.device, deterministic=config.scheduler.deterministic,
                                  grammars=self.grammars, num_checkpoints=num_checkpoints, workers=self.workers,
                                  mtp_drafts=mtp, embedder=embedder, capture_sizes=capture_sizes)  # fmt: skip
        self.proposer = make_proposer(self.speculative, self.runner) if self.speculative else None
        self._drafting_s = 0.0  # the last proposal's time, charged to the step that verifies it
        self.role_token_ids = self.tokenizer.role_token_ids() if self.tokenizer is not None else frozenset()
        torch.manual_seed(config.model.seed)  # requests without their own seed draw from this
        self._texts: dict[str, OutputText] = {}
        self._deltas: dict[str, TextDeltas] = {}  # DELTA requests: what their outputs sent
        self._next_id = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.last_step = StepShape(0, 0)

    def _vision(self, config: EngineConfig, path: Path, world_size: int) -> MultiModalEmbedder | None:
        """The vision tower and media processor when this server takes images or video (what
        `self.media` and `self.mm` hold; None otherwise, with `self.mm_off_reason` saying why)."""
        self.mm_limits = config.model.mm_limits()
        self.mm = MultiModalConfig.from_file(path)
        self.media: MediaProcessor | None = None
        if self.mm is None:
            self.mm_off_reason = "the model has no vision tower"
        elif not any(self.mm_limits.values()):
            self.mm_off_reason = "--limit-mm-per-prompt allows none"
        elif self.tokenizer is None:
            self.mm_off_reason = "the model has no tokenizer to place image tokens with"
        else:
            tower = load_vision_tower(path, self.dtype, self.device)
            self.media = MediaProcessor(ProcessorConfig.for_model(path, self.mm.vision))
            return MultiModalEmbedder(tower, config.model.mm_encoder_cache_tokens, self.device, share=world_size > 1)
        return None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, export_caches: bool = False, kv_import: CacheSnapshot | None = None) -> str:  # fmt: skip
        """Validate and queue a request. Raises ValueError naming the problem; nothing else changes.
        `priority` (lower runs first) needs `scheduling_policy="priority"`.

        Disaggregation: with `export_caches` (max_tokens 1), the request's final output carries
        its caches (`RequestOutput.kv_snapshot`); with `kv_import` (a prefill instance's
        snapshot of this very prompt) it skips its prefill and decodes on from the snapshot's token."""
        params = params or SamplingParams()
        self.check_priority(priority)
        if params.n != 1:
            raise ValueError("the engine takes n=1 requests; use SamplingParams.fan_out() for n > 1")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, dict):  # the server's handover fields travel with the prompt
            export_caches = export_caches or bool(prompt.get("export_caches"))
            kv_import = kv_import if kv_import is not None else prompt.get("kv_import")
        checked = self.check_prompt(prompt)
        check_constraint(self.grammars, params.structured_outputs)
        token_ids = checked.token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_total_tokens=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            prompt=checked.text,
            priority=priority,
            boundaries=self._boundaries(token_ids),
            mm_items=checked.mm_items,
        )
        if export_caches or kv_import is not None:
            self._check_transfer(request, export_caches, kv_import)
        self.scheduler.add(request)
        self._texts[request_id] = OutputText(self.tokenizer, params)
        if params.output_kind is RequestOutputKind.DELTA:
            self._deltas[request_id] = TextDeltas(params)
        if kv_import is not None:
            self._texts[request_id].push(kv_import.first_token)
            self.runner.imports[request_id] = kv_import
        return request_id

    def _check_transfer(self, request: Request, export: bool, snap: CacheSnapshot | None) -> None:
        """Refuse a disaggregated request that cannot be handed over exactly; prepare the rest."""
        params = request.params
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need the whole prompt computed where they are asked for; send such "
                             "requests colocated")  # fmt: skip
        if export:
            if params.max_tokens != 1:
                raise ValueError("a request exporting its caches computes its prompt and one token: max_tokens must be 1")
            request.export_caches = True
            return
        if snap.prompt_token_ids != request.prompt_token_ids:
            raise ValueError(f"the transferred caches hold a different prompt ({snap.num_tokens} tokens) than this "
                             f"request's ({len(request.prompt_token_ids)}): the instances tokenize or template differently")  # fmt: skip
        if params.max_tokens is not None and params.max_tokens < 2:
            raise ValueError("the prefill instance sampled the only token asked for: nothing is left to decode")
        if params.logprobs is not None and snap.first_logprobs is None:
            raise ValueError("the request asks for logprobs, and the prefill instance sent none for its token")
        request.output_token_ids.append(snap.first_token)
        if params.logprobs is not None:
            request.output_logprobs.append(snap.first_logprobs)
        request.imported_tokens = snap.num_tokens

    def _boundaries(self, token_ids: list[int]) -> tuple[int, ...]:
        """Positions before a role token, where a turn starts, but the first (before it comes a
        fixed preamble) and the last (the generation header: the prompt's end is as good)."""
        marks = [i for i, t in enumerate(token_ids) if t in self.role_token_ids]
        return tuple(marks[1:-1])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.finish(request_id, "abort")
        return None if request is None else self._retire(request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False while requests hold cache: nothing changes)."""
        return self.cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=sum(r.num_uncomputed for r in self.scheduler.waiting),
            cache_usage=self.cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            spec_drafts=self.scheduler.num_drafts,
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            grammar_mask_seconds=self.runner.masks.cost.seconds if self.runner.masks else 0.0,
            grammar_mask_steps=self.runner.masks.cost.steps if self.runner.masks else 0,
            **self._prefix_stats(),
            **self._mm_stats(),
        )

    def _mm_stats(self) -> dict:
        if self.runner.embedder is None:
            return {}
        cache = self.runner.embedder.cache
        return dict(mm_items_encoded=cache.misses, mm_items_cached=cache.hits)

    def _prefix_stats(self) -> dict:
        checkpoints = self.cache.checkpoints
        if checkpoints is None:
            return {}
        s = self.cache.stats
        return dict(prefix_queries=s.queries, prefix_hits=s.hits, prefix_requests=s.requests,
                    prefix_hit_requests=s.hit_requests, prefix_checkpoints=len(checkpoints),
                    prefix_checkpoint_capacity=checkpoints.capacity, prefix_checkpoint_evictions=checkpoints.evictions,
                    prefix_cached_blocks=self.cache.blocks.num_cached, prefix_block_evictions=self.cache.blocks.evictions)

    def running_request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def unstarted_request_ids(self) -> list[str]:
        """Waiting requests that have never run (a preempted or requeued one has started)."""
        return [r.request_id for r in self.scheduler.waiting if not (r.num_preemptions or r.num_failed_steps)]

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        tracer = self.runner.tracer
        with span(tracer, "schedule", track="engine"):
            scheduled = self.scheduler.schedule()
        self.last_step = StepShape.of(scheduled)
        if self.runner.drafter is not None:
            self.runner.drafter.dormant = self.scheduler.drafting_dormant()
        if not scheduled.scheduled:
            self.runner.settle(scheduled)  # checkpoints of requests that just finished
            return []
        started = time.perf_counter()
        try:
            result = self.runner.execute(scheduled)
        except ParallelError:
            raise  # a lost rank: nothing can run, so there is nothing to isolate
        except Exception:
            return self._contain(scheduled)
        self.scheduler.observe_step(scheduled, time.perf_counter() - started + self._drafting_s, self.runner.novelty)
        with span(tracer, "postprocess", track="engine"):
            updates = self.scheduler.update_from_output(scheduled, result)
            outputs = [output for update in updates if (output := self._output_of(update)) is not None]
            if self.proposer is not None:  # drafts for the next step, which is charged their time
                drafting, self.proposer.deferred_s = time.perf_counter(), 0.0
                self.scheduler.propose_drafts(self.proposer, self.speculative.num_speculative_tokens)
                self._drafting_s = time.perf_counter() - drafting - self.proposer.deferred_s
            return outputs

    def _contain(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """A step raised: fail the request at fault, if this step tells which, and recompute
        the others (see `Scheduler.quarantine`)."""
        shape = self.last_step
        log.exception("engine step failed: %d request(s) (%s), %d prefill and %d decode tokens; isolating the one at fault",
                      len(scheduled.scheduled), ", ".join(s.request_id for s in scheduled.scheduled), shape.prefill_tokens,
                      shape.decode_tokens)  # fmt: skip
        failed = self.scheduler.quarantine(scheduled)
        for request in failed:
            log.error("%s failed alone in a step; it finishes with 'error'", request.request_id)
        return [self._retire(request) for request in failed]

    def _output_of(self, update: RequestUpdate) -> RequestOutput | None:
        """The request's output after this step's tokens (None: it wants none until it finishes)."""
        request = update.request
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self._prompt_tokens += len(request.prompt_token_ids)
        self._generation_tokens += len(update.new_token_ids)
        text = self._texts[request.request_id]
        for token in update.new_token_ids:
            if (hit := text.push(token)) is not None:
                # The stop string decides over a token stop the scheduler found on the same token.
                if request.is_finished:
                    request.finish("stop", hit)
                else:
                    self.scheduler.finish(request.request_id, "stop", hit)
                break
        if request.is_finished:
            return self._retire(request)
        return None if request.params.output_kind is RequestOutputKind.FINAL_ONLY else self._output(request)

    def _retire(self, request: Request) -> RequestOutput:
        output = self._output(request)
        if request.export_caches and request.output_token_ids and request.finish_reason not in ("abort", "error"):
            output.kv_snapshot = self._snapshot(request)
        self.scheduler.forget(request.request_id)
        del self._texts[request.request_id]
        self._deltas.pop(request.request_id, None)
        return output

    def _snapshot(self, request: Request) -> CacheSnapshot:
        """The finished prefill's caches, first token and sampler state (before its blocks can be reused)."""
        rid = request.request_id
        logprobs = request.output_logprobs[0] if request.output_logprobs else None
        return CacheSnapshot(list(request.prompt_token_ids), request.output_token_ids[0], logprobs,
                             self.runner.generator_state(rid), self.runner.export_caches(rid, len(request.prompt_token_ids)))

    def seed_embeddings(self, tensors: dict[str, torch.Tensor]) -> None:
        """An encode instance's embeddings (named by content hash, hex), for prompts to find
        in the encoder cache instead of encoding (any thread)."""
        embedder = self.runner.embedder
        if embedder is None:
            raise ValueError(f"this server takes no images or video: {self.mm_off_reason}")
        width = self.mm.vision.out_hidden_size
        if any(v.dim() != 2 or v.shape[1] != width for v in tensors.values()):
            raise ValueError(f"embeddings must be [n, {width}] for this model")
        embedder.cache.seed({bytes.fromhex(k): v.to(embedder.device, embedder.dtype) for k, v in tensors.items()})

    def mm_description(self) -> dict:
        """What an encode instance must send this one (its embeddings' model, dtype and width)."""
        if self.runner.embedder is None:
            raise ValueError(f"this server takes no images or video: {self.mm_off_reason}")
        return embedding_description(self.model_path, str(self.dtype), self.mm.vision.out_hidden_size)

    def kv_description(self) -> dict:
        """What a cache handover needs both sides to agree on: the model's weights and dtype, and
        the caches' tables (see `oxserve.disagg.connector`)."""
        return {"model": model_fingerprint(self.model_path, self.config.model.dtype), "layout": self.kv_layout}

    def _output(self, request: Request) -> RequestOutput:
        """Everything so far; with DELTA, what earlier outputs did not carry (the text's
        possible start of a stop string held back until it finishes; the prompt's logprobs in
        the first only)."""
        text = self._texts[request.request_id].visible
        logprobs = request.output_logprobs if request.params.logprobs is not None else None
        deltas = self._deltas.get(request.request_id)
        first = deltas is None or deltas.deltas_sent == 0
        if deltas is None:
            token_ids, logprobs = list(request.output_token_ids), None if logprobs is None else list(logprobs)
        else:
            text, token_ids, logprobs = deltas.next(text, request.output_token_ids, logprobs, request.is_finished)
        completion = CompletionOutput(index=0, text=text, token_ids=token_ids, logprobs=logprobs,
                                      finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        # Shared, not copied: once complete, the scheduler never touches them again.
        scored = first and request.params.prompt_logprobs is not None and len(request.prompt_logprobs) == len(request.prompt_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time or 0.0},
            prompt_logprobs=request.prompt_logprobs if scored else None,
            prompt_token_ranks=request.prompt_token_ranks if scored else None,
        )

    # ---- validation -------------------------------------------------------------------------
    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs priority scheduling; the server runs with --scheduling-policy "
                             f"{self.config.scheduler.scheduling_policy}")  # fmt: skip

    def check_prompt(self, prompt: Prompt) -> PromptInputs:
        """A prompt tokenized (with its images and videos placed), or ValueError naming what is
        wrong with it. Safe to call from any thread: it reads no engine state that changes.

        A dict may carry `prompt_token_ids` (and optionally the `prompt` text they came from),
        or `prompt` text with `multi_modal_data` ({"image": image(s), "video": video(s)}, as
        vLLM takes them: PIL images, `oxserve.multimodal.Video`s) whose places the text marks
        with `<|image|>` / `<|video|>`. What this returns is itself a prompt (`as_prompt()`)."""
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            checked = self._multimodal(prompt)
        elif isinstance(prompt, dict) and prompt.get("mm_items"):
            if self.media is None:
                raise ValueError(f"this server takes no images or video: {self.mm_off_reason}")
            checked = PromptInputs(prompt.get("prompt"), self._tokenize(prompt)[1], tuple(prompt["mm_items"]))
        else:
            checked = PromptInputs(*self._tokenize(prompt))
        check_prompt_ids(checked.token_ids, self.model_config.vocab_size, self.max_model_len)
        return checked

    def _multimodal(self, prompt: dict) -> PromptInputs:
        text, data = prompt.get("prompt"), prompt["multi_modal_data"]
        if self.media is None:
            raise ValueError(f"this server takes no images or video: {self.mm_off_reason}")
        if not isinstance(text, str):
            raise ValueError("a prompt with multi_modal_data needs its text in 'prompt', with <|image|> and "
                             "<|video|> where they go")  # fmt: skip
        if not isinstance(data, dict) or set(data) - {"image", "video"}:
            raise ValueError("multi_modal_data takes the keys 'image' and 'video'")
        images, videos = _as_list(data.get("image")), _as_list(data.get("video"))
        for name, items in (("image", images), ("video", videos)):
            if len(items) > self.mm_limits[name]:
                raise ValueError(f"this prompt has {len(items)} {name}(s); the server takes at most "
                                 f"{self.mm_limits[name]} (--limit-mm-per-prompt)")  # fmt: skip
        media = [self.media.image(i) for i in images] + [self.media.video(v) for v in videos]
        expanded = expand_placeholders(text, media)
        token_ids = self.tokenizer.encode(expanded)
        return PromptInputs(text, token_ids, place_media(token_ids, media, self.mm))

    def _grammar_compiler(self) -> GrammarCompiler | None:
        if self.tokenizer is None:
            return None
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else min(self.eos_token_ids)
        return GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size, eos)

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

    def _eos_ids(self, path: Path) -> set[int]:
        ids = set(self.model_config.eos_token_id)
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


class PromptError(ValueError):
    """A prompt the engine cannot take; `field` is what to change: "prompt" or "max_tokens"."""

    def __init__(self, message: str, field: str = "prompt"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PromptInputs:
    text: str | None
    token_ids: list[int]
    mm_items: tuple[MultiModalItem, ...] = ()

    def as_prompt(self) -> dict:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids, "mm_items": self.mm_items}


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_prompt_ids(token_ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """PromptError naming what is wrong with a prompt: empty, ids outside the vocabulary, no
    room left for one token (or, with `max_tokens`, for that many) within max_model_len."""
    if not token_ids:
        raise PromptError("the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len); the prompt has "
            f"{len(token_ids)} tokens, which leaves no room for a completion. Shorten the prompt."
        )
    if max_tokens is not None and len(token_ids) + max_tokens > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you requested "
            f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} for the completion). "
            "Reduce the prompt or max_tokens.",
            "max_tokens",
        )


def check_parallel(config: EngineConfig) -> None:
    """ValueError for parallel options the engine's process cannot take."""
    parallel = config.parallel
    if parallel.node_rank > 0:
        raise ValueError(f"node_rank={parallel.node_rank}: only host 0 runs the engine; the others run their ranks with "
                         "`oxserve serve --node-rank N` and the same parallel options")  # fmt: skip


def _fit_to_cache(limit: int, layout: CacheLayout) -> int:
    capacity = layout.num_blocks * layout.block_size
    if limit > capacity:
        log.warning("max_model_len %d exceeds the cache capacity; using %d tokens", limit, capacity)
        return capacity
    return limit


def _default_model() -> Path:
    from oxserve.default_model import default_model

    return default_model()
