"""Drafting with the checkpoint's MTP layer: vLLM's and SGLang's `mtp` method for GLM/DeepSeek.

The MTP layer predicts the token after next from the target's final hidden state at a
position q and the embedding of the token at q + 1, so it runs one position behind the
target, with its own MLA cache (one more layer in the same paged blocks):

    after each step  `advance`: one MTP pass over every position whose next token is now
                     known -- this step's tokens, a verify's kept drafts; the last position of
                     a prefill chunk waits for the next chunk -- writing the MTP cache; for
                     each request that sampled, the first draft (argmax) and the MTP output
                     it came from
    scheduler asks   `propose`: k - 1 more single-position MTP steps, each on its own output
                     and the previous draft (DeepSeek-V3's recursion)

Drafts are greedy (point masses), so `verify`'s rejection sampling keeps the target's
distribution exactly whatever the drafts are. The recursion writes MTP entries at positions
the target has not computed yet; the next `advance` overwrites them with the real ones.
It never writes past a request's allocated blocks: a draft that would is not made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxserve.cache.layers import MLACache
from oxserve.cache.spec import CacheLayout
from oxserve.engine.interface import ScheduledRequest
from oxserve.model.batch import BatchRequest, make_forward_batch
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
    def __init__(self, model: Glm5NextForCausalLM, cache: MLACache, layout: CacheLayout, device: torch.device):
        if model.mtp is None:
            raise ValueError("the MTP drafter needs the model loaded with its MTP layer")
        self.model, self.cache, self.layout, self.device = model, cache, layout, device
        self._pending: dict[str, _Pending] = {}
        self._heads: dict[str, _Head] = {}

    def forget(self, request_id: str) -> None:
        """Finished: nothing carried over."""
        self._pending.pop(request_id, None)
        self._heads.pop(request_id, None)

    def restart(self, request_id: str) -> None:
        """Resumed after preemption: no draft is owed. A pending row stays: it is used only if
        the request resumes right after it (from a checkpoint at that chunk's end)."""
        self._heads.pop(request_id, None)

    def clear(self) -> None:
        self._pending.clear()
        self._heads.clear()

    def advance(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, yielded: dict[str, list[int]],
                block_tables: dict[str, list[int]]) -> None:  # fmt: skip
        """The MTP pass after a step. `scheduled` in batch order, `hidden` [T, D] the target's
        final hidden state of every row of the step, `yielded` the tokens each sampling request
        got (kept drafts, then the target's own)."""
        self._heads.clear()
        rows: list[_Row] = []
        offset = 0
        for s in scheduled:
            h = hidden[offset : offset + s.num_new_tokens]
            offset += s.num_new_tokens
            row = self._row(s, h, yielded.get(s.request_id))
            if row is not None:
                rows.append(row)
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
                head.hidden = z
                drafts[row.request_id].append(draft)
                if len(drafts[row.request_id]) >= k:
                    del heads[row.request_id]
            step += 1
        return drafts

    def _run(self, rows: list[_Row], block_tables: dict[str, list[int]]) -> list[tuple[torch.Tensor, int]]:
        """One MTP forward over `rows` (decodes first, as a batch wants them); per row that
        wants a draft, in `rows` order: the normed output at its last position and its argmax."""
        order = sorted(range(len(rows)), key=lambda i: 0 if len(rows[i].next_tokens) == 1 and rows[i].first > 0 else 1)
        requests = [BatchRequest(rows[i].first, len(rows[i].next_tokens), block_tables[rows[i].request_id], 0,
                                 rows[i].wants_draft) for i in order]  # fmt: skip
        cfg = self.model.config
        batch = make_forward_batch(requests, cfg, self.layout.block_size, self.layout.num_blocks, self.device)
        tokens = torch.tensor([t for i in order for t in rows[i].next_tokens], dtype=torch.long, device=self.device)
        hidden = torch.cat([rows[i].hidden for i in order])
        z = self.model.mtp(self.model.embed(tokens), hidden, batch, self.cache)
        picks = self.model.compute_logits(z).max(-1).indices.tolist()
        by_row = dict(zip([i for i in order if rows[i].wants_draft], zip(z, picks)))
        return [by_row[i] for i in range(len(rows)) if rows[i].wants_draft]
