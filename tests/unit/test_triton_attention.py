"""The Triton paged-attention kernels under Triton's CPU interpreter, against a float64 oracle.

TRITON_INTERPRET=1 only takes effect if it is set before the kernels are decorated, so the
cases run in one child interpreter (this file run as a script) and report one JSON line each;
the parent asserts per case. Skipped where triton is not installed (it is not in the test
extras: ~1 GB installed) or where its interpreter cannot run (triton < 3.9 with numpy >= 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tests.interpreter import interpreter_results, print_cases


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" (one query token per row) or "prefill"
    context_lens: list[int]
    query_lens: list[int] | None = None  # None: one token per row
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    block_n: int = 16
    block_m: int = 32  # prefill only
    partition_size: int = 512  # decode only
    # decode: a fixed split per row instead of partition_size; prefill: split-K over the keys
    num_partitions: int | None = None
    window: int | None = None
    strided_q: bool = False  # q as a slice of a wider (fused qkv-like) buffer
    dtype: str = "float32"  # float16 too; the interpreter's bf16 tl.dot is broken (triton 3.9)
    index64: bool = False  # int64 tables and lengths, as AttentionMetadata holds them
    workspace: bool = False  # decode: a preallocated scratch for a larger batch
    # prefill: the padding of a captured mixed step (mixed_batch.py): `pad_rows` decode rows
    # of context 0 before the last sequence (the chunk), and a sequence of `pad_tokens`
    # tokens with context 0 after it; real rows must not change, padding rows come out 0
    pad_rows: int = 0
    pad_tokens: int = 0
    # ... and `empty_rows` chunk rows of no token and context 0 before the padding sequence
    # (a graph of up to K chunks replaying a step of fewer)
    empty_rows: int = 0
    short_context: int = 0  # decode: rows up to this long stay one piece (the backend's 1,024)
    short_piece: int = 0  # decode: ... or pieces of this many keys (DecodeLaunch.short_piece)
    # prefill: the first `split_decode` sequences (one token each) through paged_decode, the
    # rest through paged_prefill over views past them (TritonPagedAttention's split_decode_rows)
    split_decode: int = 0
    # prefill: PrefillLaunch.small_m (sequences whose q_len x G rows fit run on a tile that small)
    small_m: int = 0

    @property
    def tolerance(self) -> float:
        # fp16: P is rounded to fp16 before the PV dot (as on the GPU)
        return 1e-4 if self.dtype == "float32" else 2e-3


CASES: dict[str, Case] = {
    # rows of 100 and 20 keys beside a 300-key row: 32-key pieces split the long one only
    # (the backend's rule at a smaller scale: 256-key pieces, rows <= 1,024 keys whole)
    "decode_short_rows_stay_whole": Case(
        "decode", [100, 300, 20, 0], partition_size=32, short_context=128, workspace=True
    ),
    # split-K: P = ceil(7 blocks * 16 / 32) = 4 partitions, ragged lengths, a padding row
    "decode_g1_d64_splitk": Case("decode", [1, 17, 40, 0, 100], heads=2, partition_size=32),
    "decode_g4_d128_splitk_tiles": Case(
        "decode", [5, 77, 130], head_dim=128, block_n=32, partition_size=64, strided_q=True
    ),
    # more partitions (19) than the reduce kernel's chunk of 16
    "decode_reduce_chunks": Case(
        "decode", [300, 2, 161], heads=4, partition_size=16, workspace=True
    ),
    # a fixed number of partitions per row, sized from each row's own context at run time
    "decode_fixed_p": Case("decode", [1, 17, 40, 0, 100, 300], heads=4, num_partitions=3),
    "decode_fixed_p_window": Case(
        "decode", [1, 20, 50, 97, 0, 260], heads=4, kv_heads=1, num_partitions=4, window=40
    ),
    "decode_fixed_p1_window": Case(
        "decode", [3, 70, 0], heads=4, kv_heads=1, num_partitions=1, window=33, workspace=True
    ),
    # one partition: the main kernel writes the output itself (incl. zeros for context 0)
    "decode_g8_bs32_direct": Case("decode", [33, 0, 64, 91], kv_heads=1, block_size=32, block_n=64),
    "decode_window_splitk": Case(
        "decode", [1, 20, 50, 97, 0], heads=4, kv_heads=1, partition_size=32, window=24
    ),
    # split table (P = 4): rows of one piece (short, or a window inside one partition of a
    # long row) are written by their own program, the reduce skips them
    "decode_one_piece_rows": Case(
        "decode",
        [400, 60, 0, 250, 129],
        kv_heads=1,
        partition_size=128,
        short_context=64,
        window=100,
        workspace=True,
    ),
    "decode_window_direct": Case("decode", [7, 45, 60], heads=4, kv_heads=1, block_n=32, window=20),
    # prompts, a chunk after a cached prefix, decode rows mixed in (q_len 1)
    "prefill_g4_mixed": Case("prefill", [1, 37, 20, 50], [1, 5, 20, 1], strided_q=True),
    "prefill_g1_d128_bs32": Case(
        "prefill", [17, 70], [17, 3], heads=2, head_dim=128, block_size=32, block_m=16, block_n=32
    ),
    "prefill_g8_window": Case("prefill", [40, 25, 30], [12, 1, 30], kv_heads=1, window=10),
    # a decode-only step through the prefill kernel: the tile shrinks from 128 to 16 rows
    "prefill_decode_rows": Case("prefill", [1, 37, 50], [1, 1, 1], block_m=128),
    # a window wide enough for unmasked tiles between its edge and the diagonal
    "prefill_window_mid": Case("prefill", [130, 70], [100, 70], kv_heads=1, window=40),
    # key tiles of 4 paged blocks: a tile's aligned start reaches blocks freed before the window
    "prefill_window_wide_tiles": Case(
        "prefill", [200, 90], [60, 90], kv_heads=1, block_n=64, window=50
    ),
    "decode_window_wide_tiles": Case(
        "decode", [300, 130, 7], block_n=64, partition_size=128, window=70
    ),
    # split-K prefill: a chunk after a long cached prefix and decode rows, 3 and 5 pieces
    # (more pieces than some rows' keys: those partials must weigh nothing)
    "prefill_split_chunk": Case(
        "prefill", [150, 7, 90, 1], [6, 1, 40, 1], heads=8, kv_heads=2, num_partitions=3
    ),
    "prefill_split_many": Case(
        "prefill", [260, 33], [20, 1], heads=4, kv_heads=1, block_n=32, num_partitions=5
    ),
    "prefill_split_window": Case(
        "prefill", [200, 90, 12], [30, 1, 12], kv_heads=1, block_n=32, window=50, num_partitions=4
    ),
    # DEEP_PREFILL's tiles (128 rows x 128 keys, Hopper's default): causal edges, a window
    # and split-K inside one key tile
    "prefill_deep_tiles": Case("prefill", [300, 140, 1], [70, 140, 1], block_m=128, block_n=128),
    "prefill_deep_tiles_window_split": Case(
        "prefill",
        [400, 50],
        [90, 1],
        kv_heads=1,
        block_m=128,
        block_n=128,
        window=150,
        num_partitions=3,
    ),
    "prefill_split_fp16": Case(
        "prefill", [120, 9], [10, 1], dtype="float16", num_partitions=2, strided_q=True
    ),
    "prefill_mixed_graph_padding": Case(
        "prefill", [40, 90, 150], [1, 1, 24], pad_rows=3, pad_tokens=8, num_partitions=3
    ),
    "prefill_mixed_graph_padding_unsplit": Case(
        "prefill", [33, 70], [1, 17], kv_heads=1, pad_rows=1, pad_tokens=15
    ),
    # two chunks and two empty chunk rows: a step of 2 chunks in a graph of up to 4
    "prefill_mixed_graph_chunks": Case(
        "prefill",
        [40, 90, 150, 61],
        [1, 1, 24, 9],
        pad_rows=2,
        empty_rows=2,
        pad_tokens=8,
        num_partitions=3,
    ),  # fmt: skip
    "prefill_mixed_graph_chunks_unsplit": Case(
        "prefill", [33, 200, 70], [1, 30, 17], kv_heads=1, empty_rows=3, pad_tokens=15
    ),
    # the backend's forward (TritonPagedAttention, its own launch choices) over a mixed step,
    # split (triton-split), in one launch, and in one with small decode tiles (triton-small):
    # each against the oracle
    "backend_mixed_step_split": Case(
        "backend", [40, 300, 1, 150, 37], [1, 1, 1, 20, 37], block_size=16
    ),
    # a mixed step split in two launches: decode rows by the decode kernel, the chunks by the
    # prefill kernel over q / out views from token 3 on (query_offset), with and without split-K
    "prefill_split_decode_rows": Case(
        "prefill", [40, 1, 300, 37, 20], [1, 1, 1, 5, 20], split_decode=3, strided_q=True
    ),
    "prefill_split_decode_rows_splitk_window": Case(
        "prefill",
        [150, 7, 90, 60],
        [1, 1, 40, 6],
        kv_heads=1,
        num_partitions=3,
        window=50,
        split_decode=2,
    ),
    "prefill_split_decode_rows_graph_padding": Case(
        "prefill",
        [40, 90, 150],
        [1, 1, 24],
        pad_rows=3,
        pad_tokens=8,
        num_partitions=3,
        split_decode=5,
    ),
    # the small tile (PrefillLaunch.small_m): decode rows and short queries (1, 2, 4 tokens
    # of G=4 heads in 16 rows) on 16-row tiles beside chunks on 64-row ones; a 5-token query
    # does not fit and keeps the large tile
    "prefill_small_tile_mixed": Case(
        "prefill",
        [40, 1, 300, 37, 20, 60, 9],
        [1, 1, 1, 4, 20, 5, 2],
        block_m=64,
        small_m=16,
        strided_q=True,
    ),
    # G=8 (2 tokens in 16 rows), split-K over a window
    "prefill_small_tile_splitk_window": Case(
        "prefill",
        [150, 7, 90, 60],
        [1, 1, 40, 2],
        kv_heads=1,
        num_partitions=3,
        window=50,
        small_m=16,
    ),
    # a captured mixed step's padding rows (context 0) on the small tile come out 0
    "prefill_small_tile_graph_padding": Case(
        "prefill",
        [40, 90, 150],
        [1, 1, 24],
        pad_rows=3,
        pad_tokens=8,
        num_partitions=3,
        small_m=16,
    ),
    # Hopper's deep launch (128 x 128 tiles) with 32-row small tiles, fp16
    "prefill_small_tile_deep_fp16": Case(
        "prefill",
        [300, 140, 1, 77],
        [70, 140, 1, 1],
        block_m=128,
        block_n=128,
        small_m=32,
        dtype="float16",
    ),
    "decode_fp16_int64": Case(
        "decode", [5, 70, 0, 33], partition_size=32, dtype="float16", index64=True
    ),
    "prefill_fp16_int64": Case(
        "prefill", [40, 20, 9], [3, 20, 1], dtype="float16", index64=True, window=16
    ),
}


# The decode table's launches (kernels/triton_decode_configs.py): (block_n, short_piece) pairs
# that take every block_n and short_piece its sweep tries at least once (num_warps and
# num_stages change the compiled code only, which the interpreter does not run), over a table
# wider than short_context: a long row split by partition_size, short rows whole or in pieces
# (the windowed pair: pieces and a long row's partition wholly before the window are skipped).
CONFIG_PAIRS = ((16, 0), (32, 64), (64, 256), (128, 128))
CONFIG_WINDOW = {(32, 64): 60}


def _config_cases() -> dict[str, Case]:
    try:  # the table's own arithmetic too, whatever a sweep pasted there
        from ds4pool.model.kernels.triton_decode_configs import DECODE_TABLE
    except ImportError:  # no triton: the module skips
        return {}
    pairs = dict.fromkeys([*CONFIG_PAIRS, (DECODE_TABLE.block_n, DECODE_TABLE.short_piece)])
    return {
        f"decode_config_n{n}_piece{p}": Case(
            "decode",
            [200, 100, 17, 0],
            heads=4,
            kv_heads=1,
            head_dim=32,
            block_n=n,
            partition_size=128,
            short_context=128,
            short_piece=p,
            window=CONFIG_WINDOW.get((n, p)),
        )  # fmt: skip
        for n, p in pairs
    }


CASES |= _config_cases()


def _run_case(name: str) -> dict:
    import torch

    from ds4pool.model.kernels import triton_attention as ta
    from tests.paged_cases import (
        drop_blocks_before_window,
        make_case,
        poison_unused_slots,
        reference,
        rel_err,
    )

    c = CASES[name]
    q_lens = c.query_lens or [1] * len(c.context_lens)
    layout = dict(heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, block_size=c.block_size)
    case = make_case(
        q_lens, c.context_lens, **layout, dtype=getattr(torch, c.dtype), seed=len(name)
    )
    if c.index64:
        case = replace(
            case,
            block_tables=case.block_tables.long(),
            query_start=case.query_start.long(),
            context_lens=case.context_lens.long(),
        )
    poison_unused_slots(case)  # the kernels must not read past a row's context
    if c.window:  # nor blocks before every query's window
        drop_blocks_before_window(case, c.window)
    q = case.q
    if c.strided_q:  # row stride != H * D
        wide = torch.zeros(q.shape[0], q.shape[1] + 3, q.shape[2], dtype=q.dtype)
        wide[:, : q.shape[1]] = q
        q = wide[:, : q.shape[1]]
    out = torch.full_like(case.q, float("nan"))  # unwritten elements stay NaN
    k_cache, v_cache = case.cache[0], case.cache[1]
    if c.kind == "decode":
        parts = c.num_partitions or ta.decode_num_partitions(
            case.block_tables.shape[1], c.block_size, c.partition_size
        )
        workspace = ta.decode_workspace(q.shape[0] + 5, c.heads, c.head_dim, parts, q.device)
        ta.paged_decode(
            q, k_cache, v_cache, case.block_tables, case.context_lens, case.scale, out,
            sliding_window=c.window, partition_size=c.partition_size,
            num_partitions=c.num_partitions,
            launch=ta.DecodeLaunch(block_n=c.block_n, short_piece=c.short_piece),
            workspace=workspace if c.workspace else None, short_context=c.short_context,
        )  # fmt: skip
        if c.short_context:
            solo = _short_rows_solo_equal(c, case, q, out)
        if c.num_partitions is None:
            whole = _one_piece_rows_equal_whole(c, case, q, out)
    elif c.kind == "backend":
        return _run_backend(name, c, case, q_lens)
    elif c.pad_rows or c.pad_tokens or c.empty_rows:
        return _run_padded(name, c, case, q_lens)
    else:
        _prefill(
            c, q, k_cache, v_cache, case.block_tables, case.query_start, case.context_lens,
            max(q_lens), case.scale, out,
        )  # fmt: skip
    ref = reference(case, c.window)
    empty_rows = [i for i, n in enumerate(c.context_lens) if n == 0]
    return {
        "name": name,
        "rel": rel_err(out, ref),
        "tolerance": c.tolerance,
        "finite": bool(torch.isfinite(out).all()),
        "empty_zero": bool((out[empty_rows] == 0).all()) if empty_rows else True,
        "short_rows_solo_equal": solo if c.kind == "decode" and c.short_context else None,
        "one_piece_equal_whole": whole if c.kind == "decode" and not c.num_partitions else None,
    }


def _run_backend(name: str, c: Case, case: object, q_lens: list[int]) -> dict:
    """TritonPagedAttention.forward over the case as one mixed step, with and without
    split_decode_rows (metadata from build_metadata, the KV already in the cache)."""
    import torch

    from ds4pool.model.attention_triton import TritonPagedAttention
    from ds4pool.model.kernels import triton_attention as ta
    from tests.paged_cases import case_metadata, reference, rel_err

    meta = case_metadata(case, c.window, torch.int32)
    k = case.q[:, : c.kv_heads]  # its shape only: the K/V are in the cache (kv_stored)
    ref = reference(case, c.window)
    rel = {}
    # one launch, split, and one launch with the decode rows on small tiles (triton-small),
    # under both prefill launches a device may get
    for split, small in ((False, 0), (True, 0), (False, 16)):
        for launch in (ta.DEFAULT_PREFILL, ta.DEEP_PREFILL):
            backend = TritonPagedAttention(
                split_decode_rows=split, num_sms=132, prefill_launch=launch, small_m=small
            )
            out = backend.forward(case.q, k, k, case.cache, meta, case.scale, kv_stored=True)
            rel[split, small, launch] = rel_err(out, ref)
    return {
        "name": name,
        "rel": max(rel.values()),
        "tolerance": c.tolerance,
        "finite": True,
        "empty_zero": True,
        "lead_decode_rows": meta.lead_decode_rows,
    }


def _prefill(
    c: Case, q: object, k_cache: object, v_cache: object, tables: object, starts: object,
    lens: object, max_q: int, scale: float, out: object,
) -> None:  # fmt: skip
    """paged_prefill over every sequence, or (split_decode) paged_decode over the leading
    decode rows and paged_prefill over the views past them, as the backend launches them."""
    from ds4pool.model.kernels import triton_attention as ta

    nd = c.split_decode
    if nd:
        assert starts[nd].item() == nd, "the leading rows must have one token each"
        ta.paged_decode(
            q[:nd], k_cache, v_cache, tables[:nd], lens[:nd], scale, out[:nd],
            sliding_window=c.window, partition_size=c.partition_size,
            launch=ta.DecodeLaunch(block_n=c.block_n),
        )  # fmt: skip
    ta.paged_prefill(
        q[nd:], k_cache, v_cache, tables[nd:], starts[nd:], lens[nd:], max_q, scale, out[nd:],
        sliding_window=c.window,
        launch=ta.PrefillLaunch(block_m=c.block_m, block_n=c.block_n, small_m=c.small_m),
        num_partitions=c.num_partitions or 1, query_offset=nd,
    )  # fmt: skip


def _one_piece_rows_equal_whole(c: Case, case: object, q: object, batched: object) -> bool:
    """A row whose visible keys fall in one piece of a split launch (its program writes the
    output itself, the reduce skips it) gives bit for bit what the unsplit launch (one
    program per row, no reduce) gives it."""
    import torch

    from ds4pool.model.kernels import triton_attention as ta

    same = True
    for i, n in enumerate(c.context_lens):
        short = c.short_context and n <= c.short_context
        length = (c.short_piece or c.short_context) if short else c.partition_size
        lo = max(n - c.window, 0) if c.window else 0
        if n == 0 or lo // length != (n - 1) // length:
            continue
        width = -(-n // c.block_size)
        whole = -(-width * c.block_size // c.block_n) * c.block_n  # one partition: P = 1
        out = torch.full_like(batched[i : i + 1], float("nan"))
        ta.paged_decode(
            q[i : i + 1], case.cache[0], case.cache[1], case.block_tables[i : i + 1, :width],
            case.context_lens[i : i + 1], case.scale, out, sliding_window=c.window,
            partition_size=whole, launch=ta.DecodeLaunch(block_n=c.block_n),
        )  # fmt: skip
        same = same and torch.equal(out, batched[i : i + 1])
    return same


def _short_rows_solo_equal(c: Case, case: object, q: object, batched: object) -> bool:
    """Each row of <= short_context keys, launched alone over its own narrow table (as the
    backend launches a table <= short_context: partition_size = short_context), gives bit for
    bit what it gave in the wide split batch."""
    import torch

    from ds4pool.model.kernels import triton_attention as ta

    same = True
    for i, n in enumerate(c.context_lens):
        if not 0 < n <= c.short_context:
            continue
        width = -(-n // c.block_size)
        out = torch.full_like(batched[i : i + 1], float("nan"))
        ta.paged_decode(
            q[i : i + 1], case.cache[0], case.cache[1], case.block_tables[i : i + 1, :width],
            case.context_lens[i : i + 1], case.scale, out, sliding_window=c.window,
            partition_size=c.short_context, short_context=c.short_context,
            launch=ta.DecodeLaunch(block_n=c.block_n, short_piece=c.short_piece),
        )  # fmt: skip
        same = same and torch.equal(out, batched[i : i + 1])
    return same


def _run_padded(name: str, c: Case, case: object, q_lens: list[int]) -> dict:
    """The mixed-graph layout: [seqs but the last][pad_rows x (q 1, ctx 0)][last]
    [empty_rows x (q 0, ctx 0)][pad seq]."""
    import torch

    from tests.paged_cases import reference, rel_err

    n_real = sum(q_lens)
    head_tokens = n_real - q_lens[-1]
    pad_q = torch.randn(c.pad_rows + c.pad_tokens, c.heads, c.head_dim).to(case.q.dtype)
    q = torch.cat([case.q[:head_tokens], pad_q[: c.pad_rows], case.q[head_tokens:],
                   pad_q[c.pad_rows:]])  # fmt: skip
    tail = [0] * c.empty_rows + ([c.pad_tokens] if c.pad_tokens else [])  # q lens
    lens = q_lens[:-1] + [1] * c.pad_rows + q_lens[-1:] + tail
    ctx = case.context_lens.tolist()
    ctx = ctx[:-1] + [0] * c.pad_rows + ctx[-1:] + [0] * len(tail)
    tables = case.block_tables.tolist()
    zero = [0] * len(tables[0])
    tables = tables[:-1] + [zero] * c.pad_rows + tables[-1:] + [zero] * len(tail)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    out = torch.full_like(q, float("nan"))
    _prefill(
        c, q, case.cache[0], case.cache[1], torch.tensor(tables, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
        max(lens), case.scale, out,
    )  # fmt: skip
    pad = torch.zeros(out.shape[0], dtype=torch.bool)
    pad[head_tokens : head_tokens + c.pad_rows] = True
    pad[head_tokens + c.pad_rows + q_lens[-1] :] = True
    return {
        "name": name,
        "rel": rel_err(out[~pad], reference(case, c.window)),
        "tolerance": c.tolerance,
        "finite": bool(torch.isfinite(out).all()),
        "empty_zero": bool((out[pad] == 0).all()),
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_oracle(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["finite"], "an output element was left unwritten (NaN) or overflowed"
    assert r["empty_zero"], "rows with context 0 must come back as zeros"
    assert r["rel"] < r["tolerance"], r
    assert r.get("short_rows_solo_equal") in (None, True), "a short row depends on its batch"
    assert r.get("one_piece_equal_whole") in (None, True), "a one-piece row differs unsplit"
    assert r.get("lead_decode_rows") in (None, 3), "the backend case's leading decode rows"


if __name__ == "__main__":
    print_cases(CASES, _run_case)
