"""The elementwise groups of a decoder layer, in two implementations behind one interface.

`TorchOps` is the reference (plain torch, every device; the numerics the fidelity tests
check against transformers). `TritonOps` runs each group as one fused Triton kernel
(ds4pool/model/kernels/triton_fused.py) on CUDA, where a decode step at small batch is
bound by the number of kernels rather than by their work. The runner picks one with the
attention backend; the model passes it down each forward (no global switch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from ds4pool.model.layers import RMSNorm, RotaryEmbedding, apply_rotary


class TorchOps:
    name = "torch"

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x))."""
        h = residual + x
        return h, norm(h)

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return rotary(positions, dtype)  # cos, sin [T, 1, D]

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps(TorchOps):
    """Fused kernels; in-place where the reference makes a new tensor nobody else reads."""

    name = "triton"

    def __init__(self) -> None:
        from ds4pool.model.kernels import triton_fused

        self._k = triton_fused

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self._k.rms_norm(x.reshape(-1, shape[-1]), norm.weight, norm.eps).view(shape)

    def add_rms_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual is the layer's own running sum (made by the embedding or a previous
        # layer): updating it in place is safe
        return residual, self._k.rms_norm(x, norm.weight, norm.eps, residual=residual)

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions, rotary.inv_freq  # cos/sin are computed inside the kernel

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, inv_freq = rope
        t, h, d = q.shape
        both = _adjacent_heads(q, k)
        if both is not None:  # q and k side by side in the qkv output: one launch
            self._k.rotary_(both, positions, inv_freq)
        else:
            q, k = q.contiguous(), k.contiguous()
            self._k.rotary_(q, positions, inv_freq)
            self._k.rotary_(k, positions, inv_freq)
        return q, k


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A [T, H + H_kv, D] view over q and k if k's heads follow q's in memory, in the same
    storage (separate tensors can be adjacent by the allocator's chance: q/k-norm outputs)."""
    t, h, d = q.shape
    # a size-1 token axis may carry any stride: only compare it when it matters
    same_rows = t == 1 or k.stride(0) == q.stride(0)
    if (
        q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and q.stride(2) == 1
        and k.stride(2) == 1
        and q.stride(1) == d
        and k.stride(1) == d
        and same_rows
        and k.data_ptr() == q.data_ptr() + h * d * q.element_size()
    ):
        return q.as_strided((t, h + k.shape[1], d), (q.stride(0), d, 1))
    return None
