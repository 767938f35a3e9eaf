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

Two fusions remove the small launches around a projection:

- `act=True` (a prologue): x is the gate_up output [M, 2K] and every x tile is
  silu(gate) * up computed as it is loaded, as triton_fused.silu_mul computes it, to the
  bit (the down projection's silu·mul launch);
- `add_norm` (an epilogue): after storing its columns each program bumps one arrival
  counter; the program that arrives last adds the whole output rows into the residual
  stream (in place) and normalises them as triton_fused.rms_norm does (the add + RMSNorm
  launch after o_proj and down). The normalised rows are the call's result. That last
  program is a serial tail of a memory round trip or two a row.

TritonOps fuses both for steps of one row only (FUSE_MAX_ROWS: at 2-8 rows on the H200 they
made a step 1.6-6 ms slower).

Which projection takes it, and with which tiles, is the table of triton_linear_configs.py,
chosen in CUDA graphs on the H200 by `bench/linear.py --sweep`; shapes it does not list
stay on cuBLAS.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._pdl import launch_options, pdl_trigger, pdl_wait
from ds4pool.model.kernels._proj_tiles import acc_add, acc_sum, acc_zeros
from ds4pool.model.kernels.triton_fused import normalised_row, scaled_row
from ds4pool.model.kernels.triton_linear_configs import MAX_GEMV_ROWS, MAX_ROWS, SkinnyConfig

NORM_BLOCK = 8192  # the add + norm epilogue's widest row loaded at once (more: in pieces)


class SkinnyWorkspace:
    """The arrival counters of one device (int32 zeros, left zero by every call): split-K's
    per column block, and the add + norm epilogue's one for the whole launch."""

    def __init__(self, device: torch.device, slots: int = 16384) -> None:
        self.counters = torch.zeros(slots, dtype=torch.int32, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True)
class AddNorm:
    """The epilogue's operands: residual [M, N] (updated in place: residual += y) and the
    RMSNorm's weight [N] and eps; the call returns norm(residual + y)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


@triton.jit
def _x_tile(x_ptr, rows, row_ok, ks, k_ok, k, stride_x, ONE_ROW: tl.constexpr,
            ACT: tl.constexpr):  # fmt: skip
    """The x rows at K offsets `ks`: [1, BLOCK_K] float32 for the one-row GEMV, else
    [BLOCK_M, BLOCK_K] in x's dtype; with ACT, silu(gate) * up of x = [gate | up] (up at
    column offset k)."""
    if ONE_ROW:
        a = _act(x_ptr + ks, k, k_ok, ACT).to(tl.float32)[None, :]
    else:
        offs = rows[:, None] * stride_x + ks[None, :]
        a = _act(x_ptr + offs, k, row_ok[:, None] & k_ok[None, :], ACT)
    return a


@triton.jit
def _act(ptrs, k, mask, ACT: tl.constexpr):
    """x at ptrs, or with ACT silu(gate) * up of gate at ptrs and up k further, rounded as
    triton_fused._silu_mul_kernel rounds it (silu in float32, cast, then times up)."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    if ACT:
        up = tl.load(ptrs + k, mask=mask, other=0.0)
        g = a.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(a.dtype) * up
    return a


