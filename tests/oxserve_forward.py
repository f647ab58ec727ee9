"""oxserve's model run directly on caller-chosen tokens: logits for every position.

The parity and fidelity tests feed the reference's own tokens (teacher forcing), so they
need oxserve's logits at every position, prefilled in chunks of any size and then decoded
token by token, through the same batch metadata and cache paths the engine uses.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from oxserve.cache.spec import CacheLayout
from oxserve.config import ModelConfig
from oxserve.kernels.onednn import choose_linear_kernel
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.loader import load_model

BLOCK_SIZE = 32
DEFAULT_KERNEL = ModelConfig().linear_kernel


class ForcedRun:
    """A loaded model that runs any token sequence from an empty cache."""

    def __init__(self, path: Path | str, dtype: torch.dtype = torch.float32, linear_kernel: str = DEFAULT_KERNEL):
        """linear_kernel: as the engine option (default: the engine's default)."""
        _, transform = choose_linear_kernel(linear_kernel, torch.device("cpu"), dtype)
        self.model = load_model(path, dtype=dtype, transform=transform).model
        self.cfg, self.dtype = self.model.config, dtype

    @classmethod
    def of(cls, model) -> "ForcedRun":
        """A run of an already loaded model."""
        run = cls.__new__(cls)
        run.model, run.cfg, run.dtype = model, model.config, next(model.parameters()).dtype
        return run

    def logits(self, tokens: list[int], chunk: int, decode_from: int | None = None) -> torch.Tensor:
        """Logits [L, V] (fp32) of every position of `tokens`.

        Positions before `decode_from` (default: all) are prefilled in chunks of `chunk` tokens;
        the rest are decoded one token per step. The request's blocks are scattered over the
        cache at random, and it uses state slot 1 of 2: pages and slots need not be in order.
        """
        decode_from = len(tokens) if decode_from is None else decode_from
        block_size = max(BLOCK_SIZE, self.cfg.index_kpool)
        blocks = -(-len(tokens) // block_size)
        layout = CacheLayout(num_blocks=blocks + 3, block_size=block_size, num_slots=2)
        caches = [spec.allocate(layout, "cpu") for spec in self.model.cache_specs(self.dtype)]
        table = random.sample(range(layout.num_blocks), blocks)
        spans = [(s, min(s + chunk, decode_from)) for s in range(0, decode_from, chunk)]
        spans += [(p, p + 1) for p in range(decode_from, len(tokens))]
        outs = []
        for start, end in spans:
            request = BatchRequest(start, end - start, table, state_slot=1, samples=True)
            batch = make_forward_batch([request], self.cfg, block_size, layout.num_blocks, "cpu")
            batch.logits_indices = torch.arange(end - start)  # every position, not just the last
            with torch.inference_mode():
                outs.append(self.model.compute_logits(self.model(torch.tensor(tokens[start:end]), batch, caches)))
        return torch.cat(outs).float()


def forced_logits(
    path: Path | str, tokens: list[int], chunk: int, decode_from: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`ForcedRun(path, dtype).logits(tokens, chunk, decode_from)`."""
    return ForcedRun(path, dtype).logits(tokens, chunk, decode_from)
