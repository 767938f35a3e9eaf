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
- Rows on one slice of the cache (agents on one system prompt) are attended in one call
  with their queries stacked FOLD_QUERIES to a batch entry: the kernel runs its GEMMs on
  that many queries per key block instead of one row's G, 2-3x faster per layer on a long
  shared prefix (docs/BENCHMARKS.md "stacked prefix queries"). A row alone on its slice
  goes in an entry of just its own queries, padded to the fewest the kernel gives the same
  bits as in a full entry (invariant_queries, measured on this machine: 4 on a Zen 1 EPYC).
- Every layer of a step reads the same tables: the plan of calls (plan_decode: runs, groups,
  gather indices, masks) is made once a step and kept on the step's metadata; the layers
  only run it (run_decode), and merge every row's pieces in one vectorised op.

Numerics: a sequence's output is its own softmax over its own keys; padding keys are masked
to -inf and add exact zeros. With one thread a row's bits do not depend on its neighbours
where its pieces are of the same lengths (its in-place pieces always: a stacked entry's
query count is at least invariant_queries, from which the kernel's bits for a query do not
depend on the count or the query's place; its gathered piece if its group needs no
padding). With more threads the kernel's split of a call across them can change the last
bits with the call's batch size (seen on a 2-core EPYC), as padding does: within float
rounding of the kernel's tiling.

Shapes: Bd = decode sequences, H = query heads, H_kv = key/value heads, G = H / H_kv,
D = head_dim, bs = block_size, n = blocks gathered per sequence in a group, L = n * bs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
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
# Rows whose in-place piece is one slice of the cache (agents on one system prompt) are
# attended in one kernel call with their queries stacked about this many to a batch entry
# (fold_rows): the kernel's GEMMs then run that many queries against each key block read,
# where one row's G queries alone (3 at the m77 shapes) take its slow few-row path.
# Measured (m77 shapes, 16 rows, 1 thread, per layer): a 2,400-key prefix 26 ms as a
# stride-0 batch of rows, 12.4 with 12 queries an entry, 8.9 with 24. A row alone on its
# slice is not padded to a full entry (that made one row's layer 1.7-2.2x slower at 1.5-3k
# tokens): its entry holds its G queries, padded to invariant_queries if fewer.
FOLD_QUERIES = 16
# Key counts of invariant_queries' probe: short and longer within one key block of the
# kernel (512), across two, and three with a partial last block.
_PROBE_KEYS = (16, 37, 300, 700, 1100)


