"""Varlen causal prefill over the paged cache, GQA heads folded into M (see triton_attention)."""

from __future__ import annotations

import triton
import triton.language as tl

from ds4pool.model.kernels._tiles import load_kv_tile, softmax_step


@triton.jit
def attend_range(
    acc,
    m_i,
    l_i,
    q,  # [BLOCK_M, D_PAD]
    pos,  # [BLOCK_M] query positions
    k_ptr,
    v_ptr,
    table_row,
    kv_head,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    start,
    end,  # key tiles k0 in range(start, end, BLOCK_N)
    first_key,  # keys outside [first_key, last] are not loaded: before every row's window
    last,  # (their blocks may be freed) or past the tile's last query position
    scale_log2,
    window,
    d,
    d_mask,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for k0 in range(start, end, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        in_ctx = (t >= first_key) & (t <= last)  # [BLOCK_N]
        k = load_kv_tile(
            k_ptr, table_row, t, in_ctx, kv_head, stride_kn, stride_kt, stride_kh, d, d_mask, BS
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            seen = (t[None, :] <= pos[:, None]) & in_ctx[None, :]  # causal
            if USE_WINDOW:
                seen = seen & (t[None, :] > pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
        v = load_kv_tile(
            v_ptr, table_row, t, in_ctx, kv_head, stride_vn, stride_vt, stride_vh, d, d_mask, BS
        )
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, PRECISION)
    return acc, m_i, l_i


# the table width changes from step to step: no divisibility specialisation, no recompile
@triton.jit(do_not_specialize=["window", "stride_ts"])
def prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    qstart_ptr,
    lens_ptr,
    out_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_ts,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    # last (longest, causal) query tiles first, so that short ones fill the tail of the grid
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + seq)

    # row m of the tile: query token q_tile * BLOCK_Q + m // G of the sequence, head m % G
    m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + m // G  # [BLOCK_M] index among the sequence's new tokens
    heads = kv_head * G + m % G
    row_valid = (m < BLOCK_Q * G) & (tok < q_len)
    pos = ctx - q_len + tok  # [BLOCK_M] position of the query in the sequence
    d = tl.arange(0, D_PAD)
    d_mask = d < D
    io_mask = row_valid[:, None] & d_mask[None, :]
    q_rows = (q_begin + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]

    # positions of the tile's first and last real query token
    pos_first = ctx - q_len + q_tile * BLOCK_Q
    pos_last = ctx - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    # key tiles, in three runs (BLOCK_N aligned):
    # [k_start, k_mid)   masked: the window's lower edge crosses them (window only)
    # [k_mid, k_diag)    unmasked: every row of the tile sees every key
    # [k_diag, pos_last] masked: the causal diagonal
    # tiles above pos_last are never visited
    k_diag = ((pos_first + 1) // BLOCK_N) * BLOCK_N
    k_lo = 0  # the first key any row of the tile sees
    k_start = 0
    k_mid = 0
    if USE_WINDOW:
        k_lo = tl.maximum(pos_first - window + 1, 0)
        k_start = (k_lo // BLOCK_N) * BLOCK_N
        # first tile whose keys all lie inside the last row's window, i.e. k0 > pos_last - window
        k_mid = tl.minimum(tl.maximum(pos_last - window + BLOCK_N, k_start) // BLOCK_N * BLOCK_N,
                           k_diag)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = tables_ptr + seq * stride_ts
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        k_start, k_mid, k_lo, pos_last, scale_log2, window, d, d_mask,
        BS, BLOCK_N, True, USE_WINDOW, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        k_mid, k_diag, k_lo, pos_last, scale_log2, window, d, d_mask,
        BS, BLOCK_N, False, USE_WINDOW, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        k_diag, pos_last + 1, k_lo, pos_last, scale_log2, window, d, d_mask,
        BS, BLOCK_N, True, USE_WINDOW, PRECISION,
    )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (q_begin + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)
