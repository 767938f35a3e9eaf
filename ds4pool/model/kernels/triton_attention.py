"""Triton paged attention: split-K decode and varlen causal prefill over the paged KV cache.

Layout (shared with `ds4pool.model.attention`): one layer's cache is [2, N, bs, H_kv, D];
k_cache = cache[0] and v_cache = cache[1] are [N, bs, H_kv, D] views. Token p of a sequence
lives in block block_table[p // bs] at offset p % bs. Both kernels read K/V through the block
table one token row (D contiguous elements) at a time, so a tile of BLOCK_N keys may span
BLOCK_N / bs paged blocks in any order; nothing is ever gathered into a contiguous copy.

GQA: G = H / H_kv query heads share a kv head. A program always owns one kv head and all G of
its query heads, so every K/V element is read once per program, not once per query head.

Decode (one query token per sequence) is memory bound: its cost is reading K/V once. With one
program per (sequence, kv head) a batch of 1-8 long contexts fills only 8-64 of the GPU's SMs,
so the context is split into partitions of `partition_size` tokens (flash-decoding, split-K):
grid (B, H_kv, P). Each program runs an online softmax over its partition with a q tile
[G padded to 16, D] against k tiles [BLOCK_N, D] (tensor-core tl.dot), and writes a partial
output normalised by its own sum plus the partition's log-sum-exp. A small reduce kernel,
grid (B, H), combines the P partials with weights exp(lse_p - max lse). When P == 1 the main
kernel writes the output directly and no reduce runs. P is a runtime argument (only "P > 1"
is a compile-time flag), so new context buckets do not recompile the kernels.

Prefill is compute bound: flash-attention tiles of BLOCK_M query rows x BLOCK_N keys, where
the M rows fold BLOCK_M // G query tokens x G heads of one kv head (row m is token m // G,
head m % G), so K/V tiles are shared by the G heads without repeating them. Grid
(S, ceil(max_query_len / BLOCK_Q), H_kv). The new tokens of sequence s sit at positions
[ctx - q_len, ctx); key tiles strictly below the tile's first query position run without a
mask, the few tiles on the diagonal run with the causal (and sliding-window) mask, and tiles
above the diagonal are never visited. q_len = 1 rows work, so a mixed step can use this kernel
for all its tokens.

CUDA-graph safety: every grid and scratch size derives from tensor SHAPES and host ints
(max_blocks, B, H, max_query_len), never from the values in context_lens / query_start /
block_tables, so a launch can be captured once and replayed with new values written into the
same buffers. Programs whose partition or query tile lies past their row's data exit early;
rows with context_len 0 (padding rows of a graph bucket) write zeros. No host syncs.
Scratch for the partials is allocated with torch.empty in the call (captured graphs keep the
allocation in their private pool) unless a `DecodeWorkspace` is passed.

Accumulation is fp32 for bf16/fp16 inputs; fp32 inputs use IEEE fp32 dots (no TF32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of the decode kernel (partition_size must be a multiple of block_n)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch parameters of the prefill kernel: BLOCK_M rows (tokens x heads) by BLOCK_N keys."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


DEFAULT_DECODE = DecodeLaunch()
DEFAULT_PREFILL = PrefillLaunch()
DEFAULT_PARTITION = 512


@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated split-K scratch: out [B, H, P, D] fp32 and lse [B, H, P] fp32."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


@triton.jit
def _load_kv_tile(
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
def _softmax_step(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
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
def _decode_kernel(
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
    H: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # visible keys of this program: [max(p_start, lo), p_end)
    p_start = part * PARTITION
    p_end = tl.minimum(p_start + PARTITION, ctx)
    first = tl.maximum(p_start, lo)
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
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0
    )  # [G_PAD, D_PAD]

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_row = tables_ptr + b * stride_tb
    # start at the tile holding `first`; p_start is a multiple of BLOCK_N, so this stays >= it
    for t0 in range((first // BLOCK_N) * BLOCK_N, p_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = (t >= first) & (t < p_end)  # [BLOCK_N]
        k = _load_kv_tile(
            k_ptr, table_row, t, valid, kv_head, stride_kn, stride_kt, stride_kh, d, d_mask, BS
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _load_kv_tile(
            v_ptr, table_row, t, valid, kv_head, stride_vn, stride_vt, stride_vh, d, d_mask, BS
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, PRECISION)

    if not SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # every tile saw >= 1 visible key, so l_i > 0 on the real head rows
        o = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)  # [G_PAD], log2 units
        slot = (b * H + heads) * num_parts + part  # [G_PAD] into [B, H, P]
        tl.store(part_out_ptr + slot[:, None] * D + d[None, :], o, mask=row_mask)
        tl.store(part_lse_ptr + slot, lse, mask=g < G)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    lens_ptr,
    out_ptr,
    window,
    stride_ob,
    stride_oh,
    num_parts,
    H: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
    P_CHUNK: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    base = (b * H + h) * num_parts
    # num_parts is a runtime value (no recompile per context bucket): walk it in chunks,
    # first for the max lse, then for the weighted sum of the [P_CHUNK, D] partials
    top_c = tl.full([P_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        # partition p ran iff [p * PARTITION, (p + 1) * PARTITION) meets [lo, ctx)
        ran = (p < num_parts) & (p * PARTITION < ctx) & ((p + 1) * PARTITION > lo)
        lse = tl.load(part_lse_ptr + base + p, mask=ran, other=float("-inf"))
        top_c = tl.maximum(top_c, lse)
    top = tl.max(top_c, 0)
    top = tl.where(top == float("-inf"), 0.0, top)

    d = tl.arange(0, D_PAD)
    d_mask = d < D
    acc = tl.zeros([D_PAD], tl.float32)
    total = tl.zeros([P_CHUNK], tl.float32)
    for c in range(0, num_parts, P_CHUNK):
        p = c + tl.arange(0, P_CHUNK)
        ran = (p < num_parts) & (p * PARTITION < ctx) & ((p + 1) * PARTITION > lo)
        lse = tl.load(part_lse_ptr + base + p, mask=ran, other=float("-inf"))
        w = tl.where(ran, tl.exp2(lse - top), 0.0)  # [P_CHUNK]
        o = tl.load(
            part_out_ptr + (base + p)[:, None] * D + d[None, :],
            mask=ran[:, None] & d_mask[None, :],
            other=0.0,
        )  # [P_CHUNK, D_PAD]
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    denom = tl.sum(total, 0)
    res = acc / tl.where(denom > 0.0, denom, 1.0)  # an empty context (padding row) gives zeros
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> tuple[int, int, int]:
    n_heads, d = q.shape[1], q.shape[2]
    _, _, h_kv, d_kv = k_cache.shape
    assert v_cache.shape == k_cache.shape and d_kv == d, (q.shape, k_cache.shape)
    assert n_heads % h_kv == 0, (n_heads, h_kv)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, q.shape)
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    return n_heads, h_kv, d


def decode_num_partitions(max_blocks: int, block_size: int, partition_size: int) -> int:
    """P of the split-K grid: from shapes only, so it is fixed for a captured graph."""
    return max(1, -(-max_blocks * block_size // partition_size))


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, bs, H_kv, D]
    v_cache: torch.Tensor,  # [N, bs, H_kv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (or int64)
    context_lens: torch.Tensor,  # [B] int32 (or int64), incl. the query's own token
    scale: float,
    out: torch.Tensor,  # [B, H, D], written in place
    *,
    sliding_window: int | None = None,
    partition_size: int = DEFAULT_PARTITION,
    launch: DecodeLaunch = DEFAULT_DECODE,
    workspace: DecodeWorkspace | None = None,
) -> None:
    """Attention of one query token per sequence over its paged context (split-K)."""
    n_heads, h_kv, d = _check_common(q, k_cache, v_cache, out)
    batch, max_blocks = block_tables.shape
    bs = k_cache.shape[1]
    assert q.shape[0] == batch == context_lens.shape[0], (q.shape, block_tables.shape)
    assert block_tables.stride(1) == 1 and context_lens.stride(0) == 1
    assert partition_size % launch.block_n == 0, (partition_size, launch.block_n)
    if batch == 0:
        return
    g = n_heads // h_kv
    num_parts = decode_num_partitions(max_blocks, bs, partition_size)
    if workspace is None and num_parts > 1:
        workspace = DecodeWorkspace(
            q.new_empty((batch, n_heads, num_parts, d), dtype=torch.float32),
            q.new_empty((batch, n_heads, num_parts), dtype=torch.float32),
        )
    if workspace is not None:
        assert workspace.partial_out.shape[2:] == (num_parts, d)
        assert workspace.partial_out.shape[:2] == (batch, n_heads)
    part_out = workspace.partial_out if workspace is not None else out
    part_lse = workspace.partial_lse if workspace is not None else out
    window = sliding_window or 0
    d_pad = triton.next_power_of_2(d)
    _decode_kernel[(batch, h_kv, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_parts,
        H=n_heads, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad, BS=bs,
        BLOCK_N=launch.block_n, PARTITION=partition_size, SPLIT=num_parts > 1,
        USE_WINDOW=window > 0, PRECISION=_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_parts == 1:
        return
    _decode_reduce_kernel[(batch, n_heads)](
        part_out, part_lse, context_lens, out, window, out.stride(0), out.stride(1), num_parts,
        H=n_heads, D=d, D_PAD=d_pad, PARTITION=partition_size, P_CHUNK=16,
        USE_WINDOW=window > 0, num_warps=4,
    )  # fmt: skip


@triton.jit
def _prefill_kernel(
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
    q_tile = tl.program_id(1)
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
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0)
    k_start = (lo // BLOCK_N) * BLOCK_N
    # [k_start, k_full): keys every row sees (no mask); [k_full, pos_last]: masked tiles
    k_full = k_start
    if not USE_WINDOW:
        k_full = ((pos_first + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = tables_ptr + seq * stride_ts
    for k0 in range(k_start, k_full, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        every = t >= 0  # all true: the whole tile is below every row's position
        k = _load_kv_tile(
            k_ptr, table_row, t, every, kv_head, stride_kn, stride_kt, stride_kh, d, d_mask, BS
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        v = _load_kv_tile(
            v_ptr, table_row, t, every, kv_head, stride_vn, stride_vt, stride_vh, d, d_mask, BS
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, PRECISION)
    for k0 in range(k_full, pos_last + 1, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        in_ctx = t <= pos_last  # [BLOCK_N]
        k = _load_kv_tile(
            k_ptr, table_row, t, in_ctx, kv_head, stride_kn, stride_kt, stride_kh, d, d_mask, BS
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        seen = t[None, :] <= pos[:, None]  # [BLOCK_M, BLOCK_N] causal
        if USE_WINDOW:
            seen = seen & (t[None, :] > pos[:, None] - window)
        s = tl.where(seen & in_ctx[None, :], s, float("-inf"))
        v = _load_kv_tile(
            v_ptr, table_row, t, in_ctx, kv_head, stride_vn, stride_vt, stride_vh, d, d_mask, BS
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (q_begin + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H_kv, D]
    v_cache: torch.Tensor,  # [N, bs, H_kv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32 (or int64)
    query_start: torch.Tensor,  # [S + 1] int32 (or int64)
    context_lens: torch.Tensor,  # [S] int32 (or int64), after this step
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    *,
    sliding_window: int | None = None,
    launch: PrefillLaunch = DEFAULT_PREFILL,
) -> None:
    """Causal varlen attention of each sequence's new tokens over its paged context."""
    n_heads, h_kv, d = _check_common(q, k_cache, v_cache, out)
    n_seqs = block_tables.shape[0]
    assert query_start.shape[0] == n_seqs + 1 == context_lens.shape[0] + 1
    assert block_tables.stride(1) == 1
    if n_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return
    g = n_heads // h_kv
    block_m = max(launch.block_m, triton.next_power_of_2(g), 16)
    block_q = block_m // g
    window = sliding_window or 0
    grid = (n_seqs, math.ceil(max_query_len / block_q), h_kv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out,
        scale * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, D=d, D_PAD=triton.next_power_of_2(d), BS=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=launch.block_n,
        USE_WINDOW=window > 0, PRECISION=_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
