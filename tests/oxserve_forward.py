"""oxserve's model run directly on caller-chosen tokens: logits for every position.

The parity and fidelity tests feed the reference's own tokens (teacher forcing), prefilled
in chunks of any size and then decoded token by token (`oxserve.model.forced`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from oxserve.config import ModelConfig
from oxserve.kernels.onednn import choose_linear_kernel
from oxserve.model.forced import forced_logits as model_forced_logits
from oxserve.model.loader import load_model

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

    def logits(self, tokens: list[int], chunk: int, decode_from: int | None = None, kda_replay: int = 0,
               captured: bool = True) -> torch.Tensor:
        """Logits [L, V] (fp32) of every position of `tokens` (`oxserve.model.forced`), the
        request's blocks scattered over the cache at random; `kda_replay`: ReplaySSM ring length;
        `captured`: decode steps recorded and replayed, as the engine runs them by default."""
        return model_forced_logits(self.model, tokens, chunk, decode_from, shuffle=random.Random(random.random()),
                                   kda_replay=kda_replay, captured=captured)


def forced_logits(
    path: Path | str, tokens: list[int], chunk: int, decode_from: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`ForcedRun(path, dtype).logits(tokens, chunk, decode_from)`."""
    return ForcedRun(path, dtype).logits(tokens, chunk, decode_from)
