"""A grouped GEMM for mixture-of-experts layers in Triton: rows sorted by expert times each
row's expert's weight matrix, in one launch, with no host sync (CUDA-graph capturable).

torch's grouped_mm is sync-free only for bf16 on sm90/sm100; this kernel covers the rest
(fp16, fp32, other GPUs). Shapes: R = routed rows (sorted by expert), K = input width,
N = output width, E = experts.

    out[r] = a[r] @ w[e(r)].T    a [R, K], w [E, N, K] (nn.Linear layout), out [R, N]

The row axis is cut into tiles of BLOCK_M rows that never straddle two experts: expert e's
rows [start_e, end_e) take ceil(count_e / BLOCK_M) tiles. The grid is fixed by the shapes
alone, cdiv(R, BLOCK_M) + min(E, R) tiles (an upper bound on the tiles actually needed: at
most one partial tile per expert), so it can be captured; each tile finds its expert and
first row in a small table built on the device (searchsorted over the tiles' cumulative
counts), and tiles past the last one, like experts nobody chose, read nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr,
    n, k, stride_am, stride_we, stride_wn, stride_om,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # a spare tile of the fixed grid
        return
    first = tl.load(tile_row_ptr + tile)
    end = tl.load(group_end_ptr + expert)
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < end
    col_ok = cols < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + cols[:, None] * stride_wn + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_m_for(rows: int, experts: int) -> int:
    """Tile height from the mean rows per expert: 16 (tl.dot's minimum) for decode, up to 64."""
    mean = rows // max(experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 32 else 64)


def tile_table(
    counts: torch.Tensor, num_tiles: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile → expert or -1 [num_tiles], tile → first row [num_tiles], expert → end row [E]),
    int32, computed on the device from the per-expert row counts [E]."""
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_ends = torch.cumsum(tiles, 0)
    index = torch.arange(num_tiles, device=counts.device)
    expert = torch.searchsorted(tile_ends, index, right=True)  # E: past the last tile
    valid = expert < counts.numel()
    e = expert.clamp(max=counts.numel() - 1)
    first = ends[e] - counts[e] + (index - (tile_ends[e] - tiles[e])) * block_m
    return (
        torch.where(valid, expert, -1).to(torch.int32),
        torch.where(valid, first, 0).to(torch.int32),
        ends.to(torch.int32),
    )


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """a [R, K] (rows sorted by expert, counts [E] of them each) x w [E, N, K] → [R, N]."""
    rows, k = a.shape
    experts, n, k_w = w.shape
    assert k == k_w and a.stride(1) == 1 and w.stride(2) == 1, (a.shape, w.shape)
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if rows == 0:
        return out
    block_m = block_m_for(rows, experts)
    num_tiles = triton.cdiv(rows, block_m) + min(experts, rows)
    tile_expert, tile_row, group_end = tile_table(counts, num_tiles, block_m)
    block_n, block_k = 64, 64
    _grouped_gemm_kernel[(num_tiles, triton.cdiv(n, block_n))](
        a, w, out, tile_expert, tile_row, group_end,
        n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
