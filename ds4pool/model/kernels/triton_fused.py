"""Fused elementwise Triton kernels for the CUDA decode path.

At batch 1 a decode step of an 8B model is ~3.6 ms of weight reads, but the plain torch
layer is ~40 kernels (RMSNorm alone is seven: float, pow, mean, add, rsqrt, mul, cast;
rotary another eight for q and k), ~1,300 per step, and each costs a couple of µs even
inside a CUDA graph. These kernels do each of those groups in one launch:

- `rms_norm`: y = w * (x / rms(x)), optionally after `x += residual` (fused add: the
  updated residual stream is written back in place);
- `rotary_`: rotate-half RoPE of q and k in place, cos/sin computed in fp32 from the
  positions and the inverse frequencies (no [T, D] tables);
  (the Llama family's attention runs q/k norm + RoPE + the KV store as one launch instead:
  triton_prologue.py; these stay for the paths that cannot, e.g. a non-contiguous cache);
- `store_kv`: this step's k and v into the paged cache at their slots (one launch for both);
- `silu_mul`: silu(gate) * up of the fused gate_up projection's output.

Numerics follow the torch reference (ds4pool/model/layers.py): norms in fp32, the
normalised row cast to the activation dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def normalised_row(x, w, n, eps):
    """x [BLOCK] (one row in the activation dtype, zeros past n) → w * (x / rms(x)): the norm
    in float32, the normalised row cast to x's dtype before the weight multiply. Every fused
    norm of the decode path calls it, so they round alike (triton_moe_gate's too)."""
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    return scaled_row(x, inv, w)


@triton.jit
def scaled_row(x, inv, w):
    """w * (x * inv) with x * inv in float32 cast to x's dtype: the norm's last step, given
    inv = 1 / rms(x) (normalised_row, or a norm that sums the squares in pieces)."""
    return (x.to(tl.float32) * inv).to(x.dtype) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    y = normalised_row(x, tl.load(w_ptr + cols, mask=mask, other=0.0), n, eps)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [R, N] (rows may be strided)
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [R, N]: residual += x first, then normalise it
) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, inv_ptr, stride_t, stride_h, num_heads, factor,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] head indices
    cols = tl.arange(0, HALF_PAD)  # [HALF_PAD] (tl.arange needs a power of 2)
    cmask = cols < HALF
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = pos * tl.load(inv_ptr + cols, mask=cmask, other=0.0)  # [HALF_PAD] fp32
    cos = (tl.cos(freq) * factor)[None, :]  # yarn's attention factor (1 for other kinds)
    sin = (tl.sin(freq) * factor)[None, :]
    base = x_ptr + t * stride_t + heads[:, None] * stride_h + cols[None, :]
    m = (heads < num_heads)[:, None] & cmask[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    dt = x1.dtype
    c, s = cos.to(dt), sin.to(dt)  # the reference casts its tables to the activation dtype
    tl.store(base, (x1 * c - x2 * s).to(dt), mask=m)
    tl.store(base + HALF, (x2 * c + x1 * s).to(dt), mask=m)


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> None:
    """x [T, H, D] rotated in place by position (rotate-half convention); cos and sin are
    scaled by `attention_factor` as RotaryEmbedding scales them."""
    t, h, d = x.shape
    if t == 0:
        return
    assert x.stride(2) == 1 and d % 2 == 0
    block = min(16, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block))
    _rotary_kernel[grid](
        x, positions, inv_freq, x.stride(0), x.stride(1), h, attention_factor, HALF=d // 2,
        HALF_PAD=triton.next_power_of_2(d // 2), BLOCK=block, num_warps=2,
    )  # fmt: skip


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    half_cache, num_heads,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D_PAD)
    m = (heads < num_heads)[:, None] & (cols < D)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + cols[None, :], mask=m)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=m)
    dst = cache_ptr + slot * num_heads * D + heads[:, None] * D + cols[None, :]
    tl.store(dst, k, mask=m)
    tl.store(dst + half_cache, v, mask=m)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, H_kv, D] into cache [2, N, bs, H_kv, D] (contiguous) at flat `slots` [T]."""
    t, h, d = k.shape
    if t == 0:
        return
    assert cache.is_contiguous() and k.stride(2) == 1 and v.stride(2) == 1
    half = cache[0].numel()
    _store_kv_kernel[(t,)](
        k, v, cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), half, h,
        D=d, D_PAD=triton.next_power_of_2(d), BLOCK_H=triton.next_power_of_2(h), num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu in fp32, cast like F.silu
    tl.store(out_ptr + row * stride_o + cols, act * up, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) → silu(gate) * up [T, I]."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
    )
    return out
