"""How the MoE decode kernels' launches (triton_moe_decode.py) are shaped on the host: GEMV
or tl.dot tiles by step size, the strips of a split-K reduction, the weights' TMA boxes."""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ds4pool.model.kernels.triton_moe_route import pow2

# Steps of up to this many tokens multiply by broadcasting (a GEMV per row); above, tl.dot
# tiles of >= 16 rows (padding rows cost tensor-core time only, which decode has to spare,
# and Triton pipelines a dot loop's loads, which it does not for the GEMV's). Where the
# switch should be on a GPU: bench/moe.py --decode-gemv-tokens. On the H200 (bench/moe_layer.py,
# 2026-12-01) the GEMV read one token's 8 experts in 60.8 µs a layer (30% of the copy
# bandwidth) while the tiles read two tokens' 15.2 experts in 58.0 µs: tiles from one token.
GEMV_MAX_TOKENS = 0


def tile_shape(
    tokens: int, block_n: int, itemsize: int, gemv_max_tokens: int, block_k: int | None = None
) -> tuple[int, int, int, bool]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, tl.dot?) for a projection over `tokens` rows: GEMV tiles
    of ~4K products (wide K strips for one row, narrower as rows grow), else dot tiles;
    `block_k` (a config's) replaces the rule's K strip."""
    block_t = pow2(tokens)
    if tokens > gemv_max_tokens:
        block_t = max(16, block_t)
        rule = 128 if itemsize <= 2 and block_t <= 32 else 64
        return block_t, block_n, block_k or rule, True
    return block_t, block_n, block_k or max(16, min(256, 4096 // (block_t * block_n))), False


def weight_boxes(w: torch.Tensor, tma: bool, block_n: int, block_k: int) -> object:
    """A tensor descriptor of the [E, N, K] weights seen as [E·N, K] in [block_n, block_k]
    boxes (Hopper TMA loads, zero-filled past K), or `w` itself (pointer loads) where the
    config asks for none, the GPU has no TMA (before sm_90) or the layout cannot be
    described: TMA wants 16-byte aligned rows and a base, and boxes of at least 16 bytes.
    (On the CPU, the interpreter emulates the descriptor's loads.)"""
    e, n, k = w.shape
    size = w.element_size()
    if not tma or w.stride(0) != n * w.stride(1) or w.stride(2) != 1:
        return w
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] < 9:
        return w
    if (w.stride(1) * size) % 16 or w.data_ptr() % 16 or block_k * size < 16:
        return w
    return TensorDescriptor(w, (e * n, k), (w.stride(1), 1), (block_n, block_k))


def strips(size: int, split: int, block_k: int) -> tuple[int, int]:
    """(splits that have work, each one's strip of the reduction in whole BLOCK_Ks)."""
    chunk = triton.cdiv(triton.cdiv(size, split), block_k) * block_k
    return triton.cdiv(size, chunk), chunk
