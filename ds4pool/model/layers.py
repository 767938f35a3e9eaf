"""Building blocks shared by the decoders: RMSNorm, rotary embedding (default, llama3, yarn),
gated MLP.

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
        """`ops` (ds4pool/model/ops.py) may fuse silu(gate) * up and pick the projections'
        kernels; None: plain torch."""
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if ops is not None:
            gate_up = ops.linear(self.gate_up_proj, x)  # [T, 2I]
            return ops.linear(self.down_proj, gate_up, act=True)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual', norm(residual')) with residual' = residual + self(x): the down
        projection, the add and the norm as one op (one launch where ops fuse them)."""
        if self.gate_up_proj is None:
            return ops.add_rms_norm(norm, self(x, ops), residual)
        gate_up = ops.linear(self.gate_up_proj, x)
        return ops.linear_add_rms_norm(self.down_proj, gate_up, norm, residual, act=True)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 or yarn scaling if
    configured."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.kind == "yarn":
        return _yarn_inv_freq(head_dim, rope, rope.theta**exponent)
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


def _yarn_inv_freq(dim: int, rope: RopeConfig, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dims that turn fewer than beta_slow times over the original
    context are interpolated by `factor`, those turning more than beta_fast times are kept,
    with a linear ramp between (the correction range, in dims)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor yarn puts on cos and sin (so on q·k twice); 1 for the other kinds."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (ragged) positions; no table sized by max context."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.dim, self.rope = head_dim, rope
        self.attention_factor = rope_attention_factor(rope)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions [T] → cos, sin [T, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position; the rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position, DeepSeek's convention: the pairs are adjacent dims
    (x0, x1), (x2, x3), ...; the result holds the rotated first members, then the second
    ones (transformers' layout; q and k get the same order, so q·k is unchanged by it)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]  # cos/sin are cat(freqs, freqs)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
