"""Paged attention over a ragged batch: the step's metadata and the torch reference backend.

A step flattens every sequence's new tokens into one [T] axis. Sequence i owns the
token range [query_start[i], query_start[i+1]) and, after this step, has
context_lens[i] tokens of KV in the blocks listed by block_tables[i]:

    # [0, context_len - query_len)   already in the cache before this step
    # [context_len - query_len, context_len)   written by this step (the query tokens)

The KV cache of one layer is laid out as `KVLayout` (ds4pool/model/kv_layout.py) says;
token p of a sequence lives at slot block_table[p // block_size] * block_size + p % block_size.

Backends sit behind `AttentionBackend`: the torch reference here (CPU, MPS, and the oracle
in tests) and the Triton backend (ds4pool/model/attention_triton.py) on CUDA. A backend is
stateless: all it needs arrives in `AttentionMetadata` (no global context). The runner
builds metadata once per step (`build_metadata`), or, for CUDA-graph decode steps, points
it at its persistent device buffers (`ds4pool/model/input_batch.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn import functional as F

from ds4pool.model import attention_cpu
from ds4pool.model.device import host_ints, upload
from ds4pool.model.kv_layout import KVLayout


@dataclass(frozen=True)
class PrefillSlice:
    """A sequence with more than one query token this step (a prompt chunk)."""

    token_start: int
    token_end: int
    context_len: int
    row: int  # index into block_tables


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64 (unused entries 0, masked out)
    context_lens: torch.Tensor  # [B] int64
    # Decode group: sequences with exactly one query token, attended in one batched op.
    decode_rows: torch.Tensor  # [Bd] int64 rows of block_tables
    decode_tokens: torch.Tensor  # [Bd] int64 indices into the flat token axis
    max_decode_blocks: int
    prefills: tuple[PrefillSlice, ...]
    block_size: int
    sliding_window: int | None = None
    # For kernels over the whole ragged batch (Triton): sequence i's query rows are
    # [query_start[i], query_start[i + 1]); decode_only means every sequence has one.
    query_start: torch.Tensor | None = None  # [B + 1] int32
    max_query_len: int = 1
    decode_only: bool = False
    # A fixed split-K factor for the prefill kernel (captured mixed-step graphs); None lets
    # the backend pick one from the step's host-side counts.
    prefill_partitions: int | None = None
    # Sequences [0, n) have one query token each, tokens [0, n) (a mixed step's decode rows,
    # the leading ones of an eager step): a backend may attend them with its decode kernel.
    lead_decode_rows: int = 0
    # What a backend derives from this metadata on a step's first layer and reuses on the
    # others (the CPU decode plan: attention_cpu.plan_decode); a new metadata starts empty.
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class AttentionBackend(Protocol):
    """What a model's attention layers call. Invariants: `forward` writes this step's k, v
    at `meta.slot_mapping` (unless `kv_stored`: the caller's fused prologue, ops.py, has
    already written them there) and then attends; it never syncs with the host; with
    `supports_cuda_graphs`, a decode-only `forward` over persistent metadata buffers may be
    captured once per batch shape and replayed with new values in the same buffers.
    A backend may also offer `forward_decode_prologue` (TritonPagedAttention: the attention
    prologue inside its decode kernel), which TritonOps.decode_attention looks up; the
    protocol does not require it."""

    name: str
    supports_cuda_graphs: bool
    index_dtype: torch.dtype  # of block_tables / context_lens in its metadata

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: torch.Tensor,  # one layer, KVLayout
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor: ...  # [T, H, D]


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> AttentionMetadata:
    """Host-side construction from ids and counts; one host→device copy per tensor.
    block_tables and context_lens come in `index_dtype` (the backend's)."""
    assert len(query_lens) == len(context_lens) == len(block_tables)
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tokens: list[int] = []
    prefills: list[PrefillSlice] = []
    max_blocks = max((len(t) for t in block_tables), default=1) or 1
    max_decode_blocks = 1
    start = 0
    for row, (q, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        assert 0 < q <= ctx <= len(table) * block_size, (q, ctx, len(table))
        for pos in range(ctx - q, ctx):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        if q == 1:
            decode_rows.append(row)
            decode_tokens.append(start)
            max_decode_blocks = max(max_decode_blocks, -(-ctx // block_size))
        else:
            prefills.append(PrefillSlice(start, start + q, ctx, row))
        start += q
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]

    def tensor(
        values: list[int] | list[list[int]], dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        return upload(host_ints(values, dtype), device)

    query_start = [0]
    for q in query_lens:
        query_start.append(query_start[-1] + q)
    lead = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    return AttentionMetadata(
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_tables=tensor(padded, index_dtype),
        context_lens=tensor(context_lens, index_dtype),
        decode_rows=tensor(decode_rows),
        decode_tokens=tensor(decode_tokens),
        max_decode_blocks=max_decode_blocks,
        prefills=tuple(prefills),
        block_size=block_size,
        sliding_window=sliding_window,
        query_start=tensor(query_start, torch.int32),
        max_query_len=max(query_lens, default=1),
        decode_only=not prefills,
        lead_decode_rows=lead if prefills else 0,
    )


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's k, v [T, H_kv, D] into the layer cache at `slots` [T]."""
    tokens = KVLayout.token_view(cache)  # [2, slots, H_kv, D]
    tokens[0].index_copy_(0, slots, k)
    tokens[1].index_copy_(0, slots, v)


class TorchPagedAttention:
    """Reference backend in plain torch: runs on CPU, MPS and CUDA (the oracle in tests).

    Decode tokens of all sequences are attended together (keys gathered through the
    block tables and padded to the longest context, padding masked); each prompt chunk
    is attended on its own with SDPA. A faster kernel can replace this class as long as
    it keeps `forward`'s contract.

    On CPU, `cpu_kernels` routes both through attention_cpu (no double copy of the
    context, one fused kernel per decode group); `cpu_kernels=False` keeps the gathering
    path above, the oracle in tests.
    """

    name = "torch"
    supports_cuda_graphs = False
    index_dtype = torch.int64

    def __init__(self, cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: torch.Tensor,  # [2, N_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, H, D]
        if not kv_stored:
            write_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if self.cpu_kernels and cache.device.type == "cpu":
            return attention_cpu.forward(q, cache, meta, scale, out)
        if meta.decode_rows.numel():
            out.index_copy_(0, meta.decode_tokens, self._decode(q, cache, meta, scale))
        for p in meta.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, cache, meta, p, scale)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # tables [B, nb] → keys, values [B, nb * block_size, H_kv, D]
        b, nb = tables.shape
        _, _, bs, h_kv, d = cache.shape
        keys = cache[0][tables].reshape(b, nb * bs, h_kv, d)
        values = cache[1][tables].reshape(b, nb * bs, h_kv, d)
        return keys, values

    def _decode(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # Bd = decode sequences, L = padded context, G = query heads per kv head
        tables = meta.block_tables[meta.decode_rows, : meta.max_decode_blocks]
        keys, values = self._gather(cache, tables)  # [Bd, L, H_kv, D]
        bd, length, h_kv, d = keys.shape
        qd = q[meta.decode_tokens].view(bd, h_kv, -1, d)  # [Bd, H_kv, G, D]
        scores = torch.matmul(qd, keys.permute(0, 2, 3, 1)).float() * scale  # [Bd, H_kv, G, L]
        ctx = meta.context_lens[meta.decode_rows][:, None]  # [Bd, 1]
        idx = torch.arange(length, device=q.device)[None, :]  # [1, L]
        visible = idx < ctx
        if meta.sliding_window:
            visible &= idx >= ctx - meta.sliding_window
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [Bd, H_kv, G, D]
        return out.reshape(bd, -1, d)

    def _prefill(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        p: PrefillSlice,
        scale: float,
    ) -> torch.Tensor:
        bs = meta.block_size
        n_blocks = -(-p.context_len // bs)
        keys, values = self._gather(cache, meta.block_tables[p.row : p.row + 1, :n_blocks])
        keys, values = keys[0, : p.context_len], values[0, : p.context_len]  # [C, H_kv, D]
        qs = q[p.token_start : p.token_end].transpose(0, 1)  # [H, Q, D]
        n_q = qs.shape[1]
        mask = None
        if n_q != p.context_len or meta.sliding_window:
            # query i sits at position context_len - n_q + i and sees keys at <= that
            q_pos = torch.arange(p.context_len - n_q, p.context_len, device=q.device)[:, None]
            k_pos = torch.arange(p.context_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if meta.sliding_window:
                mask &= k_pos > q_pos - meta.sliding_window
        out = F.scaled_dot_product_attention(
            qs[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=qs.shape[0] != keys.shape[1],
        )  # [1, H, Q, D]
        return out[0].transpose(0, 1)
