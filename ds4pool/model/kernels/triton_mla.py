"""Triton paged decode of multi-head latent attention (DeepSeek-V2/V3), absorbed form.

One layer's latent cache is [N, bs, 1, R + r] (KVLayout kind "mla", model/attention_mla.py):
per token [ c (kv_lora_rank R) | k_rot (qk_rope_head_dim r) ]. Every query head attends
over that one latent, as multi-query attention whose keys and values share memory:

    s[h, t] = (q_abs[h, :R] · c[t] + q_rot[h] · k_rot[t]) * scale      (scale incl. yarn mscale)
    out[h]  = Σ_t softmax_t(s[h]) c[t]                                   [R]

Grid (ceil(H / BLOCK_H), B, P): a program owns BLOCK_H heads of one row and one partition of
its keys, and reads each latent tile [BLOCK_N, R + r] once for both dots and the value sum
(tl.dot on tensor cores, fp32 online softmax). The head block is the fastest grid axis, so the
programs that share a row's latent run side by side and its re-reads hit L2; DeepSeek-V3-small's
16 heads are one block (the latent is read from HBM once per row).

Split-K and batch invariance follow the dense decode kernel (kernels/triton_attention.py,
partition-size mode): P = ceil(table width / partition_size) partitions of `partition_size`
keys, a row of at most `short_context` keys stays one piece whatever the table width (so its
result does not depend on the rows beside it), partitions past a row's context exit at once,
and with P > 1 the dense `decode_reduce_kernel` combines the [B, H, P, R] fp32 partials by
their log-sum-exp. Grids and scratch come from shapes only (CUDA-graph safe, no host sync);
rows of context 0 (graph padding) come out as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._decode_kernels import decode_reduce_kernel
from ds4pool.model.kernels._tiles import load_kv_tile, softmax_step
from ds4pool.model.kernels.triton_attention import (
    _LOG2E,
    DecodeWorkspace,
    _precision,
    decode_num_partitions,
)


@dataclass(frozen=True)
class MLADecodeLaunch:
    """BLOCK_H heads x BLOCK_N keys a tile (partition sizes must be multiples of block_n).
    At DeepSeek-V3's R = 512 the fp32 accumulator [BLOCK_H, R] and a [BLOCK_N, R + r] latent
    tile take 133 registers a thread at 8 warps for 16 x 32 (sm_90, no spills), 254 at 4
    (tests/unit/test_triton_compile_mla.py)."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2


DEFAULT_MLA_DECODE = MLADecodeLaunch()


