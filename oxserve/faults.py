"""Faults planted on purpose, for the reliability suite (docs/reliability.md).

`OXSERVE_FAULTS` holds a JSON object naming them; unset (always, in production) it plants
nothing and costs nothing:

    {"poison_token": T}                 a forward whose input holds token T raises: a fault
                                        in one request's rows, wherever it is batched
    {"stall_token": T, "stall_s": S}    a forward whose input holds token T first sleeps S
                                        seconds: a stalled step
    {"crash_loop_after_steps": N}       the server's engine loop dies after N steps: the
                                        thread, not a request
    {"batch_store_max_pages": P}        the batch store's file may not grow past P pages:
                                        its disk is full (sqlite's own SQLITE_FULL)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

FAULTS_ENV = "OXSERVE_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a planted fault; nothing else raises it."""


@dataclass(frozen=True)
class Faults:
    poison_token: int | None = None
    stall_token: int | None = None
    stall_s: float = 0.0
    crash_loop_after_steps: int | None = None
    batch_store_max_pages: int | None = None

    @staticmethod
    def from_env() -> Faults:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return Faults()
        try:
            return Faults(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise ValueError(f"${FAULTS_ENV} must be a JSON object of {list(Faults.__dataclass_fields__)}: {e}") from None

    def plant_in_model(self, model: torch.nn.Module) -> None:
        """Hook the model's forward (its first argument is the step's token ids)."""
        if self.poison_token is None and self.stall_token is None:
            return

        def before_forward(module: torch.nn.Module, args: tuple) -> None:
            input_ids = args[0]
            if self.stall_token is not None and bool((input_ids == self.stall_token).any()):
                time.sleep(self.stall_s)
            if self.poison_token is not None and bool((input_ids == self.poison_token).any()):
                raise InjectedFault(f"planted fault: the step's input holds token {self.poison_token}")

        model.register_forward_pre_hook(before_forward)
