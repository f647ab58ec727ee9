"""The runner's side of images and video: the embeddings that replace placeholder tokens in a
step's rows, encoded by the vision tower when first needed and kept by content hash."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

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


class MultiModalEmbedder:
    def __init__(self, tower: VisionTower, cache_rows: int, device: torch.device):
        self.tower = tower
        self.cache = EncoderCache(cache_rows)
        self.device = device
        self.dtype = next(tower.parameters()).dtype

    def step_embeddings(self, spans: list[RowSpan], tracer: Tracer | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [R], embeddings [R, D]) for the placeholder positions the step computes;
        None when it computes none."""
        wanted: list[tuple[MultiModalItem, list[int], list[int]]] = []  # item, indexes into it, batch rows
        for s in spans:
            end = s.position + s.count
            for item in s.items:
                first, last = bisect_left(item.positions, s.position), bisect_left(item.positions, end)
                if first < last:  # (a decode past the prompt finds none at once)
                    wanted.append((item, list(range(first, last)), [s.row + p - s.position for p in item.positions[first:last]]))
        if not wanted:
            return None
        encoded = self._encode([item for item, _, _ in wanted], tracer)
        rows = torch.tensor([r for _, _, rs in wanted for r in rs], dtype=torch.long, device=self.device)
        embeds = torch.cat([encoded[item.content_hash][ks] for item, ks, _ in wanted])
        return rows, embeds

    @torch.inference_mode()
    def _encode(self, items: list[MultiModalItem], tracer: Tracer | None) -> dict[bytes, torch.Tensor]:
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
