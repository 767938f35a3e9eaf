"""The CUDA attention backend: Triton paged-attention kernels over the block tables.

Decode-only steps (one query per sequence) use the split-K decode kernel; every other step
(prompt chunks, mixed with decodes) uses the varlen prefill kernel, which reads the cached
prefix from the blocks in place. K/V are written by slot mapping (one index_copy_ per
tensor) before either kernel runs. Both kernels size their grids from tensor shapes only,
so a decode step over persistent buffers can be captured in a CUDA graph
(ds4pool/model/cuda_graphs.py) and replayed with new values.
"""

from __future__ import annotations

import torch

from ds4pool.model.attention import AttentionMetadata, write_kv


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonPagedAttention:
    name = "triton"
    supports_cuda_graphs = True
    index_dtype = torch.int32

    def __init__(self) -> None:
        from ds4pool.model.kernels import triton_attention

        self._k = triton_attention

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: torch.Tensor,  # [2, N + 1, bs, H_kv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        write_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode_only:
            self._k.paged_decode(
                q,
                cache[0],
                cache[1],
                meta.block_tables,
                meta.context_lens,
                scale,
                out,
                sliding_window=meta.sliding_window,
            )
        else:
            assert meta.query_start is not None
            self._k.paged_prefill(
                q,
                cache[0],
                cache[1],
                meta.block_tables,
                meta.query_start,
                meta.context_lens,
                meta.max_query_len,
                scale,
                out,
                sliding_window=meta.sliding_window,
            )
        return out
