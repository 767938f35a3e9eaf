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
    max_runs: int,
) -> list[list[tuple[int, int, int]] | None]:
    """Per row: the runs of consecutive block ids among the blocks it reads, as (first
    column, end column, first block id), in column order; None for a row of more runs.

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
    kept = [i for i, st in enumerate(starts) if len(st) <= max_runs]
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
    _, _, bs, h_kv, d = cache.shape
    bd, num_heads = q.shape[0], q.shape[1]
    group_q = q.view(bd, h_kv, num_heads // h_kv, d)  # [Bd, H_kv, G, D]
    firsts = [_first_block(c, bs, sliding_window) for c in context_lens]
    counts = [-(-c // bs) - f for c, f in zip(context_lens, firsts)]  # blocks to read
    runs = _runs(tables, firsts, counts, MAX_RUNS)
    out = torch.empty_like(q)
    gathered = []  # rows read through a copy: too many runs of ids, or too few blocks
    for i, ctx in enumerate(context_lens):
        row_runs = runs[i]
        if row_runs is None or counts[i] < VIEW_MIN_BLOCKS:
            gathered.append(i)
            continue
        lo = max(0, ctx - sliding_window) if sliding_window else 0
        out[i] = _attend_runs(group_q[i : i + 1], cache, row_runs, lo, ctx, scale)[0]
    block_bytes = 2 * bs * h_kv * d * cache.element_size()  # one block of K and V
    for sub in decode_groups([counts[i] for i in gathered], block_bytes):
        group = [gathered[k] for k in sub]
        n = counts[group[0]]
        rows = torch.tensor(group, dtype=torch.int64, device=q.device)  # [g]
        first = torch.tensor([firsts[i] for i in group], dtype=torch.int64, device=q.device)
        cols = (first[:, None] + torch.arange(n, device=q.device)[None, :]).clamp_(
            max=tables.shape[1] - 1
        )  # [g, n]; columns past a shorter sequence's end are masked below
        blocks = tables.index_select(0, rows).gather(1, cols).flatten()  # [g * n]
        keys = _gather_heads(cache[0], blocks).view(h_kv, len(group), n * bs, d).transpose(0, 1)
        values = _gather_heads(cache[1], blocks).view(h_kv, len(group), n * bs, d).transpose(0, 1)
        mask = _decode_mask(group, context_lens, firsts, n * bs, bs, sliding_window, q.device)
        o = _sdpa(group_q.index_select(0, rows), keys, values, mask, scale)
        out.index_copy_(0, rows, o)
    return out


def _attend_runs(
    q: torch.Tensor,  # [1, H_kv, G, D]
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    runs: list[tuple[int, int, int]],  # (first column, end column, first block id)
    lo: int,  # keys at positions [lo, ctx) are visible
    ctx: int,
    scale: float,
) -> torch.Tensor:  # [1, H, D]
    """One row attended in place: each run of consecutive blocks is a contiguous slice of
    the cache, cut to exactly its visible keys (no mask, no copy). Several runs (a shared
    prefix's blocks, then the row's own) are attended one by one and merged by their
    log-sum-exp: the row's softmax over all its keys, exactly, up to float rounding."""
    bs = cache.shape[2]
    pieces = []
    for col_a, col_b, block in runs:
        base = (block - col_a) * bs  # slot of position 0, were this run extended back
        p0, p1 = max(lo, col_a * bs), min(ctx, col_b * bs)  # its visible positions
        keys = _slot_heads(cache[0])[:, base + p0 : base + p1][None]  # [1, H_kv, C', D]
        values = _slot_heads(cache[1])[:, base + p0 : base + p1][None]
        pieces.append((keys, values))
    if len(pieces) == 1:
        return _sdpa(q, *pieces[0], None, scale)
    # The fused kernel behind scaled_dot_product_attention, which also returns each query's
    # log-sum-exp of its scores [1, H_kv, G] (fp32).
    parts = [
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        for k, v in pieces
    ]
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)  # [R, 1, H_kv, G]
    o = (torch.stack([o.float() for o, _ in parts]) * weights[..., None]).sum(0)
    return o.to(q.dtype).reshape(1, -1, q.shape[3])  # [1, H_kv, G, D] -> [1, H, D]


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
