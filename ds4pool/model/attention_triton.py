"""The CUDA attention backend: Triton paged-attention kernels over the block tables.

Decode-only steps (one query per sequence) use the split-K decode kernel; every other step
(prompt chunks, mixed with decodes) uses the varlen prefill kernel, which reads the cached
prefix from the blocks in place, split-K over the keys when its live query tiles would leave
SMs idle (a short chunk or a few decode rows over a long context). K/V are written by slot
mapping before either kernel runs: by the Llama family's fused attention prologue
(kernels/triton_prologue.py, with q/k norm and RoPE, through TritonOps), else here (one
fused kernel for both); on a decode-only step, `forward_decode_prologue` has the decode
kernel do that prologue itself (TritonOps.decode_attention: one launch fewer a layer).
Both kernels size their grids from tensor shapes only (a captured mixed step fixes the
prefill split-K factor in its metadata), so decode and mixed steps over persistent
buffers can be captured in CUDA graphs (ds4pool/model/cuda_graphs.py) and replayed with new
values. The decode kernel's launch (tile width, warps, stages, short-row pieces) is looked
up on the host by (batch, table width) in `kernels/triton_decode_configs.DECODE_TABLE`, so
a graph keeps the one it was captured with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ds4pool.model.attention import AttentionMetadata

if TYPE_CHECKING:  # the kernels import triton, which a CPU-only install may lack
    from ds4pool.model.kernels.triton_attention import PrefillLaunch
    from ds4pool.model.kernels.triton_decode_configs import DecodeTable
    from ds4pool.model.kernels.triton_prologue import DecodePrologue


def decode_partition_size(
    batch: int, kv_heads: int, width_tokens: int, num_sms: int, short: int = 1024, align: int = 64
) -> int:
    """`partition_size` of a `paged_decode` launch, from shapes only (graph safe).

    A table of at most `short` tokens is one piece: a split costs a reduce launch, and short
    contexts are latency-bound. A wider one gets pieces for ~4 programs per SM assuming the
    longest context fills only a quarter of the table (a graph's width bucket is up to 4x the
    context it serves: widths grow x4 in model/cuda_graphs.py; programs past a row's context
    exit at once), 256 tokens at the least, a multiple of `align` (the launch's block_n).
    """
    if width_tokens <= short:
        return short
    splits = max(1, -(-4 * num_sms // max(1, batch * kv_heads)))
    size = -(-width_tokens // (4 * splits))
    align = max(64, align)
    return max(-(-256 // align) * align, -(-size // align) * align)


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

    def __init__(
        self,
        decode_table: DecodeTable | None = None,
        split_decode_rows: bool = False,
        num_sms: int | None = None,  # None: the current CUDA device's (tests set it)
        prefill_launch: PrefillLaunch | None = None,  # None: the current device's
        small_m: int = 0,  # > 0: that launch with PrefillLaunch.small_m = small_m
    ) -> None:
        from ds4pool.model.kernels import triton_attention, triton_decode_configs, triton_fused

        # a mixed step's leading decode rows through the decode kernel and its prompt chunks
        # through the prefill kernel (two launches), instead of one prefill launch in which
        # each decode row is a tile of BLOCK_M rows with G live ones (select_backend's
        # "triton-split"; see docs/BENCHMARKS.md, run K's profile)
        self.split_decode_rows = split_decode_rows

        self._k = triton_attention
        self._store_kv = triton_fused.store_kv
        # decode launches by (batch bucket, table width): chosen from shapes, graph safe
        self.decode_table = decode_table or triton_decode_configs.DECODE_TABLE
        if num_sms is None or prefill_launch is None:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            num_sms = num_sms or props.multi_processor_count
            shared = getattr(props, "shared_memory_per_block_optin", 0)
            capability = (props.major, props.minor)
            prefill_launch = prefill_launch or triton_attention.prefill_launch(capability, shared)
        self._sms = num_sms
        if small_m:  # a mixed step's decode rows on small_m-row tiles ("triton-small")
            prefill_launch = dataclasses.replace(prefill_launch, small_m=small_m)
        self.prefill_launch = prefill_launch

    def partition_size(
        self, batch: int, num_kv_heads: int, width_tokens: int, block_n: int = 64
    ) -> int:
        """Split-K partition for a decode launch (`decode_partition_size`)."""
        return decode_partition_size(
            batch, num_kv_heads, width_tokens, self._sms, self._k.SHORT_CONTEXT, block_n
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: torch.Tensor,  # [2, N + 1, bs, H_kv, D]
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,  # the fused prologue (TritonOps) wrote k, v already
    ) -> torch.Tensor:  # [T, H, D]
        if not kv_stored:
            self._store_kv(cache, k, v, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(q, cache, meta, scale)
        assert meta.query_start is not None
        out = torch.empty_like(q)
        nd = meta.lead_decode_rows if self.split_decode_rows else 0
        if nd:  # rows and tokens [0, nd): one query token each
            tables, lens = meta.block_tables[:nd], meta.context_lens[:nd]
            self._decode_rows(q[:nd], cache, tables, lens, meta, scale, out[:nd])
        parts = meta.prefill_partitions or self.prefill_partitions(meta, q.shape[1], k.shape[1])
        self._k.paged_prefill(
            q[nd:],
            cache[0],
            cache[1],
            meta.block_tables[nd:],
            meta.query_start[nd:],
            meta.context_lens[nd:],
            meta.max_query_len,
            scale,
            out[nd:],
            sliding_window=meta.sliding_window,
            num_partitions=parts,
            query_offset=nd,
            launch=self.prefill_launch,
        )
        return out

    def forward_decode_prologue(
        self,
        q: torch.Tensor,  # [B, H, D] the raw q view (before norm and RoPE)
        cache: torch.Tensor,  # [2, N + 1, bs, H_kv, D] contiguous (KVLayout "kv")
        meta: AttentionMetadata,  # decode_only
        scale: float,
        prologue: DecodePrologue,  # raw k, v; positions, slots, inv_freq, norm weights, ...
    ) -> torch.Tensor:  # [B, H, D]
        """`forward` of a decode-only step with the attention prologue done by the decode
        kernel itself (q/k norm, RoPE, the store of k and v at prologue.slots: one launch
        fewer than TritonOps.attention_prologue + `forward`; TritonOps.decode_attention)."""
        assert meta.decode_only
        return self._decode(q, cache, meta, scale, prologue)

    def _decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        prologue: DecodePrologue | None = None,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tables, lens = meta.block_tables, meta.context_lens
        self._decode_rows(q, cache, tables, lens, meta, scale, out, prologue)
        return out

    def _decode_rows(
        self,
        q: torch.Tensor,  # [B, H, D]
        cache: torch.Tensor,
        tables: torch.Tensor,  # [B, width]
        lens: torch.Tensor,  # [B]
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [B, H, D], written
        prologue: DecodePrologue | None = None,
    ) -> None:
        width = tables.shape[1] * meta.block_size
        launch = self.decode_table.launch(q.shape[0], width)
        self._k.paged_decode(
            q,
            cache[0],
            cache[1],
            tables,
            lens,
            scale,
            out,
            sliding_window=meta.sliding_window,
            partition_size=self.partition_size(q.shape[0], cache.shape[-2], width, launch.block_n),
            launch=launch,
            short_context=self._k.SHORT_CONTEXT,
            prologue=prologue,
        )

    def prefill_partitions(self, meta: AttentionMetadata, heads: int, kv_heads: int) -> int:
        """Split-K factor of an eager step, from its host-side counts: the prompt chunks'
        query tiles (the long walks; decode rows' tiles are short next to them, and count
        only in a step without chunks) times the kv heads, against the SMs."""
        block_q = self.prefill_tile_tokens(meta.max_query_len, heads, kv_heads)
        tiles = sum(-(-(p.token_end - p.token_start) // block_q) for p in meta.prefills)
        tiles = tiles or int(meta.decode_rows.shape[0])
        max_context = max(
            [p.context_len for p in meta.prefills] + [meta.max_decode_blocks * meta.block_size]
        )
        return self._k.prefill_num_partitions(tiles * kv_heads, max_context, self._sms)

    def prefill_tile_tokens(self, max_query_len: int, heads: int, kv_heads: int) -> int:
        group = heads // kv_heads
        return self._k.prefill_block_m(max_query_len, group, self.prefill_launch) // group

    def graph_prefill_partitions(
        self, chunk_tokens: int, heads: int, kv_heads: int, max_context: int
    ) -> int:
        """The split-K factor of a captured mixed step, from its shape only: one chunk of
        `chunk_tokens` (padded) over a table `max_context` tokens wide."""
        tiles = -(-chunk_tokens // self.prefill_tile_tokens(chunk_tokens, heads, kv_heads))
        return self._k.prefill_num_partitions(tiles * kv_heads, max_context, self._sms)