def forward(
    q: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D], this step's k, v already written
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D], filled and returned
) -> torch.Tensor:
    """TorchPagedAttention.forward's contract on CPU, after write_kv."""
    if meta.decode_rows.numel():
        # every layer of the step reads the same tables: the plan is made by the first one
        group = q.shape[1] // cache.shape[3]
        key = ("cpu_decode_plan", group, tuple(cache.shape[2:]), cache.dtype)
        plan = meta.derived.get(key)
        if not isinstance(plan, DecodePlan):
            # CPU tensors: .tolist() reads host memory, it is not a device sync.
            plan = meta.derived[key] = plan_decode(
                meta.block_tables.index_select(0, meta.decode_rows),
                meta.context_lens.index_select(0, meta.decode_rows).tolist(),
                cache,
                group,
                meta.sliding_window,
            )
        decoded = run_decode(
            plan, q.index_select(0, meta.decode_tokens), cache, scale, meta.derived
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
            meta.derived,
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


@dataclass(frozen=True)
class SliceCall:
    """One kernel call over slots [a, b) of the cache, in place, for the rows that read
    exactly that slice (agents on one system prompt: all of them). The rows' queries are
    stacked `per_entry` rows to a batch entry of the call (the slice a stride-0 batch
    dimension), each entry padded with zero queries to `queries` (the last one's missing
    rows too)."""

    per_entry: int  # rows an entry: up to fold_rows(G) for rows' first runs, else 1
    queries: int  # queries an entry: per_entry * G, padded with zero queries to at least
    # invariant_queries for first runs
    a: int
    b: int
    rows: torch.Tensor  # [r] decode rows
    pieces: torch.Tensor  # [r] this slice's piece index in each row
    query_rows: torch.Tensor  # [entries * per_entry] rows of the queries (Bd: a zero row)
    entries: int


@dataclass(frozen=True)
class GatherCall:
    """One kernel call over copies of blocks: each row's blocks from its start column to
    its context's end, padded to the longest (masked)."""

    rows: torch.Tensor  # [g]
    pieces: torch.Tensor  # [g]
    blocks: torch.Tensor  # [g * n] block ids, row by row
    n: int  # blocks per row
    mask: torch.Tensor | None  # [g, 1, 1, n * bs] 0 / -inf; None: every key visible
    head_rows: torch.Tensor | None = None  # head-major cache: _head_rows of blocks


@dataclass(frozen=True)
class DecodePlan:
    """What paged_decode derives from a step's tables and context lengths alone: made once
    a step and run by every layer (each on its own cache)."""

    pieces: int  # most pieces of one row (merged by their log-sum-exp)
    gather_numel: int  # values of K and V that the largest GatherCall copies
    slices: tuple[SliceCall, ...]
    gathers: tuple[GatherCall, ...]


def fold_rows(group: int) -> int:
    """Rows of G = `group` queries each stacked into one batch entry of the in-place call
    over a row's first run (where a shared prefix lies): FOLD_QUERIES queries (whole rows),
    at least one row. Fewer rows on the slice make one entry of just them (padded to
    invariant_queries). A row's later runs (its own blocks, read by it alone) go one row an
    entry, unpadded: stacking would only pad them."""
    return max(1, FOLD_QUERIES // group)


def invariant_queries(dtype: torch.dtype, head_dim: int, most: int) -> int:
    """The fewest queries a batch entry of the fused kernel may hold (up to `most`, a full
    entry) from which every query gets the same bits whatever the entry's query count and
    its place in it; `most` where no smaller count does.

    The kernel runs its GEMMs on a block of the entry's queries, and the BLAS may take
    another path for few rows (on a Zen 1 EPYC with MKL: 1-3 rows round differently from
    4-16, which agree), so this is measured, once a process per dtype, head_dim and thread
    count (torch's, now), on random queries and keys of a few lengths: a count passes when
    each query's output and log-sum-exp equal, bit for bit, its own in a full entry, and a
    full entry reversed gives every query its bits. Where that fails, every entry is padded
    to `most` (the bits then depend on nothing but that constant count)."""
    return _probe(dtype, head_dim, most, torch.get_num_threads())


@functools.cache
def _probe(dtype: torch.dtype, head_dim: int, most: int, threads: int) -> int:
    """invariant_queries, measured under `threads` torch threads (the current count)."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1, 1, most, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    fewest = 1
    for keys_n in _PROBE_KEYS:
        keys, values = torch.randn(2, 1, 1, keys_n, head_dim, generator=gen).to(dtype)
        o, lse = _flash(full, keys, values, None, scale)
        o_rev, lse_rev = _flash(full.flip(2), keys, values, None, scale)
        if not (torch.equal(o, o_rev.flip(2)) and torch.equal(lse, lse_rev.flip(2))):
            return most
        count = most  # the fewest that passes at this length, every count above it too
        while count > fewest:
            o_c, lse_c = _flash(full[:, :, : count - 1], keys, values, None, scale)
            if not (
                torch.equal(o_c, o[:, :, : count - 1])
                and torch.equal(lse_c, lse[:, :, : count - 1])
            ):
                break
            count -= 1
        fewest = count
    return fewest


def plan_decode(
    tables: torch.Tensor,  # [Bd, max_blocks] int64 block ids (entries past a context unused)
    context_lens: Sequence[int],  # [Bd] keys per sequence, the query's own included
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D] (its geometry and dtype only)
    group: int,  # G: query heads per KV head
    sliding_window: int | None = None,
) -> DecodePlan:
    """Each row is cut into pieces by its own table only (never by its neighbours'):
    - a row of few blocks is gathered whole (a copy of its blocks, in groups of rows);
    - a row of at most MAX_RUNS runs of consecutive blocks: each run a piece, in place;
    - a row of more runs whose first run is long (agents on one system prompt: the shared
      prefix's blocks, then their own blocks between the other rows'): that run in place,
      the rest gathered as one more piece; else the whole row gathered.
    Rows whose in-place piece is the same slice of the cache (the shared prefix) are
    attended in one call (SliceCall); gathered pieces go in groups of similar lengths."""
    _, _, bs, h_kv, d = cache.shape
    bd = len(context_lens)
    device = tables.device
    firsts = [_first_block(c, bs, sliding_window) for c in context_lens]
    counts = [-(-c // bs) - f for c, f in zip(context_lens, firsts)]  # blocks to read
    runs = _runs(tables, firsts, counts, None)
    gathered: list[tuple[int, int, int]] = []  # (row, first column gathered, piece)
    # (slots a, b, a first run?) -> (row, piece): the rows that read cache slots [a, b)
    slices: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    pieces = 1
    for i, ctx in enumerate(context_lens):
        row_runs = runs[i]
        assert row_runs is not None
        if counts[i] < VIEW_MIN_BLOCKS or (
            len(row_runs) > MAX_RUNS and row_runs[0][1] - row_runs[0][0] < VIEW_MIN_BLOCKS
        ):
            gathered.append((i, firsts[i], 0))
            continue
        tail = len(row_runs) > MAX_RUNS
        if tail:
            # (a window starts inside the first run, before any gathered key)
            gathered.append((i, row_runs[0][1], 1))
            row_runs = row_runs[:1]
        lo = max(0, ctx - sliding_window) if sliding_window else 0
        for k, (col_a, col_b, block) in enumerate(row_runs):
            base = (block - col_a) * bs  # slot of position 0, were this run extended back
            p0, p1 = max(lo, col_a * bs), min(ctx, col_b * bs)  # its visible positions
            slices.setdefault((base + p0, base + p1, k == 0), []).append((i, k))
        pieces = max(pieces, len(row_runs) + tail)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    slice_calls = []
    folded = fold_rows(group)
    fewest = invariant_queries(cache.dtype, d, folded * group)
    for (a, b, first), members in slices.items():
        # first runs: up to `folded` rows an entry, at least `fewest` queries (zeros pad)
        per = min(folded, len(members)) if first else 1
        queries = max(per * group, fewest) if first else group
        entries = -(-len(members) // per)
        rows = [r for r, _ in members]
        slice_calls.append(
            SliceCall(
                per,
                queries,
                a,
                b,
                ints(rows),
                ints([k for _, k in members]),
                ints(rows + [bd] * (entries * per - len(rows))),
                entries,
            )
        )
    gather_calls = []
    block_bytes = 2 * bs * h_kv * d * cache.element_size()  # one block of K and V
    gather_counts = [-(-context_lens[i] // bs) - start for i, start, _ in gathered]
    for sub in decode_groups(gather_counts, block_bytes):
        members = [gathered[k] for k in sub]
        n = gather_counts[sub[0]]
        rows = [i for i, _, _ in members]
        cols = ints([start for _, start, _ in members])[:, None] + torch.arange(n, device=device)
        blocks = tables.index_select(0, ints(rows)).gather(1, cols.clamp_(max=tables.shape[1] - 1))
        mask = _decode_mask(
            [context_lens[i] for i in rows],
            [start * bs for _, start, _ in members],
            n * bs,
            sliding_window,
            device,
            cache.dtype,
        )
        flat = blocks.flatten()
        pieces_of = ints([k for _, _, k in members])
        gather_calls.append(
            GatherCall(ints(rows), pieces_of, flat, n, mask, _head_rows(cache[0], flat))
        )
    most = max((c.rows.numel() * c.n for c in gather_calls), default=0)
    gather_numel = 2 * most * bs * h_kv * d
    return DecodePlan(pieces, gather_numel, tuple(slice_calls), tuple(gather_calls))


def paged_decode(
    q: torch.Tensor,  # [Bd, H, D] one query token per sequence
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    tables: torch.Tensor,  # [Bd, max_blocks] int64 block ids (entries past a context unused)
    context_lens: Sequence[int],  # [Bd] keys per sequence, the query's own included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Bd, H, D]
    """One layer's decode attention, planned for this call alone (forward plans once a
    step): plan_decode, then run_decode."""
    plan = plan_decode(tables, context_lens, cache, q.shape[1] // cache.shape[3], sliding_window)
    return run_decode(plan, q, cache, scale)


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,  # [Bd, H, D]
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    scale: float,
    scratch: dict[object, object] | None = None,  # the step's (meta.derived): copies reuse it
) -> torch.Tensor:  # [Bd, H, D]
    """The plan's kernel calls on one layer's cache, each filling its rows' pieces, then one
    merge of every row's pieces by their log-sum-exp (a row of one piece: its bits as they
    came)."""
    _, _, bs, h_kv, d = cache.shape
    bd, num_heads = q.shape[0], q.shape[1]
    g = num_heads // h_kv
    group_q = q.view(bd, h_kv, g, d)  # [Bd, H_kv, G, D]
    o_parts = q.new_zeros(plan.pieces, bd, h_kv, g, d)
    lse_parts = torch.full((plan.pieces, bd, h_kv, g), float("-inf"), device=q.device)
    if plan.slices:
        padded_q = torch.cat([group_q, group_q.new_zeros(1, h_kv, g, d)])  # row Bd: zeros
        heads_k, heads_v = _slot_heads(cache[0]), _slot_heads(cache[1])  # [H_kv, slots, D]
    for s in plan.slices:
        e, r, per, pad = s.entries, s.rows.numel(), s.per_entry, s.queries - s.per_entry * g
        stacked = padded_q.index_select(0, s.query_rows).view(e, per, h_kv, g, d)
        stacked = stacked.transpose(1, 2).reshape(e, h_kv, per * g, d)
        if pad:
            stacked = F.pad(stacked, (0, 0, 0, pad))  # zero queries: [E, H_kv, queries, D]
        keys = heads_k[:, s.a : s.b][None].expand(e, -1, -1, -1)  # [E, H_kv, C, D] views
        values = heads_v[:, s.a : s.b][None].expand(e, -1, -1, -1)
        o, lse = _flash(stacked, keys, values, None, scale)
        o, lse = o[:, :, : per * g], lse[:, :, : per * g]
        o = o.reshape(e, h_kv, per, g, d).transpose(1, 2).reshape(e * per, h_kv, g, d)[:r]
        lse = lse.reshape(e, h_kv, per, g).transpose(1, 2).reshape(e * per, h_kv, g)[:r]
        o_parts.index_put_((s.pieces, s.rows), o)
        lse_parts.index_put_((s.pieces, s.rows), lse.float())
    buffer = _buffer(scratch, plan.gather_numel, cache) if plan.gathers else None
    for c in plan.gathers:
        rows = c.rows.numel()
        keys = _gather_heads(cache[0], c.blocks, buffer, 0, c.head_rows)
        values = _gather_heads(cache[1], c.blocks, buffer, 1, c.head_rows)
        keys = keys.view(h_kv, rows, c.n * bs, d).transpose(0, 1)
        values = values.view(h_kv, rows, c.n * bs, d).transpose(0, 1)
        o, lse = _flash(group_q.index_select(0, c.rows), keys, values, c.mask, scale)
        o_parts.index_put_((c.pieces, c.rows), o)
        lse_parts.index_put_((c.pieces, c.rows), lse.float())
    return _merge(o_parts, lse_parts).reshape(bd, num_heads, d)


def _flash(
    q: torch.Tensor,  # [g, H_kv, G, D]
    keys: torch.Tensor,  # [g, H_kv, L, D], any strides (fastest: each head's [L, D] contiguous)
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [g, 1, 1, L] 0 / -inf in q's dtype
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [g, H_kv, G, D], lse [g, H_kv, G] float32
    """The fused kernel behind scaled_dot_product_attention (the same bits), which also
    returns each query's log-sum-exp of its scores. The G query heads of a KV head go in as
    G queries of one head (a decode has no causal mask): the kernel then reads each key
    block once for all of them, not G times."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=mask, scale=scale
    )[:2]


