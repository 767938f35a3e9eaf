"""Building blocks shared by the Llama family: RMSNorm, rotary embedding, gated MLP.

Numerics follow the Hugging Face reference on purpose (norms in float32, RoPE tables
in float32 cast to the activation dtype) so fp32 logits match it to ~1e-6.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ds4pool.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input)."""
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    fused = nn.Linear(first.in_features, out, bias=first.bias is not None)
    fused = fused.to(device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return fused.requires_grad_(False)


class GatedMLP(nn.Module):
    """gate/up are separate on disk; `fuse()` makes them one `gate_up_proj` after loading."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """`ops` (ds4pool/model/ops.py) may fuse silu(gate) * up; None: plain torch."""
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 scaling if configured."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.kind != "llama3":
        return inv_freq
    # Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept,
    # and the band in between is interpolated smoothly.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (ragged) positions; no table sized by max context."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions [T] → cos, sin [T, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position; the rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
