"""Drafting with the checkpoint's MTP layer: vLLM's and SGLang's `mtp` method for GLM/DeepSeek.

The MTP layer predicts the token after next from the target's final hidden state at a
position q and the embedding of the token at q + 1, so it runs one position behind the
target, with its own MLA cache (one more layer in the same paged blocks):

    after each step  `advance`: the positions whose next token is now known -- this step's
                     tokens, a verify's kept drafts; the last position of a prefill chunk
                     waits for the next chunk -- are owed an MTP pass, which writes their MTP
                     cache entries. A request that sampled keeps them owed (`_owed`) until it
                     drafts or a cache block fills; the others' run now, in one pass
    scheduler asks   `propose`: for each request that drafts, one MTP pass over what it is
                     owed from before the last step (`catch_up_s`), one over the last step's
                     positions, which gives the first draft (argmax) and the MTP output it
                     came from, then k - 1 more single-position MTP steps, each on its own
                     output and the previous draft (DeepSeek-V3's recursion)

A request that does not draft (the guard finds drafts do not pay) thus costs one MTP pass a
block, not one a step, and what a probe after such a pause owes is not a cost of its drafts
(the guard is not charged `catch_up_s`). A block's MTP entries are written in the step that
fills it, before prefix caching can share it (but for a prefill chunk's last position, which
waits for the next chunk's first token, as it always has); a request's owed positions are run
before prefix caching copies the block they lie in, and when it leaves its blocks (finished,
preempted, handed to a decode instance: `settle`). After a failed MTP pass the owed positions
are dropped with the rest (`clear`): their entries stay unwritten, which costs drafts only.

The passes whose rows all draft (after decode and verify steps) are captured steps: each
shape recorded the second time it is met, then replayed (`engine.capture`); the others run
eagerly. Drafts are greedy (point masses), so `verify`'s rejection sampling keeps the
target's distribution exactly whatever the drafts are. The recursion writes MTP entries at
positions the target has not computed yet; the pass over those positions, once computed,
overwrites them with the real ones (a request's passes run its positions in order). It
never writes past a request's allocated blocks: a draft that would is not made.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from oxserve.cache.layers import MLACache
from oxserve.cache.spec import CacheLayout
from oxserve.engine.capture import CapturedDecode, has_forward_hooks
from oxserve.engine.interface import NEW_SHAPE, STEADY, ScheduledRequest
from oxserve.kernels.rows import argmax_fit, argmax_native
from oxserve.model.batch import BatchRequest, host_tensor, make_forward_batch
from oxserve.model.glm5_next import Glm5NextForCausalLM


@dataclass
class _Pending:
    """A computed position whose next token was not known yet (the end of a prefill chunk)."""

    position: int
    hidden: torch.Tensor  # [D] the target's final hidden state there


@dataclass
class _Head:
    """Where a request's drafting continues: the first draft, and the MTP output it came from."""

    position: int  # the MTP position of the next recursion step (the request's last token's)
    hidden: torch.Tensor  # [D] normed MTP output that predicted `draft`
    draft: int


@dataclass
class _Row:
    request_id: str
    first: int  # MTP position of the first row
    hidden: torch.Tensor  # [n, D] target hidden states of positions first .. first + n - 1
    next_tokens: list[int]  # the token after each of those positions
    wants_draft: bool


