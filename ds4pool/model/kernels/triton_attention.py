"""Triton paged attention: split-K decode and varlen causal prefill over the paged KV cache.

Layout (shared with `ds4pool.model.attention`): one layer's cache is [2, N, bs, H_kv, D];
k_cache = cache[0] and v_cache = cache[1] are [N, bs, H_kv, D] views. Token p of a sequence
lives in block block_table[p // bs] at offset p % bs. Both kernels read K/V through the block
table one token row (D contiguous elements) at a time, so a tile of BLOCK_N keys may span
BLOCK_N / bs paged blocks in any order; nothing is ever gathered into a contiguous copy.

GQA: G = H / H_kv query heads share a kv head. A program always owns one kv head and all G of
its query heads, so every K/V element is read once per program, not once per query head.

Decode (one query token per sequence) is memory bound: its cost is reading K/V once. With one
program per (sequence, kv head) a batch of 1-8 long contexts fills only 8-64 of the GPU's SMs,
so the context is split into partitions of `partition_size` tokens (flash-decoding, split-K):
grid (B, H_kv, P). Each program runs an online softmax over its partition with a q tile
[G padded to 16, D] against k tiles [BLOCK_N, D] (tensor-core tl.dot), and writes a partial
output normalised by its own sum plus the partition's log-sum-exp. A small reduce kernel,
grid (B, H), combines the P partials with weights exp(lse_p - max lse). When P == 1 the main
kernel writes the output directly and no reduce runs; with P > 1 so does the program of a
row whose visible keys lie in one partition (a short row, a window inside one piece), and the
reduce exits at once for that row (`_tiles.partition_bounds` decides both). P and the
partition length are runtime arguments (only "P > 1" is a compile-time flag), so new context
and batch buckets do not recompile the kernels. With a wide persistent block table (sized
for the longest context) and short contexts, most of those P programs would exit at once;
`num_partitions=` fixes P instead and each row cuts its own visible context into P equal
pieces at run time (still one grid per shape, graph safe).

Prefill is compute bound: flash-attention tiles of BLOCK_M query rows x BLOCK_N keys, where
the M rows fold BLOCK_M // G query tokens x G heads of one kv head (row m is token m // G,
head m % G), so K/V tiles are shared by the G heads without repeating them. Grid
(S, ceil(max_query_len / BLOCK_Q), H_kv). The new tokens of sequence s sit at positions
[ctx - q_len, ctx); a query tile walks its key tiles in three runs: the few crossed by the
sliding window's lower edge (masked), those every row sees in full (no mask), and the few on
the causal diagonal (masked); tiles above the diagonal or before the window are never visited.
The longest (last) query tiles launch first. q_len = 1 rows work, so a mixed step can use
this kernel for all its tokens (a step of single tokens gets a 16-row tile). A short chunk (or
a few decode rows) over a long cached context has few tiles, so with `num_partitions` P > 1 the
grid becomes (S * P, tiles, H_kv): program p walks the p-th of P equal, BLOCK_N-aligned shares
of its tile's keys (the three runs clipped to it) and writes a partial normalised by its own
sum plus its log-sum-exp (-inf for a row that saw no key there) into [T, H, P, D] scratch; a
reduce kernel, grid (T, H), combines them. On the H200 a 64-token chunk at a 16k context took
17.8 ms of prefill-kernel time per step (32 layers) with 16 programs walking 16k keys each.

CUDA-graph safety: every grid and scratch size derives from tensor SHAPES and host ints
(max_blocks, B, H, max_query_len), never from the values in context_lens / query_start /
block_tables, so a launch can be captured once and replayed with new values written into the
same buffers. Programs whose partition or query tile lies past their row's data exit early;
rows with context_len 0 (padding rows of a graph bucket) write zeros. No host syncs.
Scratch for the partials is allocated with torch.empty in the call (captured graphs keep the
allocation in their private pool) unless a `DecodeWorkspace` is passed.

Accumulation is fp32 for bf16/fp16 inputs; fp32 inputs use IEEE fp32 dots (no TF32).

`paged_decode(prologue=...)` has the decode kernel do a decode-only step's attention prologue
too (q/k norm, RoPE, k/v store: triton_prologue.DecodePrologue, one launch fewer a layer).

This module is the API (launch parameters, shape checks, grids); the kernels live in
`_decode_kernels`, `_prefill_kernels` and `_tiles` (paged tile loads, online-softmax step).
tests/unit/test_triton_compile.py compiles them for sm_90 on a CPU-only machine and checks
that the K/V loads are software-pipelined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ds4pool.model.kernels._decode_kernels import decode_kernel, decode_reduce_kernel
from ds4pool.model.kernels._pdl import launch_options
from ds4pool.model.kernels._prefill_kernels import prefill_kernel, prefill_reduce_kernel
from ds4pool.model.kernels.triton_prologue import DecodePrologue, no_decode_prologue

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of the decode kernel (partition_size must be a multiple of block_n).

    short_piece: keys per split-K piece of a row of <= short_context keys (a multiple of
    block_n; 0: such a row is one piece). block_n, num_warps and short_piece set the order in
    which a short row's keys are summed, so the backend keeps them the same for every batch
    and table width (kernels/triton_decode_configs.py)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    short_piece: int = 0

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16: {self}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two, num_stages >= 1: {self}")
        if self.short_piece < 0 or self.short_piece % self.block_n:
            raise ValueError(f"short_piece must be 0 or a multiple of block_n: {self}")


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch parameters of the prefill kernel: BLOCK_M rows (tokens x heads) by BLOCK_N keys.

    small_m: rows of the tile of a sequence whose query rows (q_len x G) fit in it, a mixed
    step's decode rows above all (G live rows of BLOCK_M otherwise, each such program as
    costly as a chunk's: run K's profile); 0: every sequence on the launch's BLOCK_M rows.
    A power of two >= 16; it applies only where the launch's BLOCK_M is larger."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    small_m: int = 0

    def __post_init__(self) -> None:
        if self.small_m and (self.small_m < 16 or self.small_m & (self.small_m - 1)):
            raise ValueError(f"small_m must be 0 or a power of two >= 16: {self}")


DEFAULT_DECODE = DecodeLaunch()
DEFAULT_PREFILL = PrefillLaunch()
# 128-key tiles through a 3-deep K/V pipeline: 161 KB of shared memory a program on sm_90
# (tests/unit/test_triton_compile.py checks the figure), 1.25-1.31x faster than
# DEFAULT_PREFILL on the H200 (docs/BENCHMARKS.md, run L: a 16k prompt 5.54 vs 6.92 ms a layer)
DEEP_PREFILL = PrefillLaunch(block_n=128, num_stages=3)
DEEP_PREFILL_SHARED = 164_864  # bytes


def prefill_launch(capability: tuple[int, int], shared_optin: int) -> PrefillLaunch:
    """The prefill launch for a device: DEEP_PREFILL on Hopper and later where a program may
    use its shared memory (measured there), DEFAULT_PREFILL elsewhere (Ampere and consumer
    cards have less; their figures are not measured)."""
    if capability >= (9, 0) and shared_optin >= DEEP_PREFILL_SHARED:
        return DEEP_PREFILL
    return DEFAULT_PREFILL


DEFAULT_PARTITION = 512
# The backend's `short_context`: a decode row of at most this many tokens is never split.
SHORT_CONTEXT = 1024


@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated split-K scratch: out [B, H, P, D] fp32 and lse [B, H, P] fp32."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> tuple[int, int, int]:
    n_heads, d = q.shape[1], q.shape[2]
    _, _, h_kv, d_kv = k_cache.shape
    assert v_cache.shape == k_cache.shape and d_kv == d, (q.shape, k_cache.shape)
    assert n_heads % h_kv == 0, (n_heads, h_kv)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, q.shape)
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    return n_heads, h_kv, d


def decode_num_partitions(
    max_blocks: int, block_size: int, partition_size: int, short_context: int = 0,
    short_piece: int = 0,
) -> int:  # fmt: skip
    """P of the split-K grid: from shapes only, so it is fixed for a captured graph. Enough
    for the widest row and, with `short_context`, for a short row cut in `short_piece`s."""
    width = max_blocks * block_size
    parts = max(1, -(-width // partition_size))
    if short_context and short_piece:
        parts = max(parts, -(-min(width, short_context) // short_piece))
    return parts


def auto_num_partitions(batch: int, kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """A `num_partitions` for `paged_decode` from shapes only (graph safe).

    About 4 programs per SM, no more partitions than 256-token pieces of the table's full
    width (max_tokens = max_blocks * block_size), at most 256.
    """
    want = -(-4 * num_sms // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_tokens // 256), 256))


def decode_workspace(
    batch: int, heads: int, head_dim: int, num_partitions: int, device: torch.device
) -> DecodeWorkspace:
    """Scratch for `paged_decode`, e.g. allocated once per CUDA-graph bucket and reused by layers.

    num_partitions = decode_num_partitions(max_blocks, block_size, partition_size).
    """
    return DecodeWorkspace(
        torch.empty((batch, heads, num_partitions, head_dim), dtype=torch.float32, device=device),
        torch.empty((batch, heads, num_partitions), dtype=torch.float32, device=device),
    )


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, bs, H_kv, D]
    v_cache: torch.Tensor,  # [N, bs, H_kv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (or int64)
    context_lens: torch.Tensor,  # [B] int32 (or int64), incl. the query's own token
    scale: float,
    out: torch.Tensor,  # [B, H, D], written in place
    *,
    sliding_window: int | None = None,
    partition_size: int = DEFAULT_PARTITION,
    num_partitions: int | None = None,
    launch: DecodeLaunch = DEFAULT_DECODE,
    workspace: DecodeWorkspace | None = None,
    short_context: int = 0,
    prologue: DecodePrologue | None = None,
) -> None:
    """Attention of one query token per sequence over its paged context (split-K).

    With `prologue` the kernel does the attention prologue too (triton_prologue.py: q/k norm,
    RoPE, the store of this step's k, v at `prologue.slots`): q is then the raw q view
    (before norm and RoPE), and the caches must be the dense views of a KVLayout "kv" cache.

    `short_context` (partition_size mode): a row of at most that many tokens is one piece
    (or pieces of `launch.short_piece` keys) whatever the table width, so its result does not
    depend on the rows beside it (the backend passes SHORT_CONTEXT; 0 splits every row by
    partition_size).

    By default the context splits into partitions of `partition_size` tokens, as many as the
    table width allows (P = ceil(max_blocks * bs / partition_size)). With `num_partitions`
    instead, every row splits its own visible context into that many equal, BLOCK_N-aligned
    partitions at run time: the grid stays fixed (graph safe) while wide persistent tables with
    short contexts launch no idle programs (see `auto_num_partitions`).
    """
    n_heads, h_kv, d = _check_common(q, k_cache, v_cache, out)
    batch, max_blocks = block_tables.shape
    bs = k_cache.shape[1]
    assert q.shape[0] == batch == context_lens.shape[0], (q.shape, block_tables.shape)
    assert block_tables.stride(1) == 1 and context_lens.stride(0) == 1
    assert partition_size % launch.block_n == 0, (partition_size, launch.block_n)
    if batch == 0:
        return
    g = n_heads // h_kv
    fixed_p = num_partitions is not None
    short = short_context if not fixed_p else 0
    short_len = launch.short_piece or short
    assert short_len % launch.block_n == 0, (short_len, launch.block_n)
    num_parts = decode_num_partitions(max_blocks, bs, partition_size, short, launch.short_piece)
    if num_partitions is not None:
        num_parts = num_partitions
    assert num_parts >= 1, num_parts
    if workspace is None and num_parts > 1:
        workspace = decode_workspace(batch, n_heads, d, num_parts, q.device)
    if workspace is not None:
        expect = (batch, n_heads, num_parts, d)
        assert workspace.partial_out.shape[1:] == expect[1:], (workspace.partial_out.shape, expect)
        assert workspace.partial_out.shape[0] >= batch and workspace.partial_out.is_contiguous()
        assert workspace.partial_lse.shape[1:] == expect[1:3]
        assert workspace.partial_lse.is_contiguous()
    part_out = workspace.partial_out if workspace is not None else out
    part_lse = workspace.partial_lse if workspace is not None else out
    window = sliding_window or 0
    d_pad = triton.next_power_of_2(d)
    pro_args, pro_consts = no_decode_prologue(q, context_lens), {}
    if prologue is not None:
        assert prologue.k.shape == (batch, h_kv, d), (prologue.k.shape, q.shape)
        pro_args, pro_consts = prologue.launch_args(k_cache, v_cache)
    decode_kernel[(batch, h_kv, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_parts, partition_size,
        short_len or partition_size, *pro_args,
        H=n_heads, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad, BS=bs,
        BLOCK_N=launch.block_n, SHORT=short, FIXED_P=fixed_p,
        SPLIT=num_parts > 1,
        USE_WINDOW=window > 0, PRECISION=_precision(q.dtype), **pro_consts,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        **launch_options(prologue is not None and prologue.pdl),
    )  # fmt: skip
    if num_parts == 1:
        return
    decode_reduce_kernel[(batch, n_heads)](
        part_out, part_lse, context_lens, out, window, out.stride(0), out.stride(1), num_parts,
        partition_size, short_len or partition_size,
        H=n_heads, D=d, D_PAD=d_pad, SHORT=short, BLOCK_N=launch.block_n,
        FIXED_P=fixed_p, P_CHUNK=16,
        USE_WINDOW=window > 0, DIRECT=True, num_warps=4,
    )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H_kv, D]
    v_cache: torch.Tensor,  # [N, bs, H_kv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32 (or int64)
    query_start: torch.Tensor,  # [S + 1] int32 (or int64)
    context_lens: torch.Tensor,  # [S] int32 (or int64), after this step
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    *,
    sliding_window: int | None = None,
    launch: PrefillLaunch = DEFAULT_PREFILL,
    num_partitions: int = 1,
    query_offset: int = 0,
) -> None:
    """Causal varlen attention of each sequence's new tokens over its paged context.

    query_offset: query_start's value of q's first row, where q and out are views that start
    past other sequences' tokens (a mixed step's decode rows, attended by `paged_decode`).

    max_query_len must be >= every q_len (it sizes the grid; rows past it are not computed).
    num_partitions > 1 splits every query tile's keys into that many equal pieces, one
    program each, and a reduce kernel combines their partials (split-K: a short chunk over a
    long cached context would otherwise run a handful of programs, each over every key; see
    `prefill_num_partitions`).
    """
    n_heads, h_kv, d = _check_common(q, k_cache, v_cache, out)
    n_seqs = block_tables.shape[0]
    assert query_start.shape[0] == n_seqs + 1 == context_lens.shape[0] + 1
    assert block_tables.stride(1) == 1
    if n_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return
    g = n_heads // h_kv
    block_m = prefill_block_m(max_query_len, g, launch)
    block_q = block_m // g
    num_warps = launch.num_warps if block_m >= 64 else min(launch.num_warps, 4)
    window = sliding_window or 0
    parts = max(1, num_partitions)
    split = parts > 1
    tokens, d_pad = q.shape[0], triton.next_power_of_2(d)
    part_out = part_lse = out  # unused unless split
    if split:
        part_out = torch.empty((tokens, n_heads, parts, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((tokens, n_heads, parts), dtype=torch.float32, device=q.device)
    # the small tile where it is smaller than this launch's and holds a token's G heads
    small_m = launch.small_m if max(16, g) <= launch.small_m < block_m else 0
    grid = (n_seqs * parts, math.ceil(max_query_len / block_q), h_kv)
    prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out, part_out, part_lse,
        scale * _LOG2E, window, parts, n_heads, query_offset,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, D=d, D_PAD=d_pad, BS=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=launch.block_n,
        USE_WINDOW=window > 0, PRECISION=_precision(q.dtype), SPLIT=split, SMALL_M=small_m,
        num_warps=num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if split:
        prefill_reduce_kernel[(tokens, n_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), parts,
            H=n_heads, D=d, D_PAD=d_pad, P_CHUNK=16, num_warps=4,
        )  # fmt: skip


def prefill_block_m(max_query_len: int, group: int, launch: PrefillLaunch = DEFAULT_PREFILL) -> int:
    """Rows of a prefill tile: short queries (decode rows, q_len * G <= 16) get a 16-row tile
    instead of wasting most of BLOCK_M; the tile never drops below one token's G heads."""
    rows = max(triton.next_power_of_2(max_query_len * group), 16)
    return max(min(launch.block_m, rows), triton.next_power_of_2(group), 16)


def prefill_num_partitions(
    programs: int, max_context: int, num_sms: int, min_partition: int = 512
) -> int:
    """Split-K factor for `paged_prefill` (eager steps, so host values may decide it):
    fewer than 2 live (query tile, kv head) programs per SM leave SMs idle, so split each
    tile's keys until there are about 4 per SM, in pieces of at least `min_partition` keys,
    at most 64 (the reduce reads P partials per row)."""
    if programs >= 2 * num_sms:
        return 1
    want = -(-4 * num_sms // max(1, programs))
    return max(1, min(want, max_context // min_partition, 64))
