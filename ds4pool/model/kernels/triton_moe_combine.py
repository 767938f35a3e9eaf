"""The last launch of the MoE decode path (triton_moe_decode.py): each token's weighted sum
of its k experts' outputs, float32 in slot order (as moe._combine), from their rows or from
the down projection's split-K partials.

With `residual` it is also the decoder layer's next step, the residual add and the next
RMSNorm (what TritonOps.add_rms_norm would do in a launch of its own): one program a token
holds the whole row, so the norm sees it without another pass. Numerics are the unfused
pair's: the sum cast to the activation dtype, added to the residual in that dtype, the norm
in float32 (triton_fused.rms_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._pdl import launch_options, pdl_trigger, pdl_wait


@triton.jit
def _combine_kernel(
    y_ptr, ypart_ptr, weights_ptr, out_ptr, res_ptr, norm_ptr, hidden, eps,
    stride_y, stride_ys, stride_yr, stride_o, stride_r,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_trigger(PDL)  # (kernels/_pdl.py)
    pdl_wait(PDL)
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < hidden
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, as moe._combine
        w = tl.load(weights_ptr + tok * TOP_K + j)
        pair = (tok * TOP_K + j).to(tl.int64)
        if SPLIT > 1:  # the down's partial sums in split order, rounded as its output
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                y += tl.load(
                    ypart_ptr + s * stride_ys + pair * stride_yr + cols, mask=ok, other=0.0
                )
            y = y.to(dt).to(tl.float32)
        else:
            y = tl.load(y_ptr + pair * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        acc += w * y
    out = out_ptr + tok.to(tl.int64) * stride_o + cols
    if NORM:  # BLOCK_N covers the row: residual += sum, then the RMSNorm of it
        row = res_ptr + tok.to(tl.int64) * stride_r + cols
        x = acc.to(dt) + tl.load(row, mask=ok, other=0.0)
        tl.store(row, x, mask=ok)
        h = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        nw = tl.load(norm_ptr + cols, mask=ok, other=0.0)
        tl.store(out, ((h * inv).to(dt) * nw).to(dt), mask=ok)
    else:
        tl.store(out, acc.to(dt), mask=ok)


def combine(
    y: torch.Tensor,  # [R, H] expert rows (R = T·k), or [S, R, H] float32 split-K partials
    weights: torch.Tensor,  # [T, k] float32, contiguous
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [T, H]: updated in place, the norm's input
    norm_weight: torch.Tensor | None = None,  # [H], with residual
    eps: float = 0.0,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/_pdl.py)
) -> torch.Tensor:
    """[T, H]: Σ_j weights[t, j] · y[t·k + j]; with `residual`, residual += that and the
    result is RMSNorm(residual) by `norm_weight`."""
    t, k = weights.shape
    split = y.shape[0] if y.dim() == 3 else 1
    hidden = y.shape[-1]
    out = torch.empty((t, hidden), dtype=dtype, device=y.device)
    if t == 0:
        return out
    norm = residual is not None
    if residual is not None:
        assert norm_weight is not None and residual.shape == (t, hidden), residual.shape
        assert residual.stride(1) == 1
    res = residual if residual is not None else out  # unread without the norm
    nw = norm_weight if norm_weight is not None else weights
    block = triton.next_power_of_2(hidden) if norm else 256
    ys, yr = (y.stride(0), y.stride(1)) if split > 1 else (0, 0)
    _combine_kernel[(t, triton.cdiv(hidden, block))](
        y, y, weights, out, res, nw, hidden, eps, y.stride(-2), ys, yr, out.stride(0),
        res.stride(0), TOP_K=k, BLOCK_N=block, SPLIT=split, NORM=norm,
        PDL=pdl, num_warps=(4 if block <= 2048 else 8) if norm else 4, **launch_options(pdl),
    )  # fmt: skip
    return out
