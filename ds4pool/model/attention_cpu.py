"""Paged attention on CPU: decode groups and prompt chunks through the fused SDPA kernel.

Why this shape (measured on a 2-core EPYC, demo model, 16 decoders at 1.5k tokens; the
numbers are in docs/BENCHMARKS.md):
- The reference decode gathers keys with advanced indexing (`cache[0][tables]`) and then
  `matmul` copies them a second time, because [B, H_kv, D, L] does not fold into one bmm
  batch dimension. Those two copies were ~80% of a batch-16 step.
- The kernel is `scaled_dot_product_attention` (the fused CPU flash kernel): it reads keys
  through strides from the cache layout [L, H_kv, D]. GQA: the G query heads that share a
  KV head go in as G queries of one head, so each key block is read once for all of them
  (10% faster than enable_gqa at the demo's G=2, 28% at Llama-3-8B's G=4).
- A run of consecutive block ids (the block pool hands out ids in FIFO order, so a
  prompt's blocks mostly are) is a contiguous slice of the cache: a decode row of at most
  MAX_RUNS runs and VIEW_MIN_BLOCKS blocks is attended in place, no copy, one kernel call
  per run; the runs' partial results are merged by their log-sum-exp (agents on one system
  prompt: the shared prefix's run, then the row's own). Small per-sequence GEMMs over those
  views lose to the fused kernel.
- On CPU the cache is head-major in memory (KVLayout.head_major): one head's keys over a
  run are one contiguous [L, D] matrix, which the kernel reads 1.1-1.9x faster per layer
  than keys interleaved with the other heads (bench/cpu_attention_kernel.py). Every read
  here goes through `_slot_heads` / `_gather_heads`, which work in either order.
- Other sequences are gathered with one `index_select` of whole blocks (a memcpy of
  contiguous rows, far faster than advanced indexing) in groups of a few MiB, so that the
  copy is still in cache when the kernel reads it (a group of 16 at 1.5k tokens was ~2x
  slower than groups of 2); lengths are grouped so that padding stays under a quarter.

Numerics: a sequence's output is its own softmax over its own keys; padding keys are masked
to -inf and add exact zeros, so the result does not depend on its batch neighbours beyond
float rounding of the kernel's tiling.

Shapes: Bd = decode sequences, H = query heads, H_kv = key/value heads, G = H / H_kv,
D = head_dim, bs = block_size, n = blocks gathered per sequence in a group, L = n * bs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:  # attention.py imports this module
    from ds4pool.model.attention import AttentionMetadata

# A sequence joins a decode group when its padding to the group's longest is at most this
# share of the longest, or at most _PAD_BLOCKS blocks (cheaper than one more kernel call)...
_MAX_PAD_SHARE = 0.25
_PAD_BLOCKS = 8
# ...and the group's gathered K and V stay within this many bytes, so that the kernel reads
# them back from cache rather than memory (groups of 2 beat one group of 16 by ~2x at 1.5k
# tokens; one sequence longer than this is a group of its own).
GROUP_BYTES = 4 << 20
# A decode sequence is attended in place (its own kernel call) only from this many blocks
# of one run on: below it, copying into a group is cheaper than another call per layer.
VIEW_MIN_BLOCKS = 32
# ...and when its blocks are at most this many runs of consecutive ids. Each run is one
# kernel call; a row on a shared prefix has two (the prefix's blocks, then its own), and
# every block a decode appends while other rows decode too starts one more. Measured (m77
# shapes, 16 rows, head-major, 1 thread; docs/BENCHMARKS.md "head-major"): 2 runs at 1.5k
# tokens in place 15.7 vs 28.2 ms per layer for main's gather; 6 runs at 875 tokens (prefix,
# prompt, decode blocks, a second turn) in place 16-19 vs 13-14 gathered head-major.
MAX_RUNS = 4


def forward(
    q: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D], this step's k, v already written
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D], filled and returned
) -> torch.Tensor:
    """TorchPagedAttention.forward's contract on CPU, after write_kv."""
    if meta.decode_rows.numel():
        # CPU tensors: .tolist() reads host memory, it is not a device sync.
        decoded = paged_decode(
            q.index_select(0, meta.decode_tokens),
            cache,
            meta.block_tables.index_select(0, meta.decode_rows),
            meta.context_lens.index_select(0, meta.decode_rows).tolist(),
            scale,
            meta.sliding_window,
        )
        out.index_copy_(0, meta.decode_tokens, decoded)
    for p in meta.prefills:
        out[p.token_start : p.token_end] = paged_prefill(
            q[p.token_start : p.token_end],
            cache,
            meta.block_tables[p.row],
            p.context_len,
            scale,
            meta.sliding_window,
        )
    return out


