"""The attention prologue of a Llama-family layer in one Triton launch: per-head RMSNorm of q
and k (Qwen3's q_norm / k_norm; skipped for the families without them), rotate-half RoPE of
both, and the store of this step's k and v into the paged cache at their slots.

Unfused, that is four launches a layer on the Triton path (q_norm, k_norm, rotary, store_kv:
193 of a Qwen3-30B-A3B step's launches are RMSNorms) for a few KB of work each; at batch 1
each costs its launch, not its bytes. Here program (t, j) takes token t's j-th block of q
heads, or, past the q blocks, a block of its kv heads (k normalised, rotated, written back
and stored; v stored as it is). q and k are updated in place (they are views of the fused
qkv projection's output, read by nobody else), so attention reads them as before and only
skips its own store of k and v.

Numerics are those of the unfused kernels in triton_fused.py, step for step: the norm in
fp32 cast to the activation dtype before the weight multiply, cos/sin in fp32 from the
positions (times the yarn attention factor) cast to the activation dtype, as the torch
reference (model/layers.py) rounds.

On a decode-only step the decode kernel can do this prologue itself (one launch fewer a
layer): `DecodePrologue` carries these arguments to triton_attention.paged_decode, whose
kernel reuses the @triton.jit helpers here (rope_cos_sin, norm_rope_heads, store_kv_heads),
so the two paths cannot round differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope(
    base, m, cols, cmask, w_ptr, c, s, eps,
    D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads at `base` [BLOCK, HALF_PAD] (first halves; second halves at + HALF): normalised
    (if HAS_NORM) and rotated, returned in the activation dtype as (first, second)."""
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    dt = x1.dtype
    if HAS_NORM:
        h1, h2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)) / D + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0)[None, :]
        x1 = ((h1 * inv).to(dt) * w1).to(dt)
        x2 = ((h2 * inv).to(dt) * w2).to(dt)
    cd, sd = c.to(dt), s.to(dt)
    return (x1 * cd - x2 * sd).to(dt), (x2 * cd + x1 * sd).to(dt)


@triton.jit
def rope_cos_sin(pos_ptr, inv_ptr, t, cols, cmask, factor):
    """cos, sin [1, HALF_PAD] fp32 of token t's position (times the attention factor)."""
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = pos * tl.load(inv_ptr + cols, mask=cmask, other=0.0)  # [HALF_PAD] fp32
    return (tl.cos(freq) * factor)[None, :], (tl.sin(freq) * factor)[None, :]


