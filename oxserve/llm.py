"""The offline Python API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from oxserve.engine.engine import LLMEngine, Prompt
from oxserve.options import engine_config
from oxserve.outputs import CompletionOutput, RequestOutput
from oxserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=None, **options)`: the options are the engine options of `oxserve --help`
    (`dtype`, `max_num_seqs`, `cache_memory_gib`, ...), with the same defaults and checks."""

    def __init__(self, model: str | None = None, **options: Any):
        self.engine = LLMEngine(engine_config({"model": model, **options}))
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (they also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order. `priority`: one
        per prompt, lower runs first (needs `scheduling_policy="priority"`).

        All prompts are validated before any is queued, so a bad one raises ValueError and
        leaves the engine as it was.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        for value in priorities:
            self.engine.check_priority(value)
        checked = [self.engine.check_prompt(prompt) for prompt in prompts]  # all, before queueing any
        children: dict[str, tuple[int, int]] = {}
        for i, (inputs, p, urgency) in enumerate(zip(checked, params, priorities)):
            prompt = inputs.as_prompt()
            for j, child in enumerate(p.fan_out()):
                rid = f"llm-{self._counter}"
                self._counter += 1
                # Only final outputs are returned: none is built while the request runs (as vLLM's LLM asks).
                final_only = replace(child, output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(rid, prompt, final_only, urgency)
                children[rid] = (i, j)
        finished = run_to_completion(self.engine, set(children))
        return self._merge(prompts, children, finished)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _merge(prompts, children, finished) -> list[RequestOutput]:
        merged: list[RequestOutput | None] = [None] * len(prompts)
        for rid, (i, j) in sorted(children.items(), key=lambda kv: kv[1]):
            out = finished[rid]
            completion: CompletionOutput = replace(out.outputs[0], index=j)
            if merged[i] is None:
                merged[i] = RequestOutput(
                    request_id=str(i),
                    prompt=out.prompt,
                    prompt_token_ids=out.prompt_token_ids,
                    outputs=[completion],
                    finished=True,
                    metrics=out.metrics,  # the first choice's
                    prompt_logprobs=out.prompt_logprobs,
                    prompt_token_ranks=out.prompt_token_ranks,
                )
            else:
                merged[i].outputs.append(completion)
        return merged  # type: ignore[return-value]


def run_to_completion(engine: LLMEngine, request_ids: set[str]) -> dict[str, RequestOutput]:
    """Step the engine until it has nothing left; the final output of each of `request_ids`."""
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in request_ids:
                finished[out.request_id] = out
    return finished
