"""Paged attention over the latent cache of multi-head latent attention (DeepSeek-V2/V3).

The cache (KVLayout kind "mla") holds, per token and layer, one plane of one "head":

    latent [R + r] = [ c (kv_lora_rank R, normed) | k_rot (qk_rope_head_dim r, rotated) ]

The model (ds4pool/model/mla.py) absorbs kv_b_proj's key half into the query, so that every
query head attends directly over the latent, as multi-query attention with one KV head:

    score(h, j) = q_abs[h] · latent[j]          q_abs = [ q_nope[h] · W_UK[h] | q_rot[h] ]
    out[h]      = Σ_j softmax(score)[h, j] · latent[j][:R]       (values: the c part)

and lifts `out` [H, R] through W_UV afterwards. Keys and values are the same memory: the
cache is read once for both, and no per-head K/V of the context is ever built.

Backends sit behind `MLABackend`; `TorchMLAAttention` is the reference (CPU, MPS, CUDA, the
oracle in tests). Shapes: T = tokens of the step, H = query heads, D = R + r, Bd = decode
sequences, L = padded context.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from ds4pool.model.attention import AttentionMetadata, PrefillSlice
from ds4pool.model.kv_layout import KVLayout


class MLABackend(Protocol):
    """What the latent attention layers call. Invariants: `forward` writes this step's latent
    at `meta.slot_mapping` and then attends; it never syncs with the host."""

    name: str
    supports_cuda_graphs: bool
    index_dtype: torch.dtype

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] absorbed queries
        latent: torch.Tensor,  # [T, 1, D] this step's latent
        cache: torch.Tensor,  # [1, N + 1, bs, 1, D], one layer
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,  # R: the values are latent[..., :R]
    ) -> torch.Tensor: ...  # [T, H, R]; rows of prefills not in meta.prefills: unset

    def context(
        self, cache: torch.Tensor, meta: AttentionMetadata, p: PrefillSlice
    ) -> torch.Tensor: ...  # [C, D] the latent of p's whole context, after forward wrote it


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's latent [T, 1, D] into the layer cache at `slots` [T]."""
    KVLayout.token_view(cache)[0].index_copy_(0, slots, latent)


class TorchMLAAttention:
    """Reference MLA backend in plain torch. Decode tokens of all sequences are attended
    together (the latent gathered through the block tables, padded, padding masked); each
    prompt chunk in `meta.prefills` is attended on its own with SDPA, its H heads over the
    one latent head. Every token's latent is written, whichever rows are attended.

    Decode steps may be captured in CUDA graphs: the decode path reads only tensors and
    shapes (the table width), never host values. Prompt chunks may not (they are sliced by
    `meta.prefills`, host lists): it has no `graph_prefill_partitions`, so the runner builds
    no mixed-step graphs for it. The decode path gathers every row's padded context, which a
    graph keeps in its pool: `graph_gather_tokens` bounds batch bucket x table width (in
    tokens) of the decode graphs (DeepSeek-V3's 576 bf16 values a token: 1.2 GB, reused by
    every layer); wider steps run eagerly."""

    name = "torch-mla"
    supports_cuda_graphs = True
    graph_gather_tokens = 1 << 20
    index_dtype = torch.int64

    def forward(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:
        write_latent(cache, latent, meta.slot_mapping)
        out = q.new_empty((*q.shape[:2], value_dim))
        if meta.decode_rows.numel():
            out.index_copy_(0, meta.decode_tokens, self._decode(q, cache, meta, scale, value_dim))
        for p in meta.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, cache, meta, p, scale, value_dim)
        return out

    @staticmethod
    def context(cache: torch.Tensor, meta: AttentionMetadata, p: PrefillSlice) -> torch.Tensor:
        bs, d = cache.shape[2], cache.shape[4]
        n_blocks = -(-p.context_len // bs)
        table = meta.block_tables[p.row, :n_blocks]
        return cache[0][table].reshape(n_blocks * bs, d)[: p.context_len]  # [C, D]

    @staticmethod
    def _decode(
        q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, r: int
    ) -> torch.Tensor:  # [Bd, H, R]
        tables = meta.block_tables[meta.decode_rows, : meta.max_decode_blocks]  # [Bd, nb]
        bd, nb = tables.shape
        _, _, bs, _, d = cache.shape
        keys = cache[0][tables].reshape(bd, nb * bs, d)  # [Bd, L, D]
        qd = q[meta.decode_tokens]  # [Bd, H, D]
        scores = torch.matmul(qd, keys.transpose(1, 2)).float() * scale  # [Bd, H, L]
        ctx = meta.context_lens[meta.decode_rows][:, None]  # [Bd, 1]
        idx = torch.arange(nb * bs, device=q.device)[None, :]  # [1, L]
        scores.masked_fill_(~(idx < ctx)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(keys.dtype)
        return torch.matmul(probs, keys[..., :r])  # [Bd, H, R]

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        p: PrefillSlice,
        scale: float,
        r: int,
    ) -> torch.Tensor:  # [Q, H, R]
        keys = TorchMLAAttention.context(cache, meta, p)  # [C, D]
        qs = q[p.token_start : p.token_end].transpose(0, 1)  # [H, Q, D]
        out = F.scaled_dot_product_attention(
            qs[None],  # [1, H, Q, D]
            keys[None, None],  # [1, 1, C, D]: one head shared by all
            keys[None, None, :, :r],  # [1, 1, C, R]
            attn_mask=causal_mask(qs.shape[1], p.context_len, q.device),
            is_causal=qs.shape[1] == p.context_len,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, Q, R]
        return out[0].transpose(0, 1)


def causal_mask(n_q: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """[Q, C] bool for a chunk of the last Q of C positions (query i sits at C - Q + i and
    sees keys at <= that); None when Q = C (SDPA's own is_causal)."""
    if n_q == context_len:
        return None
    q_pos = torch.arange(context_len - n_q, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= q_pos
