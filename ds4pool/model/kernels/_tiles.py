"""Tile helpers shared by the attention kernels: paged K/V tile loads, online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    cache_ptr,
    table_row_ptr,
    t,  # [BLOCK_N] token positions in the sequence
    valid,  # [BLOCK_N] which of them to load
    kv_head,
    stride_n,
    stride_t,
    stride_h,
    d,  # [D_PAD]
    d_mask,
    BS: tl.constexpr,
):
    # int64 block ids: block * stride_n overflows int32 on large caches.
    block = tl.load(table_row_ptr + t // BS, mask=valid, other=0).to(tl.int64)
    rows = block * stride_n + (t % BS) * stride_t + kv_head * stride_h  # [BLOCK_N]
    ptrs = cache_ptr + rows[:, None] + d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]


@triton.jit
def softmax_step(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
    """One online-softmax update: s [M, N] logits in log2 units, v [N, D_PAD]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may see no key in a masked tile (window, padding rows): keep exp2 away from inf-inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])  # [M, N]
    alpha = tl.exp2(m_i - m_safe)  # [M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def partition_bounds(
    ctx, lo, num_parts, partition, short_len,
    BLOCK_N: tl.constexpr, SHORT: tl.constexpr, FIXED_P: tl.constexpr,
):  # fmt: skip
    """(base, length, one_piece) of a decode row's split-K pieces: piece p covers
    [base + p * length, base + (p + 1) * length). one_piece: exactly one piece meets the
    visible keys [lo, ctx), so its program writes the output itself and the reduce skips
    the row. decode_kernel and decode_reduce_kernel both call this, so they cannot disagree."""
    base = 0
    length = partition
    if FIXED_P:  # num_parts pieces per row, sized at run time from this row's context
        base = (lo // BLOCK_N) * BLOCK_N
        length = tl.cdiv(tl.cdiv(ctx - base, num_parts), BLOCK_N) * BLOCK_N
    elif SHORT > 0:  # a short row's pieces do not depend on the table width: batched == solo
        if ctx <= SHORT:
            length = short_len
    # pieces meeting [lo, ctx) are first..last (none for an empty context: padding rows)
    first = (lo - base) // length
    last = (ctx - 1 - base) // length
    one_piece = (ctx > lo) & (first == last)
    return base, length, one_piece