def _merge(
    o_parts: torch.Tensor,  # [P, Bd, H_kv, G, D] each row's pieces (disjoint sets of its keys)
    lse_parts: torch.Tensor,  # [P, Bd, H_kv, G] float32; -inf where a row has fewer pieces
) -> torch.Tensor:  # [Bd, H_kv, G, D]
    """Every row's softmax over all its keys: each piece's output weighted by the share of
    its log-sum-exp, exactly up to rounding. A missing piece weighs exactly 0 and adds 0, so
    a row's bits do not depend on how many pieces its neighbours have."""
    if o_parts.shape[0] == 1:
        return o_parts[0]
    # over the last dim of a contiguous tensor: each row's softmax is then computed alike
    # whatever the batch (over dim 0 an element's exp takes the vector or the scalar path by
    # its place in the whole tensor, and a row's bits would change with its neighbours)
    weights = torch.softmax(lse_parts.permute(1, 2, 3, 0).contiguous(), dim=-1)
    weights = weights.permute(3, 0, 1, 2)  # [P, Bd, H_kv, G]
    return (o_parts.float() * weights[..., None]).sum(0).to(o_parts.dtype)


def _slot_heads(plane: torch.Tensor) -> torch.Tensor:  # [H_kv, (N + 1) * bs, D]
    """One plane [N + 1, bs, H_kv, D] as each head's slots: a view, in either memory order
    (for a head-major cache each head's slots are then one contiguous matrix)."""
    return plane.permute(2, 0, 1, 3).flatten(1, 2)