class MTPDrafter:
    def __init__(self, model: Glm5NextForCausalLM, cache: MLACache, layout: CacheLayout, device: torch.device,
                 captures: bool = False):  # fmt: skip
        if model.mtp is None:
            raise ValueError("the MTP drafter needs the model loaded with its MTP layer")
        self.model, self.cache, self.layout, self.device = model, cache, layout, device
        self._pending: dict[str, _Pending] = {}
        # Per request that sampled: its positions not run through the MTP layer yet, a row per step
        self._owed: dict[str, list[_Row]] = {}
        self._heads: dict[str, _Head] = {}
        self.captured = CapturedDecode(functools.partial(draft_pass, model, cache)) if captures else None
        self.novelty = STEADY  # of the last `advance` or `propose`: its most novel pass's
        self.catch_up_s = 0.0  # the last `propose`'s pass over positions owed from before the last step
        # Set by the engine before each step: drafts do not pay at this batch size (the guard's
        # measure), so no MTP pass runs but a probe's: see `advance`.
        self.dormant = False

    def owing(self) -> list[str]:
        """The requests that owe MTP passes."""
        return list(self._owed)

    def settle(self, left: list[str], copied: set[int], block_tables: dict[str, list[int]]) -> None:
        """One pass over the positions owed by requests that `left` their blocks since the last
        step (finished, requeued, exported) and by those whose owed positions lie in a block
        that prefix caching copies this step (`copied`): a copy, now or later (a finished or
        preempted request's last block, pinned by a checkpoint), must find their MTP entries.
        A block freed since the last step and given to another request is written by its new
        owner, from this step on, before it reads it. `block_tables`: every owing request's."""
        bs = self.layout.block_size
        due = [rid for rid, rows in self._owed.items() if rid in block_tables
               and (rid in left or block_tables[rid][rows[0].first // bs] in copied)]  # fmt: skip
        if due and self.dormant:  # (see `advance`: their entries go unwritten)
            for rid in due:
                del self._owed[rid]
        elif due:
            self._run([_joined(self._owed.pop(rid), False) for rid in due], block_tables)

    def forget(self, request_id: str) -> None:
        """Finished: nothing carried over."""
        self._pending.pop(request_id, None)
        self._owed.pop(request_id, None)
        self._heads.pop(request_id, None)

    def restart(self, request_id: str) -> None:
        """Resumed after preemption: no draft is owed. A pending row stays: it is used only if
        the request resumes right after it (from a checkpoint at that chunk's end)."""
        self._owed.pop(request_id, None)
        self._heads.pop(request_id, None)

    def clear(self) -> None:
        self._pending.clear()
        self._owed.clear()
        self._heads.clear()

    def advance(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, yielded: dict[str, list[int]],
                block_tables: dict[str, list[int]]) -> None:  # fmt: skip
        """After a step. `scheduled` in batch order, `hidden` [T', D] the target's final hidden
        state of every row of the step (T' >= T: padding rows after them), `yielded` the
        tokens each sampling request got (kept drafts, then the target's own).

        `dormant`: only the step's own row of each request is kept, for a probe's draft, and no
        pass runs. Passes a prompt or a leaving request's owed positions at a time cost a
        layer's prefill each, which is what made MTP switched on but not drafting slower than
        plain decode (0.68-0.88x at batch 1 on a Zen 4 EPYC, `docs/bench/spec_idle_cost.py`).
        Positions skipped keep no MTP entries: a later draft of the request (or of one that
        shares its blocks as a cached prefix) attends over what the cache held. That costs
        acceptance, never the target's distribution; but a request with its own seed that
        resumes from such blocks samples with draws that depend on where its drafts fell, so
        at temperature > 0 its output can differ from a run where they were written."""
        self._heads.clear()
        self.novelty = STEADY
        rows: list[_Row] = []
        offset = 0
        for s in scheduled:
            h = hidden[offset : offset + s.num_new_tokens]
            offset += s.num_new_tokens
            row = self._row(s, h, yielded.get(s.request_id))
            if row is None:
                continue
            if self.dormant:
                self._owed[row.request_id] = [row]
                continue
            owed = self._owed.pop(row.request_id, [])
            if owed and owed[-1].first + len(owed[-1].next_tokens) != row.first:
                owed = []  # (computed again since)
            owed.append(row)
            end = row.first + len(row.next_tokens)
            if row.wants_draft and end // self.layout.block_size == owed[0].first // self.layout.block_size:
                self._owed[row.request_id] = owed  # (no block filled: run when it drafts)
            else:
                rows.append(_joined(owed, row.wants_draft))
        self._run_heads(rows, block_tables)

    def _run_heads(self, rows: list[_Row], block_tables: dict[str, list[int]]) -> None:
        """One MTP pass over `rows`; where a row drafts, its request's head."""
        if rows:
            outputs = self._run(rows, block_tables)
            for row, (z, draft) in zip([r for r in rows if r.wants_draft], outputs):
                self._heads[row.request_id] = _Head(row.first + len(row.next_tokens), z.clone(), draft)

    def _row(self, s: ScheduledRequest, h: torch.Tensor, tokens_out: list[int] | None) -> _Row | None:
        start = s.num_computed_tokens
        settled = s.num_new_tokens - s.num_draft_tokens + (len(tokens_out) - 1 if tokens_out and s.verifies else 0)
        tokens = s.token_ids[:settled]  # at positions start .. start + settled - 1, all kept
        next_tokens = tokens[1:] + ([tokens_out[-1]] if tokens_out else [])
        pending = self._pending.pop(s.request_id, None)
        if not tokens_out:  # the chunk's last position waits for the token after it
            self._pending[s.request_id] = _Pending(start + settled - 1, h[settled - 1].clone())  # not a view of the step
        parts = [h[: len(next_tokens)]]
        first = start
        if pending is not None and pending.position == start - 1:
            parts.insert(0, pending.hidden.unsqueeze(0))
            next_tokens.insert(0, tokens[0])
            first = start - 1
        if not next_tokens:
            return None
        return _Row(s.request_id, first, torch.cat(parts), next_tokens, bool(tokens_out))

    def propose(self, wanted: dict[str, int], block_tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Up to k drafts for each request in `wanted` that sampled in the last step."""
        drafts: dict[str, list[int]] = {}
        heads: dict[str, tuple[_Head, int]] = {}
        self.novelty, self.catch_up_s = STEADY, 0.0
        owed = [self._owed.pop(rid) for rid, k in wanted.items() if k >= 1 and rid in self._owed]
        # (drafting rows, whose heads the next pass replaces: a pass whose rows all draft can replay)
        if earlier := [_joined(rows[:-1], True) for rows in owed if len(rows) > 1]:
            start = time.perf_counter()
            self._run_heads(earlier, block_tables)
            self.catch_up_s = time.perf_counter() - start
        self._run_heads([rows[-1] for rows in owed], block_tables)
        for request_id, k in wanted.items():
            head = self._heads.pop(request_id, None)
            if head is None or k < 1:
                continue
            drafts[request_id] = [head.draft]
            room = len(block_tables[request_id]) * self.layout.block_size - head.position  # positions it may write
            k = min(k, room + 1)
            if k > 1:
                heads[request_id] = (head, k)
        step = 0
        while heads:
            rows = [_Row(rid, head.position + step, head.hidden.unsqueeze(0), [drafts[rid][-1]], True)
                    for rid, (head, _) in heads.items()]  # fmt: skip
            for row, (z, draft) in zip(rows, self._run(rows, block_tables)):
                head, k = heads[row.request_id]
                head.hidden = z.clone()  # (a replay's output: the next replay of its shape overwrites it)
                drafts[row.request_id].append(draft)
                if len(drafts[row.request_id]) >= k:
                    del heads[row.request_id]
            step += 1
        return drafts

    def _run(self, rows: list[_Row], block_tables: dict[str, list[int]]) -> list[tuple[torch.Tensor, int]]:
        """One MTP forward over `rows`; per row that wants a draft, in `rows` order: the normed
        output at its last position and its argmax. A row of a few positions on a cached
        context runs as a verify does (a query per position, as captured steps run them), a
        longer one as a prefill chunk."""
        kinds = [_kind(r, self.layout.block_size) for r in rows]
        order = sorted(range(len(rows)), key=kinds.__getitem__)  # decodes, verifies, prefill chunks: as a batch wants them
        requests = [BatchRequest(rows[i].first, len(rows[i].next_tokens), block_tables[rows[i].request_id], 0,
                                 rows[i].wants_draft, len(rows[i].next_tokens) - 1 if kinds[i] == VERIFY else 0)
                    for i in order]  # fmt: skip
        cfg = self.model.config
        batch = make_forward_batch(requests, cfg, self.layout.block_size, self.layout.num_blocks, self.device, kda=False)
        batch.logits_indices = host_tensor(_last_rows([rows[i] for i in order]), self.device)  # (a verify wants every row's)
        tokens = host_tensor([t for i in order for t in rows[i].next_tokens], self.device)
        hidden = torch.cat([rows[i].hidden for i in order])
        if (self.captured is not None and all(r.wants_draft for r in rows) and PREFILL not in kinds
                and not has_forward_hooks(self.model)):  # fmt: skip
            z, picks = self.captured.run((tokens, hidden), batch)
            if self.novelty != NEW_SHAPE:
                self.novelty = self.captured.novelty or self.novelty
        else:
            z, picks = draft_pass(self.model, self.cache, tokens, hidden, batch)
        by_row = dict(zip([i for i in order if rows[i].wants_draft], zip(z, picks.tolist())))
        return [by_row[i] for i in range(len(rows)) if rows[i].wants_draft]


DECODE, VERIFY, PREFILL = 0, 1, 2


def _kind(row: _Row, block_size: int) -> int:
    """A row runs as a verify up to a block and the position before it: what a request owes
    when a block fills (positions pile up a block at a time while it does not draft), so that
    those passes replay once their shape recurs. Run as prefill chunks they were eager, a
    layer's prefill each (~2.5 ms at batch 1 on a Zen 4 EPYC): MTP on while the guard kept
    drafting off cost 0.68-0.82x plain decode (`python docs/bench/spec_idle_cost.py`)."""
    if row.first == 0 or len(row.next_tokens) > block_size + 1:
        return PREFILL
    return DECODE if len(row.next_tokens) == 1 else VERIFY


def _last_rows(rows: list[_Row]) -> list[int]:
    """The batch rows of each drafting row's last position (only those go on past attention)."""
    last, end = [], 0
    for row in rows:
        end += len(row.next_tokens)
        if row.wants_draft:
            last.append(end - 1)
    return last


def _joined(rows: list[_Row], wants_draft: bool) -> _Row:
    """Consecutive rows of one request as one."""
    if len(rows) == 1 and rows[0].wants_draft == wants_draft:
        return rows[0]
    return _Row(rows[0].request_id, rows[0].first, torch.cat([r.hidden for r in rows]),
                [t for r in rows for t in r.next_tokens], wants_draft)  # fmt: skip


def draft_pass(model: Glm5NextForCausalLM, cache: MLACache, tokens: torch.Tensor, hidden: torch.Tensor,
               batch) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One MTP pass: the normed MTP output of each drafting row and its argmax, the draft."""
    z = model.mtp(model.embed(tokens), hidden, batch, cache)
    logits = model.compute_logits(z)
    return z, argmax_native(logits) if argmax_fit(logits) else logits.argmax(-1)
