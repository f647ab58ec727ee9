"""Routed-expert SwiGLU over tokens already sorted by expert.

    rows:    | e0 e0 e0 | e2 | e3 e3 |        (expert 1 got no tokens)
    offsets: [3, 3, 4, 6]                     (end of each expert's rows)

`grouped_experts` runs all experts in two grouped GEMMs; `looped_experts` is the plain
reference (one GEMM pair per expert) it is tested against, and the fallback where the
grouped GEMM is unavailable (CUDA with fp32).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def clamped_glu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, act: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """act(gate clamped above at limit) * up clamped to [-limit, limit]. The routed experts
    always use SiLU (as the reference does); dense and shared MLPs use the config's act."""
    return act(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    """rows [P, H] sorted by expert; row_weight [P, 1] fp32; offsets [E] int32;
    gate_up [E, 2I, H]; down [E, H, I] -> [P, H]. The routing weight scales the (narrower)
    activation rather than the output."""
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    act = (clamped_glu(gate, up, limit) * row_weight).to(rows.dtype)
    return torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)


def looped_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
    observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """`observe(expert, its rows, its down_proj input)`: sees what each expert multiplies
    (quantization calibration)."""
    out = torch.empty_like(rows)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            gate, up = F.linear(rows[start:end], gate_up[expert]).chunk(2, dim=-1)
            act = (clamped_glu(gate, up, limit) * row_weight[start:end]).to(rows.dtype)
            if observe is not None:
                observe(expert, rows[start:end], act)
            out[start:end] = F.linear(act, down[expert])
        start = end
    return out


def grouped_gemm_supported(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """torch._grouped_mm needs every operand's rows 16-byte aligned (and bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or (device.type != "cpu" and dtype != torch.bfloat16):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(width * itemsize % 16 == 0 for width in (hidden, intermediate, 2 * intermediate))