def _buffer(scratch: dict[object, object] | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of at least `numel` values of `like`'s dtype, kept in `scratch` (a
    step's metadata.derived) for every layer's copies: one allocation a step instead of two a
    layer. The server fixes glibc's mmap threshold at 1 MiB (ds4pool/allocator.py), so each
    fresh copy of a few MB was a new mapping, its pages faulted in and zeroed: 85k faults and
    a third more time a decode step (16 rows at 3.3k tokens, docs/BENCHMARKS.md)."""
    key = ("cpu_gather_buffer", like.dtype, like.device)
    found = scratch.get(key) if scratch is not None else None
    if isinstance(found, torch.Tensor) and found.numel() >= numel:
        return found
    made = torch.empty(numel, dtype=like.dtype, device=like.device)
    if scratch is not None:
        scratch[key] = made
    return made


def _head_rows(plane: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor | None:
    """For a head-major plane [N + 1, bs, H_kv, D]: the rows of it seen as
    [H_kv * (N + 1), bs * D] that hold `blocks` [n], head by head ([H_kv * n]); None for a
    token-major one. Made once a step (plan_decode) and read by every layer's K and V."""
    if not _head_major(plane):
        return None
    heads = torch.arange(plane.shape[2], device=blocks.device) * plane.shape[0]
    return (heads[:, None] + blocks[None]).flatten()


def _head_major(plane: torch.Tensor) -> bool:  # memory [H_kv, N + 1, bs, D], whole
    return plane.permute(2, 0, 1, 3).is_contiguous()


def _gather_heads(
    plane: torch.Tensor,
    blocks: torch.Tensor,
    buffer: torch.Tensor | None = None,  # flat: the copy goes to its half `half` (0 or 1)
    half: int = 0,
    head_rows: torch.Tensor | None = None,  # _head_rows(plane, blocks), where made already
) -> torch.Tensor:
    """Blocks [n] of one plane as [H_kv, n * bs, D], copied in the cache's memory order.

    Head-major cache: one index_select over the rows of [H_kv * (N + 1), bs * D] (a memcpy
    of bs * D values per head and block), and the kernel then reads each head's keys as one
    matrix. Over that flat first dim torch splits the copy across its threads; over dim 1 of
    [H_kv, N + 1, bs, D] it did not, and with two threads it took twice as long inside a
    step (docs/BENCHMARKS.md "a start-up thread probe"). Token-major: whole blocks, as main
    did (gathering it head-major would copy D values at a time, ~10x slower)."""
    slots, bs, h_kv, d = plane.shape
    n = blocks.numel()
    out = None
    if buffer is not None:
        size = n * bs * h_kv * d
        out = buffer[half * (buffer.numel() // 2) :][:size]
    if _head_major(plane):
        head_rows = _head_rows(plane, blocks) if head_rows is None else head_rows
        assert head_rows is not None
        flat = plane.permute(2, 0, 1, 3).view(h_kv * slots, bs * d)
        if out is not None:
            out = out.view(h_kv * n, bs * d)
        return torch.index_select(flat, 0, head_rows, out=out).view(h_kv, n * bs, d)
    if out is not None:
        out = out.view(n, bs, h_kv, d)
    return torch.index_select(plane, 0, blocks, out=out).permute(2, 0, 1, 3).flatten(1, 2)


def _decode_mask(
    ctx: list[int],  # per row: its context length
    starts: list[int],  # per row: the position of its first gathered key
    length: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor | None:  # [g, 1, 1, L] 0 = visible, -inf = not; None when all are
    window = sliding_window or 0
    if all(c - s == length and (not window or c - s <= window) for c, s in zip(ctx, starts)):
        return None
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
    ctx_t = torch.tensor(ctx, device=device)[:, None]
    visible = pos < ctx_t  # [g, L]
    if window:
        visible &= pos >= ctx_t - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]


def paged_prefill(
    q: torch.Tensor,  # [Q, H, D] one prompt chunk, at positions [C - Q, C)
    cache: torch.Tensor,  # [2, N_blocks, bs, H_kv, D]
    table: torch.Tensor,  # [max_blocks] int64 this sequence's block ids
    context_len: int,  # C: keys after this chunk was written
    scale: float,
    sliding_window: int | None = None,
    scratch: dict[object, object] | None = None,  # the step's (meta.derived): copies reuse it
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
        buffer = _buffer(scratch, 2 * n * bs * h_kv * d, cache)
        rows = _head_rows(cache[0], blocks)
        keys, values = (
            _gather_heads(cache[0], blocks, buffer, 0, rows),
            _gather_heads(cache[1], blocks, buffer, 1, rows),
        )
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
