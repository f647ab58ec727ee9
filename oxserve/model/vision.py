"""The glm5_next vision tower and projector: patches of images and video frames -> embeddings
in the decoder's hidden size, one per `spatial_merge_size`² patches.

    patches [N, C*T*P*P] -> patch embedding -> blocks (RMSNorm, attention with 2-D axial RoPE
    inside each frame, clamped SwiGLU) -> RMSNorm -> merge m x m neighbours (a strided conv)
    -> projector (linear, LayerNorm, GELU, clamped SwiGLU) -> [N / m², out_hidden_size]

Patches arrive in the processor's order: within a frame, m x m merge blocks one after the
other, so that the merge is a reshape. Parameter names are the checkpoint's (under
`model.visual.`), so loading is a straight copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.norm import rms_norm
from oxserve.model.activations import activation


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    hidden_act: str = "silu"
    attention_bias: bool = True
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_dict(cls, raw: dict) -> VisionConfig:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config: rope_type {rope['rope_type']!r}; the glm5_next vision tower uses axial RoPE")
        if "rope_theta" in rope:
            known["rope_theta"] = rope["rope_theta"]
        return cls(**known)


@dataclass(frozen=True)
class MultiModalConfig:
    """What the decoder's prompt needs of images and video: the vision tower's config and the
    placeholder tokens (the model's image token stands for an embedding, in video spans too)."""

    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    image_start_token_id: int
    image_end_token_id: int
    video_start_token_id: int
    video_end_token_id: int

    @classmethod
    def from_file(cls, path: str | Path) -> MultiModalConfig | None:
        """From a checkpoint's config.json; None for a text-only checkpoint (no vision_config)."""
        path = Path(path)
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        if not raw.get("vision_config"):
            return None
        defaults = dict(image_token_id=154854, video_token_id=154855, image_start_token_id=154830,
                        image_end_token_id=154831, video_start_token_id=154832, video_end_token_id=154833)
        ids = {k: raw.get(k, v) for k, v in defaults.items()}
        return cls(VisionConfig.from_hf_dict(raw["vision_config"]), **ids)


class ClampedSwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float, act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.limit, self.act = limit, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(self, x)


def clamped_swiglu(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(act(min(gate, limit)) * clamp(up, ±limit)) with `mlp`'s three projections."""
    gate = mlp.gate_proj(x).clamp(max=mlp.limit)
    up = mlp.up_proj(x).clamp(-mlp.limit, mlp.limit)
    return mlp.down_proj(mlp.act(gate) * up)


class RMSNorm(nn.Module):
    """The reference's RMSNorm, with a plain parameter (the text model's is a loadable one)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        """x [N, D]; cos/sin [N, head_dim]; frames: patches per frame (attention stays inside one)."""
        q, k, v = self.qkv(x).view(len(x), 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin)
        out = [
            F.scaled_dot_product_attention(qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1)).transpose(0, 1)
            for qf, kf, vf in zip(q.split(frames), k.split(frames), v.split(frames))
        ]
        return self.proj(torch.cat(out).reshape(len(x), -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the whole head (rotate-half form) in fp32, back in x's dtype. x [N, H, hd]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = ClampedSwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, cfg.hidden_act, cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is the whole patch: a linear map of the flattened patch."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class Projector(nn.Module):
    """The patch merger's projection into the decoder's space."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        dim = cfg.out_hidden_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, cfg.projection_intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, cfg.projection_intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.projection_intermediate_size, dim, bias=False)
        self.limit, self.act = cfg.swiglu_limit, activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(self, F.gelu(self.post_projection_norm(self.proj(x))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m = cfg.spatial_merge_size
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=m, stride=m)
        self.merger = Projector(cfg)
        spatial = cfg.head_dim // 2  # half the head rotates by row, half by column
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial),
                             persistent=False)  # fmt: skip

    def forward(self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum t*h*w, patch_dim] of items with grids (t, h, w) in patches ->
        embeddings [sum t*h*w / m², out_hidden_size]."""
        cos, sin = self.rope(grid_thw, patches.device)
        frames = [h * w for t, h, w in grid_thw for _ in range(t)]
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        x = self.post_layernorm(x)
        m = self.config.spatial_merge_size
        # Each run of m*m rows is one merge block, row-major: the conv's kernel, flattened.
        x = x.view(-1, m * m, x.shape[-1]).transpose(1, 2).reshape(-1, x.shape[-1] * m * m)
        x = F.linear(x, self.downsample.weight.flatten(1), self.downsample.bias)
        return self.merger(x)

    def rope(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] of each patch's (row, column), in merge-block order."""
        m = self.config.spatial_merge_size
        positions = []
        for t, h, w in grid_thw:
            rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(-1, -1, w // m, m)
            cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, -1, -1)
            block_major = (rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten())
            positions.append(torch.stack(block_major, -1).repeat(t, 1))
        angles = torch.cat(positions).unsqueeze(-1).float() * self.inv_freq  # [N, 2, hd/4]
        angles = angles.flatten(1)  # rows' angles, then columns'
        angles = torch.cat((angles, angles), -1)
        return angles.cos(), angles.sin()