# The partition size comes from the batch and the table width (TritonMLAAttention's
# partition_size): a run-time value, not a constexpr, or every eager step of a new shape
# compiled a kernel (tests/unit/test_triton_variants.py).
@triton.jit(do_not_specialize=["stride_tb", "num_parts", "partition"])
def mla_decode_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_cn,
    stride_ct,
    stride_tb,
    stride_ob,
    stride_oh,
    num_parts,
    partition,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SHORT: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    # partition p covers [p * length, (p + 1) * length): the bounds decode_reduce_kernel uses
    length = partition
    if SHORT > 0:  # a short row is one piece whatever the table width: batched == solo
        if ctx <= SHORT:
            length = SHORT
    p_start = part * length
    p_end = tl.minimum(p_start + length, ctx)
    if SPLIT:
        # the reduce skips these partitions by the same test; with one partition the program
        # owns the output row and writes zeros for an empty context instead
        if p_end <= p_start:
            return

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_mask = heads < H
    dc = tl.arange(0, R_PAD)
    dc_mask = dc < R
    dr = tl.arange(0, ROPE_PAD)
    dr_mask = dr < ROPE
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + dc[None, :], mask=h_mask[:, None] & dc_mask[None, :], other=0.0)
    q_r = tl.load(q_row + R + dr[None, :], mask=h_mask[:, None] & dr_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    table_row = tables_ptr + b * stride_tb
    for t0 in range(p_start, p_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < p_end  # [BLOCK_N]
        # the latent tile, keys and values at once: [BLOCK_N, R_PAD] and its rope tail
        c = load_kv_tile(
            cache_ptr, table_row, t, valid, 0, stride_cn, stride_ct, 0, dc, dc_mask, BS
        )
        kr = load_kv_tile(
            cache_ptr + R, table_row, t, valid, 0, stride_cn, stride_ct, 0, dr, dr_mask, BS
        )
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.dot(q_r, tl.trans(kr), acc=s, input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, c, PRECISION)

    if not SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dc[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dc_mask[None, :])
    else:
        # every tile saw >= 1 visible key (padding heads too: their q is 0), so l_i > 0
        o = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)  # [BLOCK_H], log2 units
        slot = (b * H + heads) * num_parts + part  # [BLOCK_H] into [B, H, P]
        o_mask = h_mask[:, None] & dc_mask[None, :]
        tl.store(part_out_ptr + slot[:, None] * R + dc[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + slot, lse, mask=h_mask)


def mla_decode(
    q: torch.Tensor,  # [B, H, R + r] absorbed queries
    cache: torch.Tensor,  # [N, bs, 1, R + r] one layer's latent plane
    block_tables: torch.Tensor,  # [B, max_blocks] int32 or int64
    context_lens: torch.Tensor,  # [B] int32 or int64, incl. the query's own token
    scale: float,
    out: torch.Tensor,  # [B, H, R], written in place
    *,
    partition_size: int,
    short_context: int = 0,
    launch: MLADecodeLaunch = DEFAULT_MLA_DECODE,
    workspace: DecodeWorkspace | None = None,
) -> None:
    """Latent attention of one query token per row over its paged context (split-K).

    The context splits into pieces of `partition_size` keys, P = ceil(max_blocks * bs /
    partition_size) programs per head block; a row of at most `short_context` keys (0: none)
    is one piece whatever the table width. `workspace`, if given, holds the partials
    ([>= B, H, P, R] and [>= B, H, P] fp32); else they are allocated here when P > 1.
    """
    batch, heads, dim = q.shape
    r_dim = out.shape[-1]
    n_blocks, bs, one, d_cache = cache.shape
    assert one == 1 and d_cache == dim and 0 < r_dim < dim, (q.shape, cache.shape, out.shape)
    assert out.shape == (batch, heads, r_dim) and out.dtype == q.dtype == cache.dtype
    assert q.stride(-1) == out.stride(-1) == cache.stride(-1) == 1
    assert block_tables.shape[0] == batch == context_lens.shape[0], (block_tables.shape, batch)
    assert block_tables.stride(1) == 1 and context_lens.stride(0) == 1
    assert partition_size % launch.block_n == 0, (partition_size, launch.block_n)
    if batch == 0:
        return
    short = short_context if short_context > partition_size else 0
    assert short % launch.block_n == 0, (short, launch.block_n)
    num_parts = decode_num_partitions(block_tables.shape[1], bs, partition_size)
    if workspace is None and num_parts > 1:
        workspace = DecodeWorkspace(
            torch.empty((batch, heads, num_parts, r_dim), dtype=torch.float32, device=q.device),
            torch.empty((batch, heads, num_parts), dtype=torch.float32, device=q.device),
        )
    if workspace is not None:
        assert workspace.partial_out.shape[1:] == (heads, num_parts, r_dim)
        assert workspace.partial_out.shape[0] >= batch and workspace.partial_out.is_contiguous()
        assert workspace.partial_lse.shape[1:] == (heads, num_parts)
        assert workspace.partial_lse.is_contiguous()
    part_out = workspace.partial_out if workspace is not None else out
    part_lse = workspace.partial_lse if workspace is not None else out
    block_h = min(launch.block_h, max(16, triton.next_power_of_2(heads)))
    r_pad = max(16, triton.next_power_of_2(r_dim))
    grid = (triton.cdiv(heads, block_h), batch, num_parts)
    mla_decode_kernel[grid](
        q, cache, block_tables, context_lens, out, part_out, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_parts, partition_size,
        H=heads, BLOCK_H=block_h, R=r_dim, R_PAD=r_pad,
        ROPE=dim - r_dim, ROPE_PAD=max(16, triton.next_power_of_2(dim - r_dim)), BS=bs,
        BLOCK_N=launch.block_n, SHORT=short, SPLIT=num_parts > 1,
        PRECISION=_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_parts == 1:
        return
    decode_reduce_kernel[(batch, heads)](
        part_out, part_lse, context_lens, out, 0, out.stride(0), out.stride(1), num_parts,
        partition_size, short or partition_size,
        H=heads, D=r_dim, D_PAD=r_pad, SHORT=short,
        BLOCK_N=launch.block_n, FIXED_P=False, P_CHUNK=16, USE_WINDOW=False,
        DIRECT=False, num_warps=4,
    )  # fmt: skip
