"""Split-K paged decode: per-partition kernel and log-sum-exp reduce (see triton_attention).

With PROLOGUE the decode kernel also does the Llama family's attention prologue
(kernels/triton_prologue.py) of a decode-only step, saving its launch: each program reads its
G query heads of token b from the raw q view (the qkv projection's output), normalises (with
HAS_NORM) and rotates them in registers with the prologue's own @triton.jit helpers, and uses
them as its q tile (nothing is stored); the program whose partition holds the new token
(position ctx - 1; program 0 of a padding row, whose slot is the layout's scratch) also
normalises + rotates k of its kv head and stores k and v at the token's slot, then a
barrier, so that its own loads of the last tile see them. No other program reads that slot.
Bits: under the interpreter the same as the prologue followed by the plain kernel
(tests/unit/test_triton_decode_prologue.py); compiled, the cache the same bits and the
attention within one bf16 rounding (tests/gpu/test_decode_prologue_cuda.py: the two kernels
round the rotated q differently in a few elements). head_dim must be a power of two (the
two rotated halves joined are the q tile's columns in order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4pool.model.kernels._pdl import pdl_trigger, pdl_wait
from ds4pool.model.kernels._tiles import load_kv_tile, partition_bounds, softmax_step
from ds4pool.model.kernels.triton_prologue import norm_rope_heads, rope_cos_sin, store_kv_heads


# Values that change from step to step or bucket to bucket (table width, partition count and
# length) are not specialised on (divisibility, == 1), so a new shape does not recompile.
@triton.jit(do_not_specialize=["window", "stride_tb", "num_parts", "partition", "short_len"])
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    window,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    num_parts,
    partition,
    short_len,
    # the fused prologue's (PROLOGUE; unread without it): q_ptr is then the raw q view,
    # k_new_ptr / v_new_ptr this step's raw k and v [B, H_kv, D] views
    k_new_ptr,
    v_new_ptr,
    pos_ptr,
    slot_ptr,
    inv_ptr,
    qw_ptr,
    kw_ptr,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    eps,
    factor,
    H: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SHORT: tl.constexpr,
    FIXED_P: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    PROLOGUE: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False,  # q/k RMSNorm in the prologue (Qwen3)
    HALF: tl.constexpr = 1,  # D // 2
    HALF_PAD: tl.constexpr = 1,  # == HALF: D is a power of two
    BLOCK_KV: tl.constexpr = 1,  # rows of the k head's tile: the prologue kernel's BLOCK_KV
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/_pdl.py)
):
    pdl_trigger(PDL)
    pdl_wait(PDL)  # every input may be the output of a kernel still running
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # partition p covers [base + p * length, base + (p + 1) * length); BLOCK_N aligned
    base, length, one_piece = partition_bounds(
        ctx, lo, num_parts, partition, short_len, BLOCK_N, SHORT, FIXED_P
    )
    # visible keys of this program: [max(p_start, lo), p_end)
    p_start = base + part * length
    p_end = tl.minimum(p_start + length, ctx)
    first = tl.maximum(p_start, lo)
    if PROLOGUE:
        cols = tl.arange(0, HALF_PAD)
        cmask = cols < HALF
        rc, rs = rope_cos_sin(pos_ptr, inv_ptr, b, cols, cmask, factor)
        # the partition of position ctx - 1 stores the token's k, v (program 0 for ctx 0)
        owner = ((p_start < ctx) & (ctx <= p_start + length)) | ((ctx == 0) & (part == 0))
        if owner:
            ky1, ky2, kh, km = norm_rope_heads(
                k_new_ptr, kw_ptr, b, kv_head, kv_head + 1, stride_knb, stride_knh, cols,
                cmask, rc, rs, eps, D, HALF, BLOCK_KV, HAS_NORM,
            )  # fmt: skip
            store_kv_heads(
                ky1, ky2, kh, km, v_new_ptr, k_ptr, v_ptr, slot_ptr, b, H // G, stride_vnb,
                stride_vnh, cols, D, HALF,
            )  # fmt: skip
        # the stores are seen by the whole program before its loop loads the last tile
        tl.debug_barrier()
    if SPLIT:
        # the reduce kernel skips these partitions by the same test; with one partition the
        # program owns the output row and writes zeros for an empty context instead
        if p_end <= first:
            return

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_mask = d < D
    heads = kv_head * G + g  # [G_PAD]
    row_mask = (g < G)[:, None] & d_mask[None, :]  # [G_PAD, D_PAD]
    if PROLOGUE:  # the prologue's q heads, joined [G_PAD, HALF] x 2 -> [G_PAD, D] in order
        qy1, qy2, _, _ = norm_rope_heads(
            q_ptr, qw_ptr, b, kv_head * G, kv_head * G + G, stride_qb, stride_qh, cols, cmask,
            rc, rs, eps, D, HALF, G_PAD, HAS_NORM,
        )  # fmt: skip
        q = tl.reshape(tl.permute(tl.join(qy1, qy2), (0, 2, 1)), (G_PAD, D_PAD))
    else:
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=row_mask,
            other=0.0,
        )  # [G_PAD, D_PAD]

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_row = tables_ptr + b * stride_tb
    # start at the tile holding `first`; p_start is a multiple of BLOCK_N, so this stays >= it
    for t0 in range((first // BLOCK_N) * BLOCK_N, p_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = (t >= first) & (t < p_end)  # [BLOCK_N]
        k = load_kv_tile(
            k_ptr, table_row, t, valid, kv_head, stride_kn, stride_kt, stride_kh, d, d_mask, BS
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        v = load_kv_tile(
            v_ptr, table_row, t, valid, kv_head, stride_vn, stride_vt, stride_vh, d, d_mask, BS
        )
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, PRECISION)

    # a row of one piece (a short row, or a split row shorter than one partition) is written
    # here, as without the split: the reduce of one partial (weight exp2(0) = 1, sum / 1) would
    # give these same bits, for the cost of an fp32 round trip and a reduce program
    # a padding row (no key) has l_i = 0 and writes zeros; a partial always saw >= 1 key
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        if one_piece:
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            lse = m_i + tl.log2(l_i)  # [G_PAD], log2 units
            slot = (b * H + heads) * num_parts + part  # [G_PAD] into [B, H, P]
            tl.store(part_out_ptr + slot[:, None] * D + d[None, :], o, mask=row_mask)
            tl.store(part_lse_ptr + slot, lse, mask=g < G)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["window", "num_parts", "partition", "short_len"])
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    lens_ptr,
    out_ptr,
    window,
    stride_ob,
    stride_oh,
    num_parts,
    partition,
    short_len,
    H: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SHORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FIXED_P: tl.constexpr,
    P_CHUNK: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,  # decode_kernel writes one-piece rows itself (the MLA kernel does not)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # the partition bounds of decode_kernel
    base, length, one_piece = partition_bounds(
        ctx, lo, num_parts, partition, short_len, BLOCK_N, SHORT, FIXED_P
    )
    if DIRECT:
        if one_piece:  # decode_kernel wrote this row's output itself
            return
    row = (b * H + h) * num_parts
    # num_parts is a runtime value (no recompile per context bucket): walk it in chunks,
    # first for the max lse, then for the weighted sum of the [P_CHUNK, D] partials
    top_c = tl.full([P_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        # partition p ran iff its range meets the visible keys [lo, ctx)
        ran = (p < num_parts) & (base + p * length < ctx) & (base + (p + 1) * length > lo)
        lse = tl.load(part_lse_ptr + row + p, mask=ran, other=float("-inf"))
        top_c = tl.maximum(top_c, lse)
    top = tl.max(top_c, 0)
    top = tl.where(top == float("-inf"), 0.0, top)

    d = tl.arange(0, D_PAD)
    d_mask = d < D
    acc = tl.zeros([D_PAD], tl.float32)
    total = tl.zeros([P_CHUNK], tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        ran = (p < num_parts) & (base + p * length < ctx) & (base + (p + 1) * length > lo)
        lse = tl.load(part_lse_ptr + row + p, mask=ran, other=float("-inf"))
        w = tl.where(ran, tl.exp2(lse - top), 0.0)  # [P_CHUNK]
        o = tl.load(
            part_out_ptr + (row + p)[:, None] * D + d[None, :],
            mask=ran[:, None] & d_mask[None, :],
            other=0.0,
        )  # [P_CHUNK, D_PAD]
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    denom = tl.sum(total, 0)
    res = acc / tl.where(denom > 0.0, denom, 1.0)  # an empty context (padding row) gives zeros
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_mask)
