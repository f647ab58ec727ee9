"""`hidden_act` names, computed in plain torch exactly as transformers' `ACT2FN` computes them.

Each entry is the reference's own formula, op for op and in the same order (float products
are not associative: `gelu_new` and `gelu_python_tanh` differ only in where the 0.5 goes),
so results match it bit for bit; `tests/test_config_fidelity.py` checks every name. The
reference's activations with learned parameters (`prelu`, `xielu`) are not offered: a
checkpoint using them carries weights oxserve has no place for.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

ACTIVATIONS: dict[str, Activation] = {
    "gelu": F.gelu,  # erf form
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": lambda x: x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_accurate": lambda x: 0.5 * x * (1 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3)))),
    "hardswish": F.hardswish,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "leaky_relu": F.leaky_relu,  # torch's default slope, as the reference's nn.LeakyReLU()
    "linear": lambda x: x,
    "mish": F.mish,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "swish": F.silu,
    "tanh": torch.tanh,
}

# In the reference's table, but with learned weights.
WITH_PARAMETERS = frozenset({"prelu", "xielu"})


def activation(name: str) -> Activation:
    """The function `hidden_act=name` selects; ValueError naming `hidden_act` if oxserve cannot run it."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    if name in WITH_PARAMETERS:
        raise ValueError(f"hidden_act={name!r} has learned parameters, which oxserve does not support")
    raise ValueError(f"hidden_act={name!r} is not a known activation; oxserve supports {sorted(ACTIVATIONS)}")
