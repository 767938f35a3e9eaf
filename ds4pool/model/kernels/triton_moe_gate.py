"""The residual add, the RMSNorm before a sparse MLP and its router's linear in one launch.

    a [T, H], residual [T, H] → residual' = residual + a, h = norm(residual'),
                                logits = h @ router_weight^T   [T, E]

On the decode path of a sparse layer (model/moe.py, SparseMoeBlock.decode_layer) these were
two launches: the fused add + RMSNorm (triton_fused.rms_norm) and cuBLAS's GEMM for the router
(a [1, 2048] x [2048, 128] product that cuBLAS runs on two thread blocks: ~5 µs on the H200 at
batch 1, for 0.5 MB of weights). Here a program owns one token row and BLOCK_E experts (grid
(ceil(E / BLOCK_E), T), a function of the shapes only, so a CUDA graph captures it): it
recomputes the row's add and norm (a few KB, from L2) and dots it with its experts' weight rows.
The programs of expert block 0 store residual' and h.

Numerics are the two launches': the add in the activation dtype, the norm in float32 with the
normalised row cast to the activation dtype before the weight multiply (as triton_fused's
kernel), the logits accumulated in float32 from the stored h and rounded to the activation
dtype (F.linear's output). Only the order of the logits' sum differs from cuBLAS's; it is fixed
per row, so a row's logits do not depend on the other rows of the step (batched == solo).
residual' is a new tensor, not `residual` updated in place: other programs of the row still
read the old one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._pdl import launch_options, pdl_trigger, pdl_wait
from ds4pool.model.kernels.triton_fused import normalised_row

# Experts a program dots, and its warps: ONE launch for every T, because they set how a row's
# logits are summed (the tile's layout), and a row must get the same bits alone or in a batch.
# From `python3 bench/moe_gate.py --tokens 1 8 64` on the H200 (2026-12-02, µs a layer for
# Qwen3-30B-A3B's 2048 x 128 router at T = 1 / 8 / 64; the two launches 7.06 / 7.38 / 7.53):
# 8 x 4 warps 2.78 / 3.05 / 6.87, faster at every T; 2 x 8 (2.43 / 2.92 / 11.91) and 4 x 8
# (2.48 / 2.85 / 8.70) win at batch 1 but lose at 64, 16 x 4 (3.33 / 3.36 / 6.54) the reverse.
BLOCK_E = 8
NUM_WARPS = 4


@triton.jit
def _norm_logits_kernel(
    a_ptr, res_ptr, nw_ptr, rw_ptr, res_out_ptr, h_ptr, logits_ptr, n, e, eps,
    stride_a, stride_r, stride_ro, stride_h, stride_w, stride_l,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_trigger(PDL)  # (kernels/_pdl.py)
    block = tl.program_id(0)
    row = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    c_ok = cols < n
    es = block * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = es < e
    w = tl.load(  # first: its latency overlaps the row's loads and norm
        rw_ptr + es[:, None] * stride_w + cols[None, :],
        mask=e_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    pdl_wait(PDL)  # the router's weights before it, the row (the attention's output) after
    x = tl.load(a_ptr + row * stride_a + cols, mask=c_ok, other=0.0)
    x = x + tl.load(res_ptr + row * stride_r + cols, mask=c_ok, other=0.0)
    nw = tl.load(nw_ptr + cols, mask=c_ok, other=0.0)
    y = normalised_row(x, nw, n, eps).to(h_ptr.dtype.element_ty)
    mine = cols < tl.where(block == 0, n, 0)  # expert block 0 stores the row
    tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mine)
    tl.store(h_ptr + row * stride_h + cols, y, mask=mine)
    logits = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + row * stride_l + es, logits.to(logits_ptr.dtype.element_ty), mask=e_ok)


def add_norm_logits(
    a: torch.Tensor,  # [T, H] (rows may be strided)
    residual: torch.Tensor,  # [T, H], not modified
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    router_weight: torch.Tensor,  # [E, H]
    block_e: int = 0,  # 0: BLOCK_E (bench/moe_gate.py times others)
    num_warps: int = 0,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/_pdl.py)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(residual + a, rms_norm(residual + a), logits [T, E]), all in a's dtype."""
    t, n = a.shape
    e = router_weight.shape[0]
    if residual.shape != a.shape or router_weight.shape[1] != n or norm_weight.shape != (n,):
        raise ValueError(
            f"shapes do not fit: a {tuple(a.shape)}, residual {tuple(residual.shape)}, "
            f"norm {tuple(norm_weight.shape)}, router {tuple(router_weight.shape)}"
        )
    res_out = torch.empty((t, n), dtype=a.dtype, device=a.device)
    h = torch.empty((t, n), dtype=a.dtype, device=a.device)
    logits = torch.empty((t, e), dtype=a.dtype, device=a.device)
    if t == 0:
        return res_out, h, logits
    if router_weight.stride(1) != 1:
        router_weight = router_weight.contiguous()
    block_h = triton.next_power_of_2(n)
    block_e, num_warps = block_e or BLOCK_E, num_warps or NUM_WARPS
    _norm_logits_kernel[(triton.cdiv(e, block_e), t)](
        a, residual, norm_weight, router_weight, res_out, h, logits, n, e, eps,
        a.stride(0), residual.stride(0), res_out.stride(0), h.stride(0),
        router_weight.stride(0), logits.stride(0),
        BLOCK_H=block_h, BLOCK_E=block_e, PDL=pdl, num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return res_out, h, logits