def decode_groups(num_blocks: Sequence[int], block_bytes: int) -> list[list[int]]:
    """Indices into num_blocks, longest first, cut where a sequence would pad too much or the
    group's gathered bytes (block_bytes per block of K and V) would pass GROUP_BYTES."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            longest = num_blocks[group[0]]
            pad = longest - num_blocks[i]
            fits = (len(group) + 1) * longest * block_bytes <= GROUP_BYTES
            if fits and (pad <= _PAD_BLOCKS or pad <= _MAX_PAD_SHARE * longest):
                group.append(i)
                continue
        groups.append([i])
    return groups


def _first_block(ctx: int, block_size: int, sliding_window: int | None) -> int:
    """The first block holding a key visible to the query at position ctx - 1."""
    if not sliding_window or ctx <= sliding_window:
        return 0
    return (ctx - sliding_window) // block_size


def _runs(
    tables: torch.Tensor,  # [Bd, max_blocks] int64
    firsts: list[int],
    counts: list[int],  # row i reads tables[i, firsts[i] : firsts[i] + counts[i]]
    max_runs: int | None,
) -> list[list[tuple[int, int, int]] | None]:
    """Per row: the runs of consecutive block ids among the blocks it reads, as (first
    column, end column, first block id), in column order; None for a row of more runs
    than max_runs (None: every row's runs).

    Tensor ops over the whole table instead of a python loop over its ids: tables of long
    contexts hold thousands of ids per row; only the breaks between runs come to python.
    """
    device = tables.device
    first = torch.tensor(firsts, dtype=torch.int64, device=device)[:, None]  # [Bd, 1]
    count = torch.tensor(counts, dtype=torch.int64, device=device)[:, None]
    col = torch.arange(tables.shape[1] - 1, device=device)[None, :]  # [1, max_blocks - 1]
    inside = (col >= first) & (col < first + count - 1)  # pairs (j, j + 1) both read
    breaks = ((tables[:, 1:] - tables[:, :-1] != 1) & inside).nonzero()  # [K, 2] row, col
    # CPU tensors: .tolist() reads host memory, it is not a device sync.
    starts = [[f] for f in firsts]  # per row: the columns where its runs start
    for row, c in breaks.tolist():  # sorted by row, then column
        starts[row].append(c + 1)
    kept = [i for i, st in enumerate(starts) if max_runs is None or len(st) <= max_runs]
    rows = torch.tensor([i for i in kept for _ in starts[i]], dtype=torch.int64)
    cols = torch.tensor([c for i in kept for c in starts[i]], dtype=torch.int64)
    ids = iter(tables[rows.to(device), cols.to(device)].tolist())
    runs: list[list[tuple[int, int, int]] | None] = [None] * len(firsts)
    for i in kept:
        ends = [*starts[i][1:], firsts[i] + counts[i]]
        runs[i] = [(a, b, next(ids)) for a, b in zip(starts[i], ends)]
    return runs


def paged_decode(
    q: torch.Tensor,  # [Bd, H, D] one query token per sequence
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    tables: torch.Tensor,  # [Bd, max_blocks] int64 block ids (entries past a context unused)
    context_lens: Sequence[int],  # [Bd] keys per sequence, the query's own included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Bd, H, D]
    """Each row is cut into pieces by its own table only (never by its neighbours'):
    - a row of few blocks is gathered (a copy of its blocks, in groups of rows);
    - a row of at most MAX_RUNS runs of consecutive blocks: each run a piece, in place;
    - a row of more runs whose first run is long (agents on one system prompt: the shared
      prefix's blocks, then their own blocks between the other rows'): that run in place,
      the rest gathered as one piece; else the whole row gathered.
    A row's pieces are merged by their log-sum-exp. Rows whose in-place piece is the same
    slice of the cache (the shared prefix) are attended in one call with the slice as a
    stride-0 batch: the kernel reads it from cache for every row after the first, and each
    row's result is the same bits as its call alone."""
    _, _, bs, h_kv, d = cache.shape
    bd, num_heads = q.shape[0], q.shape[1]
    group_q = q.view(bd, h_kv, num_heads // h_kv, d)  # [Bd, H_kv, G, D]
    firsts = [_first_block(c, bs, sliding_window) for c in context_lens]
    counts = [-(-c // bs) - f for c, f in zip(context_lens, firsts)]  # blocks to read
    runs = _runs(tables, firsts, counts, None)
    out = torch.empty_like(q)
    gathered = []  # rows read through a copy: too many runs of ids, or too few blocks
    tails: dict[int, int] = {}  # row -> first column of the part gathered after its first run
    slices: dict[tuple[int, int], list[int]] = {}  # cache slots [a, b) -> rows that read them
    row_slices: list[list[tuple[int, int]]] = [[] for _ in range(bd)]
    for i, ctx in enumerate(context_lens):
        row_runs = runs[i]
        assert row_runs is not None
        if counts[i] < VIEW_MIN_BLOCKS:
            gathered.append(i)
            continue
        if len(row_runs) > MAX_RUNS:
            if row_runs[0][1] - row_runs[0][0] < VIEW_MIN_BLOCKS:
                gathered.append(i)
                continue
            tails[i] = row_runs[0][1]
            row_runs = row_runs[:1]
        lo = max(0, ctx - sliding_window) if sliding_window else 0
        for col_a, col_b, block in row_runs:
            base = (block - col_a) * bs  # slot of position 0, were this run extended back
            p0, p1 = max(lo, col_a * bs), min(ctx, col_b * bs)  # its visible positions
            key = (base + p0, base + p1)
            slices.setdefault(key, []).append(i)
            row_slices[i].append(key)
    parts: dict[tuple[int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]] = {}
    heads_k, heads_v = _slot_heads(cache[0]), _slot_heads(cache[1])  # [H_kv, slots, D]
    for (a, b), rows in slices.items():
        keys = heads_k[:, a:b][None].expand(len(rows), -1, -1, -1)  # [R, H_kv, C, D] views
        values = heads_v[:, a:b][None].expand(len(rows), -1, -1, -1)
        o, lse = _flash(_rows(group_q, rows), keys, values, None, scale)
        for r, row in enumerate(rows):
            parts[row, (a, b)] = o[r], lse[r]
    tail_parts = _gather_pieces(group_q, cache, tables, context_lens, tails, scale)
    for i in range(bd):
        if not row_slices[i]:
            continue
        pieces = [parts[i, key] for key in row_slices[i]]
        if i in tails:
            pieces.append(tail_parts[i])
        out[i] = _merge(pieces, q.dtype).reshape(num_heads, d)
    block_bytes = 2 * bs * h_kv * d * cache.element_size()  # one block of K and V
    for sub in decode_groups([counts[i] for i in gathered], block_bytes):
        group = [gathered[k] for k in sub]
        n = counts[group[0]]
        rows = torch.tensor(group, dtype=torch.int64, device=q.device)  # [g]
        keys, values = _gather_rows(cache, tables, rows, [firsts[i] for i in group], n)
        mask = _decode_mask(group, context_lens, firsts, n * bs, bs, sliding_window, q.device)
        o = _sdpa(group_q.index_select(0, rows), keys, values, mask, scale)
        out.index_copy_(0, rows, o)
    return out


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along dim 0: a slice where they are consecutive, else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0] : rows[0] + len(rows)]
    return x.index_select(0, torch.tensor(rows, dtype=torch.int64, device=x.device))


def _gather_rows(
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    tables: torch.Tensor,  # [Bd, max_blocks]
    rows: torch.Tensor,  # [g] rows of tables
    firsts: list[int],  # per row: its first column to gather
    n: int,  # columns per row (past a row's end: clamped, masked by the caller)
) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values [g, H_kv, n * bs, D]
    _, _, bs, h_kv, d = cache.shape
    g = rows.numel()
    first = torch.tensor(firsts, dtype=torch.int64, device=tables.device)
    cols = (first[:, None] + torch.arange(n, device=tables.device)[None, :]).clamp_(
        max=tables.shape[1] - 1
    )  # [g, n]
    blocks = tables.index_select(0, rows).gather(1, cols).flatten()  # [g * n]
    keys = _gather_heads(cache[0], blocks).view(h_kv, g, n * bs, d).transpose(0, 1)
    values = _gather_heads(cache[1], blocks).view(h_kv, g, n * bs, d).transpose(0, 1)
    return keys, values


def _gather_pieces(
    group_q: torch.Tensor,  # [Bd, H_kv, G, D]
    cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: Sequence[int],
    tails: dict[int, int],  # row -> first column of its gathered piece (to its context's end)
    scale: float,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # row -> (o [H_kv, G, D], lse [H_kv, G])
    """The gathered pieces of rows whose first run is attended in place, in decode groups."""
    rows_of = list(tails)
    if not rows_of:
        return {}
    device, bs = group_q.device, cache.shape[2]
    starts = [tails.get(i, 0) for i in range(len(context_lens))]  # per row, as _decode_mask
    counts = [-(-context_lens[i] // bs) - tails[i] for i in rows_of]
    block_bytes = 2 * bs * cache.shape[3] * cache.shape[4] * cache.element_size()
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for sub in decode_groups(counts, block_bytes):
        group = [rows_of[k] for k in sub]
        n = counts[sub[0]]
        rows = torch.tensor(group, dtype=torch.int64, device=device)
        keys, values = _gather_rows(cache, tables, rows, [starts[i] for i in group], n)
        # (a window starts inside the first run, before any gathered key: only ends matter)
        mask = _decode_mask(group, context_lens, starts, n * bs, bs, None, device)
        o, lse = _flash(group_q.index_select(0, rows), keys, values, mask, scale)
        for r, row in enumerate(group):
            parts[row] = o[r], lse[r]
    return parts


def _flash(
    q: torch.Tensor,  # [g, H_kv, G, D]
    keys: torch.Tensor,  # [g, H_kv, L, D]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [g, 1, 1, L] bool, True = visible
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [g, H_kv, G, D], lse [g, H_kv, G] float32
    """The fused kernel behind scaled_dot_product_attention, which also returns each query's
    log-sum-exp of its scores (a bool mask goes in as 0 / -inf, as sdpa passes it)."""
    float_mask = None
    if mask is not None:
        float_mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        float_mask.masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=float_mask, scale=scale
    )


def _merge(
    parts: list[tuple[torch.Tensor, torch.Tensor]],  # (o [H_kv, G, D], lse [H_kv, G])
    dtype: torch.dtype,
) -> torch.Tensor:  # [H_kv, G, D]
    """One row's pieces (disjoint sets of its keys) as its softmax over all of them: each
    piece's output weighted by the share of its log-sum-exp, exactly up to rounding."""
    if len(parts) == 1:
        return parts[0][0]
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)  # [R, H_kv, G]
    o = (torch.stack([o.float() for o, _ in parts]) * weights[..., None]).sum(0)
    return o.to(dtype)


def _slot_heads(plane: torch.Tensor) -> torch.Tensor:  # [H_kv, (N + 1) * bs, D]
    """One plane [N + 1, bs, H_kv, D] as each head's slots: a view, in either memory order
    (for a head-major cache each head's slots are then one contiguous matrix)."""
    return plane.permute(2, 0, 1, 3).flatten(1, 2)


def _gather_heads(plane: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n] of one plane as [H_kv, n * bs, D], copied in the cache's memory order.

    Head-major cache: one memcpy of bs * D values per head and block, and the kernel then
    reads each head's keys as one matrix. Token-major: whole blocks, as main did (gathering
    it head-major would copy D values at a time, ~10x slower)."""
    if plane.stride(2) > plane.stride(0):  # head-major memory [H_kv, N + 1, bs, D]
        return plane.permute(2, 0, 1, 3).index_select(1, blocks).flatten(1, 2)
    return plane.index_select(0, blocks).permute(2, 0, 1, 3).flatten(1, 2)


def _sdpa(
    q: torch.Tensor,  # [g, H_kv, G, D]
    keys: torch.Tensor,  # [g, H_kv, L, D], any strides (fastest: each head's [L, D] contiguous)
    values: torch.Tensor,  # [g, H_kv, L, D]
    mask: torch.Tensor | None,  # [g, 1, 1, L] bool, True = visible
    scale: float,
) -> torch.Tensor:  # [g, H, D]
    # The G query heads of a KV head go in as G queries of one head (a decode has no causal
    # mask): the kernel then reads each key block once for all of them, not G times.
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(q.shape[0], -1, q.shape[3])  # [g, H_kv, G, D] -> [g, H, D]


def _decode_mask(
    group: list[int],
    context_lens: Sequence[int],
    firsts: Sequence[int],
    length: int,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:  # [g, 1, 1, L] bool, True = visible; None when all are
    ctx = [context_lens[i] for i in group]
    starts = [firsts[i] * block_size for i in group]  # position of the first gathered key
    window = sliding_window or 0
    if all(c - s == length and (not window or c - s <= window) for c, s in zip(ctx, starts)):
        return None
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
    ctx_t = torch.tensor(ctx, device=device)[:, None]
    visible = pos < ctx_t  # [g, L]
    if window:
        visible &= pos >= ctx_t - window
    return visible[:, None, None, :]


def paged_prefill(
    q: torch.Tensor,  # [Q, H, D] one prompt chunk, at positions [C - Q, C)
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    table: torch.Tensor,  # [max_blocks] int64 this sequence's block ids
    context_len: int,  # C: keys after this chunk was written
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Q, H, D]
    _, _, bs, h_kv, d = cache.shape
    n_q = q.shape[0]
    first = _first_block(context_len - n_q + 1, bs, sliding_window)  # for the chunk's 1st query
    n = -(-context_len // bs) - first
    start = first * bs  # position of the first gathered key
    blocks = table[first : first + n]
    runs = _runs(table[None], [first], [n], 1)[0]
    if runs is not None:  # one run of consecutive blocks: a slice of the cache, no copy
        run = runs[0][2]
        keys = _slot_heads(cache[0])[:, run * bs : (run + n) * bs]  # [H_kv, n * bs, D]
        values = _slot_heads(cache[1])[:, run * bs : (run + n) * bs]
    else:
        keys, values = _gather_heads(cache[0], blocks), _gather_heads(cache[1], blocks)
    keys, values = keys[:, : context_len - start], values[:, : context_len - start]  # [H_kv, C', D]
    mask = None
    if n_q != context_len or sliding_window:
        # query i sits at position C - Q + i and sees keys at positions <= that
        q_pos = torch.arange(context_len - n_q, context_len, device=q.device)[:, None]
        k_pos = torch.arange(start, context_len, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [Q, C']
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, Q, D]
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != h_kv,
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)
