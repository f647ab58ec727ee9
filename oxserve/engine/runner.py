"""Model runner: turns a `SchedulerOutput` into tensors, runs the model, samples.

The runner never decides policy: which requests run, and how many tokens each, arrive
decided, as plain data. It owns the device-side state (the model, the cache tensors) and
what it must remember of each request between steps (`RequestState`): its block table,
its prompt and the output tokens fed so far (for penalties), and its random generator.

Under tensor parallelism every rank has a runner over its piece of the model; rank 0's sends
each step to the others (`WorkerGroup`) before running it, and only rank 0 gets logits and
samples. With speculative decoding rank 0 also tells the others how many drafts each
request kept, so that every rank's KDA states undo the same rejected tokens.
"""

from __future__ import annotations

import functools
import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from oxserve import huge_pages
from oxserve.cache.layers import KDACache
from oxserve.cache.replay import ReplayBook
from oxserve.cache.spec import CacheLayout, LayerCacheSpec, replay_length
from oxserve.cache.store import CheckpointStore
from oxserve.engine.interface import (
    NEW_SHAPE,
    STEADY,
    ModelRunnerOutput,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from oxserve.disagg.snapshot import CacheSnapshot, TensorCut, export_caches, import_caches, join_pieces, needed_part
from oxserve.engine.capture import CapturedDecode, StepRecording, has_forward_hooks
from oxserve.engine.mtp_drafter import MTPDrafter
from oxserve.engine.padding import PADDING_TOKEN, DecodePadding
from oxserve.engine.prompt_logprobs import score_prompt_tokens
from oxserve.engine.sampler import SamplingRow, make_generator, sample
from oxserve.engine.speculative import verify
from oxserve.kernels.rows import argmax_fit, argmax_native
from oxserve.model.batch import BatchRequest, BlockIds, host_tensor, make_forward_batch, table_shape
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.multimodal.embedder import MultiModalEmbedder, ReceivedEmbeddings, RowSpan, placeholder_rows
from oxserve.multimodal.inputs import MultiModalItem
from oxserve.parallel.workers import WorkerGroup, gather_pieces, share_accepted
from oxserve.sampling_params import SamplingParams
from oxserve.structured.grammar import GrammarCompiler
from oxserve.structured.masks import BatchMasks, RequestGrammar
from oxserve.telemetry import Tracer, span

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # output tokens fed to the model so far
    blocks: BlockIds
    generator: torch.Generator | None  # seeded per request; None -> the default RNG
    grammar: RequestGrammar | None = None  # structured outputs: the output's matcher so far
    mm_items: tuple[MultiModalItem, ...] = ()  # images and videos in the prompt
    slot: int = -1  # its KDA state slot in the last step


class ModelRunner:
    def __init__(
        self,
        model: Glm5NextForCausalLM,
        layout: CacheLayout,
        cache_specs: list[LayerCacheSpec],
        device: torch.device,
        deterministic: bool = False,
        grammars: GrammarCompiler | None = None,
        num_checkpoints: int = 0,
        workers: WorkerGroup | None = None,
        mtp_drafts: bool = False,
        embedder: MultiModalEmbedder | ReceivedEmbeddings | None = None,
        capture_sizes: tuple[int, ...] = (),
    ):
        self.model = model
        if torch.device(device).type == "cpu" and (moved := huge_pages.move_weights(model)):  # before a recording keeps an address
            log.info("oxserve: %.1f MB of weights on transparent huge pages", moved / 1e6)
        self.workers = workers  # tensor parallelism, on rank 0: the other ranks
        capturing = bool(capture_sizes) and workers is None  # (one process only: parallel ranks run eagerly)
        self.padding: DecodePadding | None = None  # decode batches filled up to a captured size
        if capturing:
            layout, self.padding = DecodePadding.past(layout, capture_sizes)
        self.layout = layout
        self.device = device
        self.deterministic = deterministic
        self.tracer: Tracer | None = None  # set by the profiler
        self.caches = [spec.allocate(layout, device) for spec in cache_specs]
        self.kda_caches = [cache for cache in self.caches if isinstance(cache, KDACache)]
        # MTP speculation: the MTP layer's cache is the last one, after the decoder layers'
        self.drafter = MTPDrafter(model, self.caches[-1], layout, device, captures=capturing) if mtp_drafts else None
        ring = replay_length(cache_specs)
        self.rings = ReplayBook(layout.num_slots, ring) if ring else None  # KDA ReplaySSM ring counts
        self.checkpoints = CheckpointStore(cache_specs, num_checkpoints, device) if num_checkpoints else None  # prefix caching
        self.requests: dict[str, RequestState] = {}
        self._step_hidden: torch.Tensor | None = None  # MTP drafting: this step's hidden states, every row
        # A replay's logits and the argmax it made of their rows: the sampler takes that argmax
        # only for these very logits (not for a copy, a concatenation, or logits from elsewhere).
        self._replay_greedy: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.grammars = grammars
        self.masks = BatchMasks(grammars.vocab_size) if grammars is not None else None
        self.embedder = embedder  # images and video: their embeddings for placeholder rows
        self.imports: dict[str, CacheSnapshot] = {}  # disaggregation: caches waiting for their request's first step
        # Decode steps replayed from recordings (its forward holds the model and caches, not the
        # runner: no reference cycle keeps a closed engine's caches alive until the garbage
        # collector runs)
        self.captured = (CapturedDecode(functools.partial(decode_logits, model, self.caches, self.kda_caches),
                                        max(capture_sizes)) if capturing else None)  # fmt: skip
        # The last step's `CapturedDecode.novelty` (the most novel of its passes): what its time
        # says of the steps of its shape to come (`Scheduler.observe_step`).
        self.novelty = STEADY
        self._drafting_novelty = STEADY  # of the MTP passes that drafted for the next step

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.imports.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(request_id)

    @torch.inference_mode()
    def propose_drafts(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """MTP drafts: up to k for each request in `wanted` (that sampled in the last step).
        Drafts are optional: a failure to make them is logged, and the step goes on plainly."""
        with span(self.tracer, "mtp_draft", track="engine"):
            self.drafter.catch_up_s = 0.0
            try:
                drafts = self.drafter.propose(wanted, self._block_tables(wanted))
                self._drafting_novelty = self.drafter.novelty  # (the step these drafts go into is charged them)
                return drafts
            except Exception:  # noqa: BLE001 -- never let an optional draft fail the requests
                log.exception("oxserve: MTP drafting failed; this step's requests decode without drafts")
                self.drafter.clear()
                return {}

    def _block_tables(self, request_ids) -> dict[str, list[int]]:
        return {rid: self.requests[rid].blocks.ids for rid in request_ids}

    def settle(self, out: SchedulerOutput) -> None:
        """A step with nothing to compute: forget finished requests, apply prefix-cache ops."""
        if self.workers is not None:
            self.workers.send("settle", out.without_pixels())
        with self._guard("settling a step"):
            self._settle_step_drafts(out)
            self.drop(out.finished_request_ids)
            self.apply_cache_ops(out)

    def _guard(self, what: str):
        return self.workers.guard(what) if self.workers is not None else nullcontext()

    @torch.inference_mode()
    def apply_cache_ops(self, out: SchedulerOutput) -> None:
        """Prefix caching's saves, restores and block copies, before anything else of the step."""
        if out.cache_ops:
            with span(self.tracer, "prefix_cache_ops", track="engine"):
                self.checkpoints.apply(out.cache_ops, self.caches, self.rings, self.layout.num_blocks)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's accepted tokens (None on a tensor-parallel rank but the first)."""
        if self.workers is not None:  # (with the caches of the requests it imports: each rank takes its piece)
            self._encode_ahead(out)
            self.workers.send("step", out.without_pixels(), {s.request_id: self.imports[s.request_id]
                                                             for s in out.scheduled if s.request_id in self.imports})
        with self._guard("running a step"):
            return self._execute(out)

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        self._replay_greedy = None
        self.novelty, self._drafting_novelty = self._drafting_novelty, STEADY
        self._settle_step_drafts(out)
        self.apply_cache_ops(out)
        self._update_states(out)
        scheduled = sorted(out.scheduled, key=_batch_order)
        if self.deterministic:
            # One request per forward pass: kernels see the same shapes whoever else is running.
            passes = []
            for s in scheduled:  # logits copied out: the next replay of a captured step overwrites its own
                p_logits, p_scored = self._forward([s])
                passes.append((None if p_logits is None else p_logits.clone(), p_scored))
            logits = None if passes[0][0] is None else torch.cat([p_logits for p_logits, _ in passes])
            prompt_logprobs = {rid: scored for _, p_scored in passes for rid, scored in p_scored.items()}
        else:
            logits, prompt_logprobs = self._forward(scheduled)
        if logits is None:  # a parallel rank but the first: rank 0 samples
            verifying = [s for s in scheduled if s.samples and s.verifies]
            if verifying:  # undo what rank 0 rejected, in this rank's KDA states too
                self._undo_rejected(list(zip(verifying, share_accepted(None, len(verifying)))))
            return None
        sampling = [s for s in scheduled if s.samples]
        with span(self.tracer, "sample", track="engine"):
            tokens, logprobs = self._sample(sampling, logits)
        if self.drafter is not None:
            self._advance_drafter(scheduled, {s.request_id: t for s, t in zip(sampling, tokens)})
        return ModelRunnerOutput(request_ids=[s.request_id for s in sampling], sampled_token_ids=tokens, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs)

    def _advance_drafter(self, scheduled: list[ScheduledRequest], yielded: dict[str, list[int]]) -> None:
        """The MTP pass after the step (its tokens are final): a failure costs drafts only."""
        with span(self.tracer, "mtp_advance", track="engine"):
            try:
                self.drafter.advance(scheduled, self._step_hidden, yielded, self._block_tables(s.request_id for s in scheduled))
                self._observe_novelty(self.drafter.novelty)
            except Exception:  # noqa: BLE001 -- the step's tokens stand; only the drafts are lost
                log.exception("oxserve: the MTP pass failed; drafting restarts from the next step")
                self.drafter.clear()
            finally:
                self._step_hidden = None

    def _settle_step_drafts(self, out: SchedulerOutput) -> None:
        """Before the step's cache operations: the MTP passes owed by requests that left their
        blocks since the last step (requeued; finished, where prefix caching may copy or
        share their blocks) and those owed in the blocks the operations copy."""
        if self.drafter is not None and (out.requeued_request_ids or out.finished_request_ids or out.cache_ops.copies):
            left = out.requeued_request_ids + (out.finished_request_ids if self.checkpoints is not None else [])
            self._settle_drafts(left, {src for src, _ in out.cache_ops.copies})

    @torch.inference_mode()
    def _settle_drafts(self, left: list[str], copied: set[int]) -> None:
        """`MTPDrafter.settle`: a failure costs drafts only."""
        if not (owing := [rid for rid in self.drafter.owing() if rid in self.requests]):
            return
        with span(self.tracer, "mtp_settle", track="engine"):
            try:
                self.drafter.settle(left, copied, self._block_tables(owing))
            except Exception:  # noqa: BLE001 -- the step's requests stand; only the drafts are lost
                log.exception("oxserve: an owed MTP pass failed; drafting restarts from the next step")
                self.drafter.clear()

    def _sample(self, sampling: list[ScheduledRequest], logits: torch.Tensor) -> tuple[list[list[int]], list]:
        """One token per plain request; for a request verifying drafts, the drafts it keeps
        and one more. The rows of `logits` follow `sampling` (a verify has one per token)."""
        plain = [i for i, s in enumerate(sampling) if not s.verifies]
        all_plain = len(plain) == len(sampling)  # one row each: no split (a decode step of 32 makes 32 views)
        per_request = None if all_plain else logits.split([s.num_new_tokens if s.verifies else 1 for s in sampling])
        tokens: list[list[int]] = [[] for _ in sampling]
        logprobs: list = [None] * len(sampling)
        if plain:
            rows = [self._sampling_row(sampling[i].request_id) for i in plain]
            grammars = [self._grammar(sampling[i].request_id) for i in plain]
            masked = self.masks is not None and any(g is not None for g in grammars)
            if not all_plain:
                plain_logits = torch.cat([per_request[i] for i in plain])
            else:  # a copy only where a mask writes to it: `sample` leaves its logits untouched
                plain_logits = logits.clone() if masked else logits
            if masked:
                with span(self.tracer, "grammar_mask", track="engine"):
                    self.masks.apply(plain_logits, grammars)
            made, greedy = self._replay_greedy or (None, None)
            sampled = sample(plain_logits, rows, greedy if plain_logits is made else None)
            for i, token, lp, grammar in zip(plain, sampled.token_ids, sampled.logprobs, grammars):
                tokens[i], logprobs[i] = [token], None if lp is None else [lp]
                if grammar is not None:
                    grammar.accept(token)
        kept = []
        argmax = self._verify_argmax(sampling, logits)
        for i, s in enumerate(sampling):
            if s.verifies:
                verified = verify(per_request[i], s.token_ids[-s.num_draft_tokens :], self._sampling_row(s.request_id),
                                  argmax[i] if argmax else None)
                tokens[i], logprobs[i] = verified.token_ids, verified.logprobs
                # The kept drafts are output now (penalties count them); the extra token is fed next step.
                self.requests[s.request_id].output_token_ids.extend(verified.token_ids[:-1])
                kept.append((s, len(verified.token_ids) - 1))
        if kept:
            if self.workers is not None:  # the other ranks' KDA states keep the same tokens
                share_accepted([n for _, n in kept], len(kept))
            self._undo_rejected(kept)
        return tokens, logprobs

    def _verify_argmax(self, sampling: list[ScheduledRequest], logits: torch.Tensor) -> list[list[int] | None] | None:
        """Per sampling request, its rows' argmax where the captured step made them with these
        logits and the request verifies drafts (else None in its place; None for all when none)."""
        made, greedy = self._replay_greedy or (None, None)
        if greedy is None or made is not logits or not any(s.verifies for s in sampling):
            return None
        rows, out, start = greedy.tolist(), [], 0
        for s in sampling:
            n = s.num_new_tokens if s.verifies else 1
            out.append(rows[start : start + n] if s.verifies else None)
            start += n
        return out

    def _undo_rejected(self, kept: list[tuple[ScheduledRequest, int]]) -> None:
        """After verifying: each KDA layer keeps the conv state after the last kept token,
        and the rings forget the entries of rejected drafts. (MLA entries of rejected
        positions are simply overwritten when those positions are computed again.)"""
        for cache in self.kda_caches:
            cache.accept([n for _, n in kept])
        if self.rings is not None:
            for s, n in kept:
                self.rings.rollback(s.state_slot, s.num_draft_tokens - n)

    def _update_states(self, out: SchedulerOutput) -> None:
        self.drop(out.finished_request_ids)
        for new in out.new_requests:
            old = self.requests.get(new.request_id)  # resumed after preemption: keep its generator
            generator = old.generator if old is not None else make_generator(new.params.seed, self.device)
            grammar = old.grammar if old is not None else None
            self.requests[new.request_id] = RequestState(new.params, new.prompt_token_ids, list(new.output_token_ids), BlockIds(),
                                                         generator, grammar, new.mm_items)
            if self.drafter is not None:
                self.drafter.restart(new.request_id)
        for s in out.scheduled:
            state = self.requests[s.request_id]
            state.blocks.extend(s.new_block_ids)
            state.slot = s.state_slot
            if (snap := self.imports.pop(s.request_id, None)) is not None:
                self._import(state, snap)
            n_prompt = len(state.prompt_token_ids)
            real = s.token_ids[: s.num_new_tokens - s.num_draft_tokens]
            skip = max(0, n_prompt - s.num_computed_tokens)  # this step's tokens that are still prompt
            del state.output_token_ids[max(0, s.num_computed_tokens - n_prompt) :]  # re-fed after a rollback
            state.output_token_ids.extend(real[skip:])

    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """The logits of the sampling rows (as `_sample` takes them) and the prompt tokens
        this step scores."""
        mm_embeds = self._mm_embeddings(scheduled)
        with span(self.tracer, "prepare_inputs", track="engine"):
            requests = [
                BatchRequest(s.num_computed_tokens, s.num_new_tokens, self.requests[s.request_id].blocks.ids, s.state_slot,
                             s.samples, s.num_draft_tokens, s.prompt_logprob_positions,
                             self.requests[s.request_id].blocks.array())
                for s in scheduled
            ]
            size, shape = self._decode_size(scheduled, requests)
            padding = self.padding.rows(size - len(scheduled)) if size else []
            steady = None if mm_embeds is not None else self._steady_recording(size, shape, scheduled)
            if steady is None:
                batch = make_forward_batch(requests + padding, self.model.config, self.layout.block_size,
                                           self.layout.num_blocks, self.device, self.rings)  # fmt: skip
                input_ids = host_tensor([t for s in scheduled for t in s.token_ids] + [PADDING_TOKEN] * len(padding),
                                        self.device)  # fmt: skip
        if steady is not None:
            return self._replay_steady(steady, scheduled, requests + padding)
        batch.tracer = self.tracer
        with span(self.tracer, "forward", track="engine", **step_conditions(batch), padding_rows=len(padding)):
            if self._replayable(batch, scheduled, mm_embeds):
                return self._replayed(self.captured.run(input_ids, batch, recurs=size is not None), len(padding))
            if self.drafter is None:
                hidden = self.model(input_ids, batch, self.caches, mm_embeds=mm_embeds)
            else:  # the drafter reads every row's hidden state after sampling
                self._step_hidden = self.model(input_ids, batch, self.caches, all_rows=True, mm_embeds=mm_embeds)
                hidden = self._step_hidden[batch.logits_indices]
            num_sampling_rows = len(hidden) - len(padding) - sum(len(s.prompt_logprob_positions) for s in scheduled)
            logits = self.model.compute_logits(hidden[:num_sampling_rows], self.tracer)
        if num_sampling_rows + len(padding) == len(hidden):
            return logits, {}
        with span(self.tracer, "prompt_logprobs", track="engine"):
            return logits, self._score_prompts(scheduled, hidden[num_sampling_rows:])

    def _replayed(self, outputs: tuple, num_padding: int) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """`_forward`'s result from a replay's outputs (`decode_logits`), whose last
        `num_padding` rows are padding."""
        logits, staged, greedy, hidden = outputs
        self._observe_novelty(self.captured.novelty)
        if self.drafter is not None:  # every row's (`_replayable`), padding rows last
            self._step_hidden = hidden
        for cache, conv in zip(self.kda_caches, staged):  # a replay stages what its recording did
            cache.staged_conv = conv
        if num_padding:  # (the padding rows are the last)
            logits, greedy = logits[:-num_padding], None if greedy is None else greedy[:-num_padding]
        self._replay_greedy = (logits, greedy)
        return logits, {}

    def _steady_recording(self, size: int | None, shape: tuple[int, int] | None,
                          scheduled: list[ScheduledRequest]) -> StepRecording | None:
        """The recording a step of plain decodes replays with its inputs written in place
        (`CapturedDecode.steady_decodes`), if it has one and is not traced (a traced step takes
        `CapturedDecode.run`, which times spans). Every request must sample: a one-token prompt
        chunk on a cached context is a decode that does not."""
        if size is None or self.tracer is not None or not all(s.samples for s in scheduled):
            return None
        return self.captured.steady_decodes((size, *shape))

    def _replay_steady(self, recording: StepRecording, scheduled: list[ScheduledRequest],
                       requests: list[BatchRequest]) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """Replay a step of plain decodes (`requests`: the scheduled ones, then padding rows)
        written straight into the recording's tensors."""
        token_ids = [s.token_ids[0] for s in scheduled] + [PADDING_TOKEN] * (len(requests) - len(scheduled))
        recording.decode_rows.write(requests, token_ids, self.layout.num_blocks, self.model.config.index_kpool, self.rings)
        with span(self.tracer, "forward", track="engine"):
            return self._replayed(self.captured.replay_steady(recording), len(requests) - len(scheduled))

    def _decode_size(self, scheduled: list[ScheduledRequest],
                     requests: list[BatchRequest]) -> tuple[int | None, tuple[int, int] | None]:
        """The batch size a step of plain decodes replays as (`DecodePadding.size_for`: padding
        rows fill it up) and its `table_shape`; (None, None) for other steps, in deterministic
        mode, and where a step of decodes would not replay."""
        if (self.padding is None or self.deterministic or has_forward_hooks(self.model)
                or not all(s.is_decode and not s.verifies and not s.prompt_logprob_positions for s in scheduled)):
            return None, None  # fmt: skip (deterministic: every pass one request, whatever ran before)
        shape = table_shape(requests, self.layout.block_size)  # (padding rows leave it as it is)
        return self.padding.size_for(len(scheduled), self.captured.decode_sizes(*shape), self.captured.recording_s), shape

    def _replayable(self, batch, scheduled: list[ScheduledRequest], mm_embeds) -> bool:
        """A step of decodes and verifies (`CapturedDecode.wants`) whose logits are its sampling
        rows (with MTP drafting: all its rows, whose hidden states the drafter reads), on a model
        without Python hooks (fault injection, tests), which a replay would skip."""
        return (self.captured is not None and mm_embeds is None and self.captured.wants(batch)
                and not any(s.prompt_logprob_positions for s in scheduled) and not has_forward_hooks(self.model)
                and (self.drafter is None or batch.logits_indices.shape[0] == batch.num_tokens))  # fmt: skip

    def _observe_novelty(self, novelty: str) -> None:
        """The step's novelty is its most novel pass's."""
        if self.novelty != NEW_SHAPE:
            self.novelty = novelty or self.novelty

    def export_caches(self, request_id: str, num_tokens: int) -> dict[str, torch.Tensor]:
        """Copies of the caches of a request's first `num_tokens` tokens, the whole model's
        (right after the step that computed them, before its blocks can be reused)."""
        if self.workers is None:
            return self.export_piece(request_id, num_tokens)
        self.workers.send("export", request_id, num_tokens)
        with self._guard("gathering a request's caches"):
            return join_pieces(gather_pieces(self.export_piece(request_id, num_tokens)), self.model.tp.size)

    @torch.inference_mode()
    def export_piece(self, request_id: str, num_tokens: int) -> dict[str, torch.Tensor]:
        """This rank's piece of `export_caches` (of a parallel rank's: what rank 0 keeps of it)."""
        state = self.requests[request_id]
        if self.drafter is not None:  # (its MTP entries go too)
            self._settle_drafts([request_id], set())
        blocks = state.blocks.ids[: -(-num_tokens // self.layout.block_size)]
        piece = export_caches(self.caches, self.layout.num_blocks, blocks, state.slot, self.rings)
        return needed_part(piece, self.model.tp.rank, self.model.ls.rank)

    def generator_state(self, request_id: str) -> bytes | None:
        generator = self.requests[request_id].generator
        return None if generator is None else bytes(generator.get_state().numpy())

    def _import(self, state: RequestState, snap: CacheSnapshot) -> None:
        blocks = state.blocks.ids[: -(-snap.num_tokens // self.layout.block_size)]
        with torch.inference_mode():
            import_caches(self.caches, self.layout.num_blocks, blocks, state.slot, snap.tensors,
                          TensorCut(self.model.tp.rank, self.model.tp.size))  # fmt: skip
        if self.rings is not None:
            self.rings.counts[state.slot] = 0
        if state.generator is not None and snap.generator_state is not None:
            state.generator.set_state(torch.frombuffer(bytearray(snap.generator_state), dtype=torch.uint8))

    def _encode_ahead(self, out: SchedulerOutput) -> None:
        """Rank 0 of parallel ranks: encode the images this step reaches before the other ranks
        start it, so that one that breaks the vision tower fails its request, as in one
        process, and not the ranks' step (the forward then finds them in the encoder cache)."""
        if self.embedder is None:
            return
        new = {n.request_id: n.mm_items for n in out.new_requests}  # (not in self.requests before this step runs)
        spans = _image_spans(out.scheduled, lambda rid: new[rid] if rid in new else self.requests[rid].mm_items)
        if items := [item for item, _, _ in placeholder_rows(spans)]:
            self.embedder.encode(items, self.tracer)

    def _mm_embeddings(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Image and video embeddings for the placeholder rows of this step (None: no such rows)."""
        if self.embedder is None:
            return None
        spans = _image_spans(scheduled, lambda rid: self.requests[rid].mm_items)
        return self.embedder.step_embeddings(spans, self.tracer) if spans else None

    def _score_prompts(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        scoring = [s for s in scheduled if s.prompt_logprob_positions]
        states = [self.requests[s.request_id] for s in scoring]
        return score_prompt_tokens(self.model, hidden, scoring, [state.prompt_token_ids for state in states],
                                   [state.params.prompt_logprobs for state in states])

    def _grammar(self, request_id: str) -> RequestGrammar | None:
        """The request's matcher, made at its first sample (kept across preemption, like its
        generator, since the output it has matched so far is kept)."""
        state = self.requests[request_id]
        constraint = state.params.structured_outputs
        if constraint is not None and state.grammar is None:
            assert self.grammars is not None  # the engine refuses constraints without a tokenizer
            state.grammar = RequestGrammar.of(constraint, self.grammars.matcher(constraint))
            for token in state.output_token_ids:  # sampled elsewhere: a prefill instance's first token
                state.grammar.accept(token)
        return state.grammar

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.requests[request_id]
        return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids, state.generator)


def decode_logits(model: Glm5NextForCausalLM, caches: list, kda_caches: list[KDACache], input_ids: torch.Tensor,
                  batch) -> tuple:
    """A decode step's logits, the conv states each KDA layer (`kda_caches`, among `caches`)
    staged for verified tokens (`KDACache.staged_conv`, read after sampling), each logits
    row's argmax where the native pass takes them (else None), and the final hidden states
    that made the logits (the MTP drafter reads them): what `CapturedDecode` records
    and replays (a replay recomputes those tensors, but sets no attribute). The argmax rides in
    the replay because on the host it cost more than its pass: after a replay has streamed the
    weights through the caches, the sampler's checks and its allocation took ~70 us of a
    batch-1 step here."""
    hidden = model(input_ids, batch, caches)
    logits = model.compute_logits(hidden, batch.tracer)
    greedy = argmax_native(logits) if logits is not None and argmax_fit(logits) else None  # (None: a rank but the first)
    return logits, [cache.staged_conv for cache in kda_caches], greedy, hidden


def _image_spans(scheduled: list[ScheduledRequest], items_of) -> list[RowSpan]:
    """The step's rows of each request whose prompt chunk may reach its images or videos
    (`items_of`: a request id's items), in `scheduled`'s row order."""
    spans, row = [], 0
    for s in scheduled:
        items = items_of(s.request_id)
        if items and s.num_computed_tokens <= max(i.positions[-1] for i in items):  # a prompt chunk reaching them
            spans.append(RowSpan(items, s.num_computed_tokens, row, s.num_new_tokens))
        row += s.num_new_tokens
    return spans


def _batch_order(s: ScheduledRequest) -> int:
    """Decodes, then requests verifying drafts, then prefill chunks (as ForwardBatch wants)."""
    return 1 if s.verifies else 0 if s.is_decode else 2


def step_conditions(batch) -> dict:
    """The conditions a step ran under, attached to its spans for bucketing (a padded decode
    batch's requests include its padding rows: the kernels computed them)."""
    contexts = batch.seq_lens
    return {
        "num_requests": batch.num_requests,
        "num_decodes": batch.num_decodes,
        "num_verifies": batch.num_verifies,
        "num_prefills": batch.num_requests - batch.num_decodes,
        "num_tokens": batch.num_tokens,
        "max_context": max(contexts) if contexts else 0,
        "mean_context": sum(contexts) / len(contexts) if contexts else 0.0,
        "decode_context_sum": sum(contexts[: batch.num_decodes]),
        "prefill_context_sum": sum(contexts[batch.num_decodes :]),
    }
