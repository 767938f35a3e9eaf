"""Random paged KV layouts and a float64 attention oracle that reads the same paged cache.

Shared by the interpreter checks (tests/unit) and the CUDA tests (tests/gpu): block ids are
shuffled so that no sequence's blocks are contiguous, table tails hold block 0 (any valid id),
and the oracle walks the block table token by token, independent of the kernels' tiling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4pool.model.attention import AttentionMetadata, TorchPagedAttention, build_metadata


@dataclass(frozen=True)
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    cache: torch.Tensor  # [2, N, bs, H_kv, D]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    query_lens: list[int]
    scale: float


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedCase:
    """A batch whose sequence s has query_lens[s] new tokens at the end of context_lens[s]."""
    assert len(query_lens) == len(context_lens)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    max_blocks = max(max(blocks_per_seq, default=1), 1)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedCase(
        q=q.to(device, dtype),
        cache=cache.to(device, dtype),
        block_tables=tables.to(device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_lens=list(query_lens),
        scale=head_dim**-0.5,
    )


def poison_unused_slots(case: PagedCase) -> None:
    """NaN into every cache slot no sequence owns (spare blocks, tails of last blocks), in place.

    Kernels must never read them: a masked score times a NaN value is still NaN.
    """
    bs = case.cache.shape[2]
    used = torch.zeros(case.cache.shape[1], bs, dtype=torch.bool)
    tables = case.block_tables.long().cpu()
    for s, ctx in enumerate(case.context_lens.tolist()):
        pos = torch.arange(ctx)
        used[tables[s, pos // bs], pos % bs] = True
    case.cache[:, ~used.to(case.cache.device)] = float("nan")


def drop_blocks_before_window(case: PagedCase, window: int) -> None:
    """Point every table entry whose block lies wholly before all of its row's windows at an
    unowned (after `poison_unused_slots`: NaN) block, as a server that frees them would."""
    bs, num_blocks = case.cache.shape[2], case.cache.shape[1]
    owned = set(case.block_tables.flatten().tolist())
    spare = next(i for i in range(num_blocks) if i not in owned)
    for s, (q_len, ctx) in enumerate(zip(case.query_lens, case.context_lens.tolist())):
        first_seen = max(0, ctx - q_len - window + 1)  # lowest key the first query sees
        case.block_tables[s, : first_seen // bs] = spare


def reference(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    """float64 [T, H, D]; a sequence with an empty context gets zeros."""
    q = case.q.double().cpu()
    k_cache, v_cache = case.cache[0].double().cpu(), case.cache[1].double().cpu()
    tables = case.block_tables.long().cpu()
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // h_kv
    out = torch.zeros_like(q)
    start = 0
    for s, (q_len, ctx) in enumerate(zip(case.query_lens, case.context_lens.tolist())):
        rows = slice(start, start + q_len)
        start += q_len
        if ctx == 0:
            continue
        pos = torch.arange(ctx)
        blocks = tables[s, pos // bs]
        keys = k_cache[blocks, pos % bs].repeat_interleave(group, dim=1)  # [C, H, D]
        values = v_cache[blocks, pos % bs].repeat_interleave(group, dim=1)
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]  # [Q, 1]
        seen = pos[None, :] <= q_pos  # [Q, C]
        if sliding_window:
            seen &= pos[None, :] > q_pos - sliding_window
        needed = seen.any(0)[:, None, None]  # keys no query sees may be freed (NaN): skip them
        keys, values = torch.where(needed, keys, 0.0), torch.where(needed, values, 0.0)
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * case.scale
        scores = scores.masked_fill(~seen[None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
    return out


def case_metadata(
    case: PagedCase, window: int | None = None, index_dtype: torch.dtype = torch.int64
) -> AttentionMetadata:
    """The case as one step's metadata (build_metadata over its tables, cut to each row's
    blocks), on the case's device."""
    block_size = case.cache.shape[2]
    ctx = case.context_lens.tolist()
    tables = [row[: -(-c // block_size)] for row, c in zip(case.block_tables.tolist(), ctx)]
    return build_metadata(
        case.query_lens, ctx, tables, block_size, case.q.device, window, index_dtype
    )


def torch_reference(case: PagedCase, window: int | None = None) -> torch.Tensor:
    """TorchPagedAttention.forward over the case's cache (its K/V write is a no-op rewrite)."""
    meta = case_metadata(case, window)
    h_kv, d = case.cache.shape[3], case.cache.shape[4]
    k = case.cache[0].reshape(-1, h_kv, d)[meta.slot_mapping]
    v = case.cache[1].reshape(-1, h_kv, d)[meta.slot_mapping]
    return TorchPagedAttention().forward(case.q, k, v, case.cache, meta, case.scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN when out holds a NaN)."""
    diff = out.double().cpu() - ref
    return float(diff.norm() / ref.norm().clamp_min(1e-30))
