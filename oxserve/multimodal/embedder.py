"""The runner's side of images and video: the embeddings that replace placeholder tokens in a
step's rows, encoded by the vision tower when first needed and kept by content hash.

With parallel ranks the tower lives on rank 0 only: every rank finds the same placeholder
rows in the same step message, rank 0 encodes and broadcasts their embeddings (one
`[rows, hidden]` tensor per step that has any), and the other ranks receive them
(`ReceivedEmbeddings`) instead of encoding. The step message carries no pixels to them."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oxserve.model.vision import VisionTower
from oxserve.multimodal.inputs import EncoderCache, MultiModalItem
from oxserve.telemetry import Tracer, span


@dataclass(frozen=True)
class RowSpan:
    """A request's rows in the step: its tokens from `position` on sit at rows `row`..."""

    items: tuple[MultiModalItem, ...]
    position: int
    row: int
    count: int


Wanted = list[tuple[MultiModalItem, list[int], list[int]]]  # item, indexes into its embeddings, batch rows


def placeholder_rows(spans: list[RowSpan]) -> Wanted:
    """The placeholder positions the step computes, item by item, and the rows they sit at."""
    wanted: Wanted = []
    for s in spans:
        end = s.position + s.count
        for item in s.items:
            first, last = bisect_left(item.positions, s.position), bisect_left(item.positions, end)
            if first < last:  # (a decode past the prompt finds none at once)
                wanted.append((item, list(range(first, last)), [s.row + p - s.position for p in item.positions[first:last]]))
    return wanted


def _row_tensor(wanted: Wanted, device: torch.device) -> torch.Tensor:
    return torch.tensor([r for _, _, rs in wanted for r in rs], dtype=torch.long, device=device)


class MultiModalEmbedder:
    """The vision tower's side: encode, cache, and (`share`: rank 0 of parallel ranks) broadcast."""

    def __init__(self, tower: VisionTower, cache_rows: int, device: torch.device, share: bool = False):
        self.tower = tower
        self.cache = EncoderCache(cache_rows)
        self.device = device
        self.dtype = next(tower.parameters()).dtype
        self.share = share

    def step_embeddings(self, spans: list[RowSpan], tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [R], embeddings [R, D]) for the placeholder positions the step computes;
        None when it computes none."""
        wanted = placeholder_rows(spans)
        if not wanted:
            return None
        encoded = self.encode([item for item, _, _ in wanted], tracer)
        embeds = torch.cat([encoded[item.content_hash][ks] for item, ks, _ in wanted])
        if self.share:  # the other ranks' ReceivedEmbeddings wait for exactly these rows
            dist.broadcast(embeds, src=0)
        return _row_tensor(wanted, self.device), embeds

    @torch.inference_mode()
    def encode(self, items: list[MultiModalItem], tracer: Tracer | None = None) -> dict[bytes, torch.Tensor]:
        """Every item's embeddings: from the cache, or encoded together in one tower pass."""
        found = {i.content_hash: e for i in items if (e := self.cache.get(i.content_hash)) is not None}
        missing = list({i.content_hash: i for i in items if i.content_hash not in found}.values())
        self.cache.hits += len(items) - len(missing)
        self.cache.misses += len(missing)
        if missing:
            with span(tracer, "vision_encode", track="engine", items=len(missing)):
                patches = torch.cat([i.patches for i in missing]).to(self.device, self.dtype)
                out = self.tower(patches, [i.grid for i in missing])
            merge = self.tower.config.spatial_merge_size ** 2
            for item, embeds in zip(missing, out.split([i.patches.shape[0] // merge for i in missing])):
                found[item.content_hash] = embeds
                self.cache.put(item.content_hash, embeds.clone())  # a view would pin the whole pass's output
        return found


class ReceivedEmbeddings:
    """A parallel rank but the first: the same rows as rank 0's embedder, their embeddings
    received from rank 0 (this rank has no vision tower)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device):
        self.width, self.dtype, self.device = width, dtype, device

    def step_embeddings(self, spans: list[RowSpan], tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        wanted = placeholder_rows(spans)
        if not wanted:
            return None
        rows = _row_tensor(wanted, self.device)
        embeds = torch.empty(len(rows), self.width, dtype=self.dtype, device=self.device)
        dist.broadcast(embeds, src=0)
        return rows, embeds
