"""A skinny GEMM for the decode projections: y [M, N] = x [M, K] @ W[N, K].T (+ bias) for
M <= 16 rows, in Triton.

At batch 1 a decode step is weight reads: every projection streams its [N, K] weight once
for a handful of rows. cuBLASLt reads the large ones (gate_up, down, the LM head) at ~4 TB/s
on the H200, but the mid-sized attention projections (4096 → 6144 and 4096 → 4096 in an 8B
Llama, 2048 → 5120 and 4096 → 2048 in Qwen3-30B-A3B) at 2.3-3.2 TB/s, with a split-K
reduce launch after each (docs/BENCHMARKS.md, the batch-1 profiles). This kernel is a plain
weight-streaming tile loop:

- a program owns BLOCK_N output columns (weight rows) and one strip of K; it loads the x
  rows [BLOCK_M, BLOCK_K] (a few KB, L2-resident) and the weight tile [BLOCK_N, BLOCK_K]
  (read once, evict-first) and accumulates in float32: by tl.dot with the rows padded to
  16 (`dot`: Triton pipelines those loads `stages` deep), or for one row by broadcasting
  (`dot=False`, a GEMV);
- with `split` > 1 strips of K, each program stores its float32 partial sums and bumps a
  counter of its column block; the program that arrives last adds the partials in strip
  order (so the result does not depend on which strip finished first: the same bits run to
  run), rounds once as the reference does, and resets the counter for the next call. One
  launch, no reduce kernel, no memset: the counters live in a `SkinnyWorkspace` made once
  per device (zeros; every call leaves them zero again, so CUDA-graph replays are safe).

Which projection takes it, and with which tiles, is the table of triton_linear_configs.py,
chosen in CUDA graphs on the H200 by `bench/linear.py --sweep`; shapes it does not list
stay on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._proj_tiles import acc_add, acc_sum, acc_zeros
from ds4pool.model.kernels.triton_linear_configs import MAX_GEMV_ROWS, MAX_ROWS, SkinnyConfig


class SkinnyWorkspace:
    """The split-K arrival counters of one device (int32 zeros, left zero by every call)."""

    def __init__(self, device: torch.device, slots: int = 16384) -> None:
        self.counters = torch.zeros(slots, dtype=torch.int32, device=device)


@triton.jit
def _column_block(
    x_ptr, w_ptr, cols, col_ok, rows, row_ok, k, k_lo, k_chunk, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """x [rows] @ W[cols].T over the K strip [k_lo, k_lo + k_chunk): [BLOCK_M, BLOCK_N] f32."""
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    acc = acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    for k0 in range(k_lo, k_lo + k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = tl.load(
            w_rows + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        if BLOCK_M == 1 and not USE_DOT:  # the one row (as measured for the table)
            a = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        else:
            a = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        acc = acc_add(acc, a, w, BLOCK_M, USE_DOT, PRECISION)
    return acc_sum(acc, BLOCK_M, USE_DOT)


@triton.jit(do_not_specialize=["m"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, m, n, k, k_chunk,
    stride_x, stride_w, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, BALANCED: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    k_lo = tl.multiple_of(split * k_chunk, BLOCK_K)  # the host makes strips of whole tiles
    if BALANCED:  # an equal share of the N columns, BLOCK_N at a time (no split)
        programs = tl.num_programs(0)
        lo = pid * n // programs
        hi = (pid + 1) * n // programs
        for c0 in range(lo, hi, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            acc = _column_block(
                x_ptr, w_ptr, cols, col_ok, rows, row_ok, k, k_lo, k_chunk, stride_x,
                stride_w, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION,
            )  # fmt: skip
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = y_ptr + rows[:, None] * stride_y + cols[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        acc = _column_block(
            x_ptr, w_ptr, cols, col_ok, rows, row_ok, k, k_lo, k_chunk, stride_x, stride_w,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION,
        )  # fmt: skip
        out_mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * stride_y + cols[None, :]
        if SPLIT > 1:
            part = part_ptr + rows[:, None] * n + cols[None, :]
            tl.store(part + split * BLOCK_M * n, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partials stored before the arrival is counted
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # the last strip of this column block: add them in order
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    strip = part + s * BLOCK_M * n  # .cg: from L2, where the others wrote
                    acc += tl.load(strip, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid, 0)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: a few programs, to test the shares
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS (M <= 1 for a GEMV config), unit stride along K
    weight: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None,  # [N] or None
    cfg: SkinnyConfig,
    workspace: SkinnyWorkspace | None,  # needed when cfg.split > 1
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    assert m <= (MAX_ROWS if cfg.dot else MAX_GEMV_ROWS), (m, cfg)
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    block_m = MAX_ROWS if cfg.dot else triton.next_power_of_2(m)
    col_blocks = triton.cdiv(n, cfg.block_n)
    if cfg.waves:  # a program per SM and wave, each an equal share of the columns
        col_blocks = min(col_blocks, _sm_count(x.device) * cfg.waves)
    # strips of whole BLOCK_K tiles; a last strip may be short (masked) or empty
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    if cfg.split > 1:
        assert workspace is not None and col_blocks <= workspace.counters.numel()
        part = torch.empty((cfg.split, block_m, n), dtype=torch.float32, device=x.device)
        counters = workspace.counters
    else:
        part, counters = y, y  # unused
    _skinny_kernel[(col_blocks, cfg.split)](
        x, weight, bias if bias is not None else weight, y, part, counters, m, n, k, k_chunk,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split,
        USE_DOT=cfg.dot, HAS_BIAS=bias is not None, BALANCED=cfg.waves > 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y
