"""Varlen causal prefill over the paged cache, GQA heads folded into M, optionally split-K over
the keys with a reduce (see triton_attention)."""

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


# The table width changes from step to step: no divisibility specialisation, no recompile.
# Nor alignment of the per-sequence pointers: the split path (triton-split) passes them from
# the step's first prompt row on, 4 bytes a decode row before it, and a pointer 16-byte
# aligned in one step and not in the next would be a compile in the middle of serving (run
# L's 1.1 s steps; tests/unit/test_triton_variants.py). They are read one value at a time.
@triton.jit(
    do_not_specialize=[
        "window", "stride_ts", "num_parts", "n_heads", "q_offset", "tables_ptr", "qstart_ptr",
        "lens_ptr",
    ]
)  # fmt: skip
def prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    qstart_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,  # SPLIT: [T, H, P, D] fp32 partial outputs, each normalised by its own sum
    part_lse_ptr,  # SPLIT: [T, H, P] fp32 log2-sum-exp of each partial (-inf: saw no key)
    scale_log2,
    window,
    num_parts,
    n_heads,
    q_offset,  # query_start's value of q's (and out's) first row
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
    SPLIT: tl.constexpr,
    SMALL_M: tl.constexpr = 0,
):
    seq = tl.program_id(0) // num_parts
    part = tl.program_id(0) % num_parts
    # last (longest, causal) query tiles first, so that short ones fill the tail of the grid
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq) - q_offset
    q_len = tl.load(qstart_ptr + seq + 1) - q_offset - q_begin
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + seq)
    # a sequence whose query rows fit SMALL_M (a mixed step's decode rows: G rows of BLOCK_M
    # live) runs on a SMALL_M-row tile, ~BLOCK_M / SMALL_M times less MMA work over the same
    # keys; the same keys, tiles and order, so the same sums row by row
    if SMALL_M > 0:
        if q_len * G <= SMALL_M:
            prefill_tile(
                q_ptr, k_ptr, v_ptr, tables_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                seq, part, 0, kv_head, q_begin, q_len, ctx, scale_log2, window, num_parts,
                n_heads, stride_qt, stride_qh, stride_kn, stride_kt, stride_kh, stride_vn,
                stride_vt, stride_vh, stride_ts, stride_ot, stride_oh,
                G, D, D_PAD, BS, SMALL_M, SMALL_M // G, BLOCK_N, USE_WINDOW, PRECISION, SPLIT,
            )  # fmt: skip
            return
    prefill_tile(
        q_ptr, k_ptr, v_ptr, tables_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        seq, part, q_tile, kv_head, q_begin, q_len, ctx, scale_log2, window, num_parts,
        n_heads, stride_qt, stride_qh, stride_kn, stride_kt, stride_kh, stride_vn,
        stride_vt, stride_vh, stride_ts, stride_ot, stride_oh,
        G, D, D_PAD, BS, BLOCK_M, BLOCK_Q, BLOCK_N, USE_WINDOW, PRECISION, SPLIT,
    )  # fmt: skip


@triton.jit
def prefill_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq,
    part,
    q_tile,
    kv_head,
    q_begin,
    q_len,
    ctx,
    scale_log2,
    window,
    num_parts,
    n_heads,
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
    SPLIT: tl.constexpr,
):
    """Query tile `q_tile` (BLOCK_Q tokens x G heads) of sequence `seq`, kv head `kv_head`,
    split-K partition `part`: its output rows, or its partials where SPLIT."""
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

    # split-K: partition `part` of num_parts takes an equal, BLOCK_N-aligned share of the
    # tile's keys [k_start, pos_last]; each run below is clipped to it
    p_lo = k_start
    p_hi = pos_last + 1
    if SPLIT:
        share = tl.cdiv(tl.cdiv(pos_last + 1 - k_start, num_parts), BLOCK_N) * BLOCK_N
        p_lo = k_start + part * share
        p_hi = tl.minimum(p_lo + share, pos_last + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = tables_ptr + seq * stride_ts
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        tl.maximum(k_start, p_lo), tl.minimum(k_mid, p_hi), k_lo, pos_last, scale_log2, window,
        d, d_mask, BS, BLOCK_N, True, USE_WINDOW, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        tl.maximum(k_mid, p_lo), tl.minimum(k_diag, p_hi), k_lo, pos_last, scale_log2, window,
        d, d_mask, BS, BLOCK_N, False, USE_WINDOW, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, pos, k_ptr, v_ptr, table_row, kv_head,
        stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
        tl.maximum(k_diag, p_lo), p_hi, k_lo, pos_last, scale_log2, window,
        d, d_mask, BS, BLOCK_N, True, USE_WINDOW, PRECISION,
    )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if SPLIT:
        # a row that saw no key in this partition gets weight 0 in the reduce
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_i), float("-inf"))
        slot = ((q_begin + tok).to(tl.int64) * n_heads + heads) * num_parts + part  # [BLOCK_M]
        tl.store(part_out_ptr + slot[:, None] * D + d[None, :], o, mask=io_mask)
        tl.store(part_lse_ptr + slot, lse, mask=row_valid)
    else:
        o_rows = (q_begin + tok).to(tl.int64) * stride_ot + heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_parts"])
def prefill_reduce_kernel(
    part_out_ptr,  # [T, H, P, D] fp32
    part_lse_ptr,  # [T, H, P] fp32
    out_ptr,
    stride_ot,
    stride_oh,
    num_parts,
    H: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    P_CHUNK: tl.constexpr,
):
    """out[t, h] = the partials of (t, h) weighted by exp2(lse_p - max lse)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = (t.to(tl.int64) * H + h) * num_parts
    top_c = tl.full([P_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        lse = tl.load(part_lse_ptr + row + p, mask=p < num_parts, other=float("-inf"))
        top_c = tl.maximum(top_c, lse)
    top = tl.max(top_c, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, D_PAD)
    d_mask = d < D
    acc = tl.zeros([D_PAD], tl.float32)
    total = tl.zeros([P_CHUNK], tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        ran = p < num_parts
        lse = tl.load(part_lse_ptr + row + p, mask=ran, other=float("-inf"))
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))  # [P_CHUNK]
        o = tl.load(
            part_out_ptr + (row + p)[:, None] * D + d[None, :],
            mask=ran[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    denom = tl.sum(total, 0)
    res = acc / tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_mask)