@triton.jit
def norm_rope_heads(
    x_ptr, w_ptr, t, first, end, stride_xt, stride_xh, cols, cmask, c, s, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads [first, min(first + BLOCK, end)) of token t normed and rotated (nothing stored):
    (first halves, second halves, heads, mask), [BLOCK, HALF_PAD] each. The decode kernel's
    fused prologue (kernels/_decode_kernels.py) computes its q tile and k head with this."""
    heads = first + tl.arange(0, BLOCK)
    m = (heads < end)[:, None] & cmask[None, :]
    base = x_ptr + t.to(tl.int64) * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    y1, y2 = _norm_rope(base, m, cols, cmask, w_ptr, c, s, eps, D, HALF, HAS_NORM)
    return y1, y2, heads, m


@triton.jit
def _q_block(
    q_ptr, w_ptr, t, first, num_heads, stride_qt, stride_qh, cols, cmask, c, s, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads [first, first + BLOCK) of token t normed and rotated in place; returns their
    halves, the heads and the mask (the k block stores them into the cache too)."""
    y1, y2, heads, m = norm_rope_heads(
        q_ptr, w_ptr, t, first, num_heads, stride_qt, stride_qh, cols, cmask, c, s, eps,
        D, HALF, BLOCK, HAS_NORM,
    )  # fmt: skip
    base = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + cols[None, :]
    tl.store(base, y1, mask=m)
    tl.store(base + HALF, y2, mask=m)
    return y1, y2, heads, m


@triton.jit
def store_kv_heads(
    y1, y2, heads, m, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, t, num_kv_heads,
    stride_vt, stride_vh, cols, D: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """k heads (their rotated halves y1, y2) and the same heads of v, token t, stored at the
    token's slot of a contiguous [.., H_kv, D] k and v cache (v as it is, cast)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    off = slot * num_kv_heads * D + heads[:, None] * D + cols[None, :]
    et = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + off, y1.to(et), mask=m)
    tl.store(k_cache_ptr + off + HALF, y2.to(et), mask=m)
    vb = v_ptr + t.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + cols[None, :]
    tl.store(v_cache_ptr + off, tl.load(vb, mask=m).to(et), mask=m)
    tl.store(v_cache_ptr + off + HALF, tl.load(vb + HALF, mask=m).to(et), mask=m)


@triton.jit
def _kv_block(
    k_ptr, v_ptr, cache_ptr, slot_ptr, w_ptr, t, first, num_kv_heads, half_cache,
    stride_kt, stride_kh, stride_vt, stride_vh, cols, cmask, c, s, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    y1, y2, heads, m = _q_block(
        k_ptr, w_ptr, t, first, num_kv_heads, stride_kt, stride_kh, cols, cmask, c, s, eps,
        D, HALF, BLOCK, HAS_NORM,
    )  # fmt: skip
    store_kv_heads(
        y1, y2, heads, m, v_ptr, cache_ptr, cache_ptr + half_cache, slot_ptr, t, num_kv_heads,
        stride_vt, stride_vh, cols, D, HALF,
    )  # fmt: skip


@triton.jit
def _prologue_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, pos_ptr, slot_ptr, inv_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    num_heads, num_kv_heads, half_cache, eps, factor,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.program_id(1)
    q_blocks = tl.cdiv(num_heads, BLOCK_Q)
    cols = tl.arange(0, HALF_PAD)  # tl.arange needs a power of 2: D/2 = 12 pads to 16
    cmask = cols < HALF
    c, s = rope_cos_sin(pos_ptr, inv_ptr, t, cols, cmask, factor)
    # a runtime branch: each side is a function of its own, so that no name is assigned
    # tiles of two shapes (q's and kv's blocks differ) in the two branches
    if j < q_blocks:
        _q_block(q_ptr, qw_ptr, t, j * BLOCK_Q, num_heads, stride_qt, stride_qh, cols, cmask,
                 c, s, eps, D, HALF, BLOCK_Q, HAS_NORM)  # fmt: skip
    else:
        _kv_block(k_ptr, v_ptr, cache_ptr, slot_ptr, kw_ptr, t, (j - q_blocks) * BLOCK_KV,
                  num_kv_heads, half_cache, stride_kt, stride_kh, stride_vt, stride_vh, cols,
                  cmask, c, s, eps, D, HALF, BLOCK_KV, HAS_NORM)  # fmt: skip


def norm_rope_store(
    q: torch.Tensor,  # [T, H, D], rows and heads may be strided (views of the qkv output)
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    cache: torch.Tensor,  # [2, N, bs, H_kv, D] contiguous (KVLayout kind "kv")
    positions: torch.Tensor,  # [T]
    slots: torch.Tensor,  # [T] flat slots of the cache's token view
    inv_freq: torch.Tensor,  # [D / 2] float32
    q_weight: torch.Tensor | None = None,  # [D]: q_norm's weight; None (with k_weight): no norm
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    attention_factor: float = 1.0,
) -> None:
    """q, k normalised and rotated in place; k (after) and v stored at `slots`: one launch."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    if t == 0:
        return
    assert k.shape == v.shape == (t, h_kv, d) and d % 2 == 0, (q.shape, k.shape, v.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cache.is_contiguous() and cache.shape[0] == 2 and cache.shape[-2:] == (h_kv, d)
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    block_q = min(16, triton.next_power_of_2(h))
    block_kv = min(16, triton.next_power_of_2(h_kv))
    grid = (t, triton.cdiv(h, block_q) + triton.cdiv(h_kv, block_kv))
    qw = q_weight if q_weight is not None else inv_freq  # unread without the norm
    kw = k_weight if k_weight is not None else inv_freq
    _prologue_kernel[grid](
        q, k, v, cache, positions, slots, inv_freq, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        h, h_kv, cache[0].numel(), eps, attention_factor,
        D=d, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_Q=block_q,
        BLOCK_KV=block_kv, HAS_NORM=has_norm, num_warps=4,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodePrologue:
    """The prologue's arguments for the decode kernel that does it itself
    (triton_attention.paged_decode(prologue=...), kernels/_decode_kernels.py): the q given
    to paged_decode is then the raw q view, k and v are this step's raw views (one token per
    sequence), stored by the kernel at `slots`. Arguments as `norm_rope_store`'s."""

    k: torch.Tensor  # [B, H_kv, D], strided rows and heads (views of the qkv output)
    v: torch.Tensor  # [B, H_kv, D]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B]
    inv_freq: torch.Tensor  # [D / 2] float32
    q_weight: torch.Tensor | None = None  # with k_weight: q_norm's and k_norm's weights
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    attention_factor: float = 1.0
    pdl: bool = False  # the decode kernel launched with programmatic dependent launch

    def launch_args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple, dict]:
        """(the decode kernel's prologue arguments, its constexprs), checked against the
        caches ([N, bs, H_kv, D] views of a contiguous KVLayout "kv" cache)."""
        b, h_kv, d = self.k.shape
        assert self.v.shape == self.k.shape and d % 2 == 0, (self.k.shape, self.v.shape)
        assert d & (d - 1) == 0, f"the fused decode prologue needs a power-of-two head_dim: {d}"
        assert self.k.stride(2) == 1 and self.v.stride(2) == 1
        assert self.positions.shape == self.slots.shape == (b,), (self.positions.shape, b)
        dense = (k_cache.shape[1] * h_kv * d, h_kv * d, d, 1)
        assert k_cache.stride() == v_cache.stride() == dense, (k_cache.stride(), dense)
        assert (self.q_weight is None) == (self.k_weight is None)
        qw = self.q_weight if self.q_weight is not None else self.inv_freq  # unread: no norm
        kw = self.k_weight if self.k_weight is not None else self.inv_freq
        args = (
            self.k, self.v, self.positions, self.slots, self.inv_freq, qw, kw,
            self.k.stride(0), self.k.stride(1), self.v.stride(0), self.v.stride(1),
            self.eps, self.attention_factor,
        )  # fmt: skip
        consts = dict(
            PROLOGUE=True, HAS_NORM=self.q_weight is not None, HALF=d // 2, HALF_PAD=d // 2,
            BLOCK_KV=min(16, triton.next_power_of_2(h_kv)), PDL=self.pdl,
        )  # fmt: skip
        return args, consts


def no_decode_prologue(q: torch.Tensor, lens: torch.Tensor) -> tuple:
    """The decode kernel's prologue arguments where it has none (unread; PROLOGUE off)."""
    return (q, q, lens, lens, q, q, q, 0, 0, 0, 0, 0.0, 1.0)