@triton.jit
def _column_block(
    x_ptr, w_ptr, cols, col_ok, rows, row_ok, k, k_lo, k_chunk, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """x [rows] @ W[cols].T over the K strip [k_lo, k_lo + k_chunk): [BLOCK_M, BLOCK_N] f32.
    With PDL the strip's first weight tile is loaded before the wait (kernels/_pdl.py:
    weights are no earlier kernel's output), x and the rest after it (a strip is >= one
    tile); the same products in the same order either way."""
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    acc = acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    # (the one row as measured for the table: a [1, BLOCK_K] float32 broadcast)
    one_row: tl.constexpr = BLOCK_M == 1 and not USE_DOT
    k_first = k_lo
    if PDL:
        ks = k_lo + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = _w_tile(w_rows, ks, col_ok, k_ok)
        pdl_wait(PDL)
        a = _x_tile(x_ptr, rows, row_ok, ks, k_ok, k, stride_x, one_row, ACT)
        acc = acc_add(acc, a, w, BLOCK_M, USE_DOT, PRECISION)
        k_first += BLOCK_K
    for k0 in range(k_first, k_lo + k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = _w_tile(w_rows, ks, col_ok, k_ok)
        a = _x_tile(x_ptr, rows, row_ok, ks, k_ok, k, stride_x, one_row, ACT)
        acc = acc_add(acc, a, w, BLOCK_M, USE_DOT, PRECISION)
    return acc_sum(acc, BLOCK_M, USE_DOT)


@triton.jit
def _w_tile(w_rows, ks, col_ok, k_ok):
    """The weight tile [BLOCK_N, BLOCK_K] at K offsets `ks`, read once (evict-first)."""
    return tl.load(
        w_rows + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit
def _add_norm_rows(
    y_ptr, res_ptr, nw_ptr, h_ptr, done_ptr, m, n, eps, stride_y, stride_r, stride_h,
    NORM_BLOCK: tl.constexpr,
):  # fmt: skip
    """Called by every program after its last store of y: the one that arrives last does
    residual += y and h = norm(residual) for the whole rows, and leaves the counter at
    zero. A row of <= NORM_BLOCK columns is loaded at once (one memory round trip: this
    is the launch's serial tail); wider ones NORM_BLOCK columns at a time, the squares
    summed in pieces, so h may differ from triton_fused.rms_norm's by a rounding of the
    last step (the residual is the same bits either way)."""
    tl.debug_barrier()  # every thread's stores of y made before the arrival is counted
    arrived = tl.atomic_add(done_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for r in range(m):
            if n <= NORM_BLOCK:
                cols = tl.arange(0, NORM_BLOCK)
                mask = cols < n
                w = tl.load(nw_ptr + cols, mask=mask, other=0.0)
                # .cg: from L2, where the other programs stored their columns
                y = tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0,
                            cache_modifier=".cg")  # fmt: skip
                x = y + tl.load(res_ptr + r * stride_r + cols, mask=mask, other=0.0)
                tl.store(res_ptr + r * stride_r + cols, x, mask=mask)
                h = normalised_row(x, w, n, eps)
                tl.store(h_ptr + r * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
            else:
                _add_norm_pieces(y_ptr + r * stride_y, res_ptr + r * stride_r, nw_ptr,
                                 h_ptr + r * stride_h, n, eps, NORM_BLOCK)  # fmt: skip
        tl.atomic_xchg(done_ptr, 0)


@triton.jit
def _add_norm_pieces(y_ptr, res_ptr, nw_ptr, h_ptr, n, eps, NORM_BLOCK: tl.constexpr):
    """One row of more than NORM_BLOCK columns: add and sum the squares a piece at a time,
    then normalise a piece at a time."""
    ss = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
    for c0 in range(0, n, NORM_BLOCK):
        cols = c0 + tl.arange(0, NORM_BLOCK)
        mask = cols < n
        y = tl.load(y_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
        x = y + tl.load(res_ptr + cols, mask=mask, other=0.0)
        tl.store(res_ptr + cols, x, mask=mask)
        xf = x.to(tl.float32)
        ss += xf * xf
    inv = tl.rsqrt(tl.sum(ss, axis=0) / n + eps)
    tl.debug_barrier()  # the stream's row stored before it is read back
    for c0 in range(0, n, NORM_BLOCK):
        cols = c0 + tl.arange(0, NORM_BLOCK)
        mask = cols < n
        x = tl.load(res_ptr + cols, mask=mask, other=0.0)
        w = tl.load(nw_ptr + cols, mask=mask, other=0.0)
        h = scaled_row(x, inv, w)
        tl.store(h_ptr + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["m"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, res_ptr, nw_ptr, h_ptr, done_ptr,
    m, n, k, k_chunk, eps, stride_x, stride_w, stride_y, stride_r, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, BALANCED: tl.constexpr,
    PRECISION: tl.constexpr, ACT: tl.constexpr, ADD_NORM: tl.constexpr,
    NORM_BLOCK: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False,
):  # fmt: skip
    pdl_trigger(PDL or TRIGGER)  # (kernels/_pdl.py: the next kernel may start its loads)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    k_lo = tl.multiple_of(split * k_chunk, BLOCK_K)  # the host makes strips of whole tiles
    stored = True  # whether this program stored its share of y (split-K: its last strip)
    if BALANCED:  # an equal share of the N columns, BLOCK_N at a time (no split)
        programs = tl.num_programs(0)
        lo = pid * n // programs
        hi = (pid + 1) * n // programs
        for c0 in range(lo, hi, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            acc = _column_block(
                x_ptr, w_ptr, cols, col_ok, rows, row_ok, k, k_lo, k_chunk, stride_x,
                stride_w, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION, ACT, PDL,
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
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION, ACT, PDL,
        )  # fmt: skip
        out_mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * stride_y + cols[None, :]
        if SPLIT > 1:
            part = part_ptr + rows[:, None] * n + cols[None, :]
            tl.store(part + split * BLOCK_M * n, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partials stored before the arrival is counted
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            stored = arrived == SPLIT - 1
            if stored:  # the last strip of this column block: add them in order
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
    if ADD_NORM:
        pdl_wait(PDL)  # (a balanced program with no columns did not wait above)
        if stored:
            _add_norm_rows(
                y_ptr, res_ptr, nw_ptr, h_ptr, done_ptr, m, n, eps, stride_y, stride_r,
                stride_h, NORM_BLOCK,
            )  # fmt: skip


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: a few programs, to test the shares
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_linear(
    x: torch.Tensor,  # [M, K] (act: [M, 2K] gate | up), M <= MAX_ROWS (<= 4: GEMV), unit stride
    weight: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None,  # [N] or None
    cfg: SkinnyConfig,
    workspace: SkinnyWorkspace | None,  # needed when cfg.split > 1 or with add_norm
    act: bool = False,  # x is [gate | up]: project silu(gate) * up
    add_norm: AddNorm | None = None,  # then residual += y; the result is norm(residual)
    norm_block: int = NORM_BLOCK,  # the epilogue's widest row at once (tests: smaller)
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/_pdl.py)
    trigger: bool = False,  # launched or not, let the next kernel start early (pdl does too)
) -> torch.Tensor:
    """y = x @ W.T (+ bias) [M, N]; with `add_norm`, norm(residual + y) [M, N] (and the
    residual updated in place)."""
    m = x.shape[0]
    n, k = weight.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if add_norm is not None else y
    if m == 0:
        return h
    assert m <= (MAX_ROWS if cfg.dot else MAX_GEMV_ROWS), (m, cfg)
    assert x.shape[1] == (2 * k if act else k), (x.shape, weight.shape, act)
    assert weight.stride(1) == 1 and x.stride(1) == 1
    block_m = MAX_ROWS if cfg.dot else triton.next_power_of_2(m)
    col_blocks = triton.cdiv(n, cfg.block_n)
    if cfg.waves:  # a program per SM and wave, each an equal share of the columns
        col_blocks = min(col_blocks, _sm_count(x.device) * cfg.waves)
    # strips of whole BLOCK_K tiles; a last strip may be short (masked) or empty
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    if cfg.split > 1 or add_norm is not None:
        assert workspace is not None
    if cfg.split > 1:
        assert col_blocks <= workspace.counters.numel()
        part = torch.empty((cfg.split, block_m, n), dtype=torch.float32, device=x.device)
        counters = workspace.counters
    else:
        part, counters = y, y  # unused
    if add_norm is not None:
        res, nw, done, eps = add_norm.residual, add_norm.weight, workspace.done, add_norm.eps
        assert res.shape == (m, n) and res.stride(1) == 1 and nw.shape == (n,), (res.shape, n)
    else:
        res, nw, done, eps = y, y, y, 0.0  # unused
    _skinny_kernel[(col_blocks, cfg.split)](
        x, weight, bias if bias is not None else weight, y, part, counters, res, nw, h, done,
        m, n, k, k_chunk, eps, x.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        h.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split,
        USE_DOT=cfg.dot, HAS_BIAS=bias is not None, BALANCED=cfg.waves > 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ACT=act,
        ADD_NORM=add_norm is not None, NORM_BLOCK=min(triton.next_power_of_2(n), norm_block),
        PDL=pdl, TRIGGER=trigger, num_warps=cfg.warps, num_stages=cfg.stages,
        **launch_options(pdl),
    )  # fmt: skip
    return h
