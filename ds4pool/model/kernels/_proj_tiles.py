"""Tile helpers of the projection kernels: x rows @ W tile.T accumulated along K, shared by
the skinny decode GEMM (triton_linear.py) and the MoE decode kernels (triton_moe_decode.py).

Three accumulators by tile kind, chosen by constexprs: tl.dot tiles ([ROWS, BLOCK_N], rows
padded to 16), the broadcast GEMV of a few rows (products summed along K every tile), and
the GEMV of one row, whose accumulator is the products themselves ([BLOCK_N, BLOCK_K]),
summed along K once after the loop instead of a reduction across threads every tile.
Usage: acc = acc_zeros(...); per K tile acc = acc_add(acc, a, w, ...); acc_sum(acc, ...).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_times_w(a, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [ROWS, BLOCK_K] x w [BLOCK_N, BLOCK_K] → [ROWS, BLOCK_N] float32."""
    if USE_DOT:
        return tl.dot(a, tl.trans(w), input_precision=PRECISION)
    return tl.sum(a[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)


@triton.jit
def acc_zeros(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              USE_DOT: tl.constexpr):  # fmt: skip
    """A projection's float32 accumulator: [ROWS, BLOCK_N], or [BLOCK_N, BLOCK_K] products
    for the GEMV of one row."""
    # (one return: the compiler types every return statement, taken or not)
    if USE_DOT or ROWS > 1:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@triton.jit
def acc_add(acc, a, w, ROWS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc plus a [ROWS, BLOCK_K] x w [BLOCK_N, BLOCK_K] (the tile at one K offset)."""
    if USE_DOT or ROWS > 1:
        acc = acc + rows_times_w(a, w, USE_DOT, PRECISION)
    else:
        acc = acc + w.to(tl.float32) * a.to(tl.float32)  # a [1, BLOCK_K] over the tile's rows
    return acc


@triton.jit
def acc_sum(acc, ROWS: tl.constexpr, USE_DOT: tl.constexpr):
    """The accumulator as [ROWS, BLOCK_N] sums."""
    if not USE_DOT and ROWS == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    return acc
