"""Images and videos inside a tokenized prompt: which positions take which embeddings.

The decoder embeds a placeholder position with the vision tower's output instead of the
token's embedding. As in the reference, every image's embeddings, in order, fill the image
tokens outside video spans (`<|begin_of_video|>` ... `<|end_of_video|>`), and every video's
fill the image tokens inside them. An item is plain data (its patches, grid, content hash and
positions), so it travels with the request to the runner, which encodes it (once per content
hash, see `EncoderCache`) when a prefill chunk reaches its positions.

Prefix caching must not take one image's cache for another's: `cache_key_ids` gives the
scheduler's block hashes a token sequence in which each item's positions hold a value made
from its content hash (negative, so never a real token).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from oxserve.model.vision import MultiModalConfig
from oxserve.multimodal.processor import ProcessedMedia


@dataclass(frozen=True)
class MultiModalItem:
    modality: str  # "image" | "video"
    content_hash: bytes
    patches: torch.Tensor  # [t*h*w, patch_dim] fp32
    grid: tuple[int, int, int]
    positions: tuple[int, ...]  # prompt positions its embeddings fill, ascending

    @property
    def cache_key(self) -> int:
        return -1 - int.from_bytes(self.content_hash[:7], "little")


def content_hash(media: ProcessedMedia) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{media.modality}:{media.grid}".encode())
    h.update(media.patches.numpy().tobytes())
    return h.digest()


def place_media(token_ids: list[int], media: list[ProcessedMedia], cfg: MultiModalConfig) -> tuple[MultiModalItem, ...]:
    """The items of `media` (in prompt order) at their placeholder positions in `token_ids`;
    ValueError when the placeholder tokens and the embeddings do not match in number."""
    merge = cfg.vision.spatial_merge_size
    image_slots, video_slots = [], []
    depth = 0  # open video spans
    for i, t in enumerate(token_ids):
        if t == cfg.video_start_token_id:
            depth += 1
        elif t == cfg.video_end_token_id:
            depth -= 1
        elif t == cfg.image_token_id:
            (video_slots if depth > 0 else image_slots).append(i)
    items = []
    for modality, slots in (("image", image_slots), ("video", video_slots)):
        mine = [m for m in media if m.modality == modality]
        wanted = sum(m.num_embeddings(merge) for m in mine)
        if wanted != len(slots):
            raise ValueError(f"the prompt has {len(slots)} {modality} token positions for {wanted} {modality} embeddings")
        start = 0
        for m in mine:
            n = m.num_embeddings(merge)
            items.append(MultiModalItem(modality, content_hash(m), m.patches, m.grid, tuple(slots[start : start + n])))
            start += n
    return tuple(sorted(items, key=lambda item: item.positions[0] if item.positions else 0))


def cache_key_ids(token_ids: list[int], items: tuple[MultiModalItem, ...]) -> list[int]:
    keys = list(token_ids)
    for item in items:
        for p in item.positions:
            keys[p] = item.cache_key
    return keys


class EncoderCache:
    """Vision tower outputs by content hash, least recently used dropped past `capacity`
    embedding rows (an item larger than the whole cache is still returned, not kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # the engine reads it; an encode instance's embeddings arrive from another thread
        self.hits = self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: bytes, embeddings: torch.Tensor) -> None:
        with self._lock:
            if key in self._entries or len(embeddings) > self.capacity:
                return
            self._entries[key] = embeddings
            self.rows += len(embeddings)
            while self.rows > self.capacity:
                _, dropped = self._entries.popitem(last=False)
                self.rows -= len(dropped)

    def seed(self, embeddings: dict[bytes, torch.Tensor]) -> None:
        """Embeddings encoded elsewhere, by content hash."""
        for key, value in embeddings.items():
            self.put(key, value)

    def __len__(self) -> int:
        return len(self._entries)
