"""Model runner: turns a `SchedulerOutput` into tensors, runs the model, samples.

The runner never decides policy: which requests run, and how many tokens each, arrive
decided. It owns the device-side state: the model, the cache tensors and the per-request
random generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxserve.cache.tensors import LayerCache
from oxserve.engine.sampler import SamplerOutput, SamplingRow, make_generator, sample
from oxserve.engine.scheduler import SchedulerOutput
from oxserve.model.batch import ForwardBatch
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.telemetry import Tracer, span


@dataclass
class StepResult:
    request_ids: list[str]  # the requests that sampled a token this step, in order
    sampled: SamplerOutput


class ModelRunner:
    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: list[LayerCache],
        block_size: int,
        device: torch.device,
        deterministic: bool = False,
    ):
        self.model = model
        self.deterministic = deterministic
        self.tracer: Tracer | None = None  # set by the profiler
        self.caches = caches
        self.block_size = block_size
        self.device = device
        self._generators: dict[str, torch.Generator | None] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.deterministic:
            # One request per forward pass: kernels see the same shapes whoever else is running.
            parts = [self._forward(SchedulerOutput([s], [])) for s in out.scheduled]
            logits = torch.cat(parts)
        else:
            logits = self._forward(out)
        sampling = [s for s in out.scheduled if s.completes_sequence]
        with span(self.tracer, "sample", track="engine"):
            rows = [self._sampling_row(s.request) for s in sampling]
            return StepResult([s.request.request_id for s in sampling], sample(logits, rows))

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        with span(self.tracer, "prepare_inputs", track="engine"):
            input_ids, batch = self.prepare(out)
        batch.tracer = self.tracer
        with span(self.tracer, "forward", track="engine", **step_conditions(batch)):
            hidden = self.model(input_ids, batch, self.caches)
            return self.model.compute_logits(hidden, self.tracer)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        tokens: list[int] = []
        positions: list[int] = []
        request_index: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for r, s in enumerate(out.scheduled):
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            tokens += s.request.token_slice(start, end)
            positions += range(start, end)
            request_index += [r] * s.num_new_tokens
            slot_mapping += [s.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            if s.completes_sequence:
                logits_indices.append(len(tokens) - 1)
        width = max(len(s.block_ids) for s in out.scheduled)
        tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in out.scheduled]
        as_long = self._as_long
        batch = ForwardBatch(
            query_lens=[s.num_new_tokens for s in out.scheduled],
            context_lens=[s.request.num_computed_tokens for s in out.scheduled],
            num_decodes=sum(s.is_decode for s in out.scheduled),
            positions=as_long(positions),
            request_index=as_long(request_index),
            slot_mapping=as_long(slot_mapping),
            block_tables=as_long(tables),
            state_slots=as_long([s.state_slot for s in out.scheduled]),
            block_size=bs,
            logits_indices=as_long(logits_indices),
        )
        return as_long(tokens), batch

    def _as_long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _sampling_row(self, request) -> SamplingRow:
        if request.request_id not in self._generators:
            self._generators[request.request_id] = make_generator(request.params.seed, self.device)
        return SamplingRow(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=self._generators[request.request_id],
        )


def step_conditions(batch: ForwardBatch) -> dict:
    """The conditions a step ran under, attached to its spans for bucketing."""
    contexts = batch.seq_lens
    return {
        "num_requests": batch.num_requests,
        "num_decodes": batch.num_decodes,
        "num_prefills": batch.num_requests - batch.num_decodes,
        "num_tokens": batch.num_tokens,
        "max_context": max(contexts) if contexts else 0,
        "mean_context": sum(contexts) / len(contexts) if contexts else 0.0,
        "decode_context_sum": sum(contexts[: batch.num_decodes]),
        "prefill_context_sum": sum(contexts[batch.num_decodes :]),
    }
