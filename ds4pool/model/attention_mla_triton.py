"""The CUDA backend of multi-head latent attention: decode rows on the Triton paged MLA kernel
(kernels/triton_mla.py), prompt chunks on the torch reference (attention_mla.py).

Decode rows are the hot path (one query per sequence, memory bound: the cost is reading the
latent once); the kernel reads it in place through the block tables, where the reference
gathers every row's padded context into a copy. Prompt chunks that stay absorbed are short
(model/mla.py lifts longer ones to per-head K/V), and run the reference's SDPA per chunk.

A decode-only step launches one kernel over all rows of the metadata, with grids and the
split-K partition from shapes only (table width, batch), so it can be captured in CUDA graphs
over persistent buffers and replayed with new values. Mixed steps (decode rows beside prompt
chunks) read host lists (`meta.prefills`) and are not captured: like the reference this
backend has no `graph_prefill_partitions`, so the runner builds decode graphs only.
"""

from __future__ import annotations

import torch

from ds4pool.model.attention import AttentionMetadata, PrefillSlice
from ds4pool.model.attention_mla import TorchMLAAttention, write_latent
from ds4pool.model.attention_triton import decode_partition_size


class TritonMLAAttention:
    name = "triton-mla"
    supports_cuda_graphs = True
    index_dtype = torch.int64  # the tables also index the cache in the reference prefill path

    def __init__(self, num_sms: int | None = None) -> None:
        """`num_sms`: the current CUDA device's unless given (tests under the interpreter)."""
        from ds4pool.model.kernels import triton_attention, triton_mla

        self._k = triton_mla
        # a decode row of at most this many keys is one piece: its result ignores its batch
        self.short_context = triton_attention.SHORT_CONTEXT
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(
                torch.cuda.current_device()
            ).multi_processor_count
        self._sms = num_sms

    def partition_size(self, batch: int, heads: int, width_tokens: int) -> int:
        """Split-K partition of a decode launch: the dense rule (`decode_partition_size`) with
        the kernel's head blocks in the place of kv heads (programs per row and partition)."""
        blocks = -(-heads // self._k.DEFAULT_MLA_DECODE.block_h)
        return decode_partition_size(batch, blocks, width_tokens, self._sms, self.short_context)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] absorbed queries
        latent: torch.Tensor,  # [T, 1, D]
        cache: torch.Tensor,  # [1, N + 1, bs, 1, D]
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:  # [T, H, R]; rows of prefills not in meta.prefills: unset
        write_latent(cache, latent, meta.slot_mapping)
        out = q.new_empty((*q.shape[:2], value_dim))
        if meta.decode_only:  # every row of the metadata is one decode token (graphs too)
            self._decode(q, cache, meta.block_tables, meta.context_lens, scale, out)
            return out
        if meta.decode_rows.numel():
            rows = meta.decode_rows
            tables = meta.block_tables[rows, : meta.max_decode_blocks]  # [Bd, nb]
            decoded = q.new_empty((rows.shape[0], q.shape[1], value_dim))
            self._decode(
                q[meta.decode_tokens], cache, tables, meta.context_lens[rows], scale, decoded
            )
            out.index_copy_(0, meta.decode_tokens, decoded)
        for p in meta.prefills:
            out[p.token_start : p.token_end] = TorchMLAAttention._prefill(
                q, cache, meta, p, scale, value_dim
            )
        return out

    @staticmethod
    def context(cache: torch.Tensor, meta: AttentionMetadata, p: PrefillSlice) -> torch.Tensor:
        return TorchMLAAttention.context(cache, meta, p)

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        cache: torch.Tensor,
        tables: torch.Tensor,  # [B, nb]
        lens: torch.Tensor,  # [B]
        scale: float,
        out: torch.Tensor,  # [B, H, R]
    ) -> None:
        width = tables.shape[1] * cache.shape[2]
        self._k.mla_decode(
            q,
            cache[0],
            tables,
            lens,
            scale,
            out,
            partition_size=self.partition_size(q.shape[0], q.shape[1], width),
            short_context=self.short_context,
        )
