"""Greedy decoding's argmax over the vocabulary, in one launch of many programs.

torch's argmax of one [1, 128256] row runs as a reduction of few blocks, ~28 µs of a
Llama-3-8B batch-1 step on the H200 (docs/BENCHMARKS.md, the session-25 profile) for 0.5 MB
of logits. Here a row is cut into BLOCK-wide chunks, one program each (all rows at once:
grid [rows, chunks]); each stores its chunk's maximum and first index of it, bumps its
row's arrival counter, and the program that arrives last combines the row's chunks in
chunk order. The result is torch.argmax's exactly, whatever the batch: the first index of
the maximum, NaN counting as larger than every number (its first index wins), a row of
-inf giving 0. The counters live in an `ArgmaxWorkspace` and every call leaves them zero
(CUDA-graph replays are safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # a program's logits: 16 KB of float32


class ArgmaxWorkspace:
    """The per-row arrival counters of one device (int32 zeros, left zero by every call)."""

    def __init__(self, device: torch.device, rows: int = 4096) -> None:
        self.counters = torch.zeros(rows, dtype=torch.int32, device=device)


@triton.jit
def _argmax_kernel(
    x_ptr, val_ptr, nan_ptr, idx_ptr, cnt_ptr, out_ptr, n, stride_x,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=float("-inf"))
    v = v.to(tl.float32)
    big = 2147483647
    is_nan = (v != v) & ok
    has_nan = tl.max(is_nan.to(tl.int32), axis=0)
    best = tl.max(tl.where(is_nan, float("-inf"), v), axis=0)
    # the first NaN if any, else the first index of the maximum (masked lanes never win:
    # a chunk has a valid lane below every masked one, and a -inf maximum takes the first)
    first = tl.where(has_nan > 0, is_nan, (v == best) & ok)
    index = tl.min(tl.where(first, offs, big), axis=0)
    slot = row * chunks + chunk
    tl.store(val_ptr + slot, best)
    tl.store(nan_ptr + slot, has_nan)
    tl.store(idx_ptr + slot, index)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if arrived == chunks - 1:  # the row's last chunk: combine them in chunk order
        cs = tl.arange(0, CHUNKS_PAD)
        live = cs < chunks
        base = row * chunks + cs  # .cg: from L2, where the others stored
        vals = tl.load(val_ptr + base, mask=live, other=float("-inf"), cache_modifier=".cg")
        nans = tl.load(nan_ptr + base, mask=live, other=0, cache_modifier=".cg")
        idxs = tl.load(idx_ptr + base, mask=live, other=big, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        pick = tl.where(tl.max(nans, axis=0) > 0, nans > 0, (vals == top) & live)
        tl.store(out_ptr + row, tl.min(tl.where(pick, idxs, big), axis=0).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0)


def argmax_rows(x: torch.Tensor, workspace: ArgmaxWorkspace, block: int = BLOCK) -> torch.Tensor:
    """x [B, V] (float, unit stride along V) → argmax along V [B] int64, as torch.argmax."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    assert x.stride(1) == 1 and rows <= workspace.counters.numel() and n > 0
    chunks = triton.cdiv(n, block)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    nans = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    idxs = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _argmax_kernel[(rows, chunks)](
        x, vals, nans, idxs, workspace.counters, out, n, x.stride(0),
        BLOCK=block, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=4,
    )  # fmt: skip
    return out
