"""The Triton paged-attention kernels on a CUDA GPU against the torch reference backend.

Real model shapes (llama3-8b: H=32, H_kv=8, D=128; the 100m demo: D=64), bf16, shuffled block
tables; plus CUDA-graph capture and replay of decode with new values in the same buffers.
"""

from __future__ import annotations

import pytest
import torch

from tests.paged_cases import (
    PagedCase,
    make_case,
    poison_unused_slots,
    reference,
    rel_err,
    torch_reference,
)

pytestmark = pytest.mark.cuda
ta = pytest.importorskip("ds4pool.model.kernels.triton_attention")

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128)


def run_decode(case: PagedCase, window: int | None = None, **kwargs: object) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    ta.paged_decode(
        case.q, case.cache[0], case.cache[1], case.block_tables, case.context_lens,
        case.scale, out, sliding_window=window, **kwargs,
    )  # fmt: skip
    return out


def run_prefill(case: PagedCase, window: int | None = None, parts: int = 1) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    ta.paged_prefill(
        case.q, case.cache[0], case.cache[1], case.block_tables, case.query_start,
        case.context_lens, max(case.query_lens), case.scale, out, sliding_window=window,
        num_partitions=parts,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    "shape, block_size, window, partition",
    [
        (LLAMA3_8B, 16, None, 512),
        (LLAMA3_8B, 32, None, 256),
        (dict(heads=8, kv_heads=8, head_dim=64), 16, None, 512),  # G=1, D=64
        (LLAMA3_8B, 16, 700, 512),
    ],
)
def test_decode_matches_torch_backend(
    shape: dict, block_size: int, window: int | None, partition: int
) -> None:
    ctx = [1, 15, 16, 17, 300, 513, 1000, 2049, 4000, 777, 64, 3]
    case = make_case([1] * len(ctx), ctx, **shape, block_size=block_size, dtype=torch.bfloat16,
                     device="cuda", seed=block_size)  # fmt: skip
    out = run_decode(case, window, partition_size=partition)
    ref = torch_reference(case, window)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.double().cpu()) < 1e-2


def test_decode_padding_rows_write_zeros() -> None:
    case = make_case([1] * 4, [0, 900, 0, 5], **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda")  # fmt: skip
    poison_unused_slots(case)  # NaN wherever no row's context reaches: never read
    out = run_decode(case, partition_size=256)
    assert (out[[0, 2]] == 0).all() and torch.isfinite(out).all()
    assert rel_err(out, reference(case)) < 1e-2


@pytest.mark.parametrize("window", [None, 500])
def test_decode_fixed_partitions_on_a_wide_table(window: int | None) -> None:
    """num_partitions: each row splits its own context; the table is 4x wider than needed."""
    ctx = [1, 40, 700, 3000, 0, 129]
    case = make_case([1] * len(ctx), ctx, **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=4)  # fmt: skip
    wide = torch.zeros(len(ctx), 4 * case.block_tables.shape[1], dtype=torch.int32, device="cuda")
    wide[:, : case.block_tables.shape[1]] = case.block_tables
    case = PagedCase(case.q, case.cache, wide, case.query_start, case.context_lens,
                     case.query_lens, case.scale)  # fmt: skip
    poison_unused_slots(case)
    parts = ta.auto_num_partitions(len(ctx), 8, wide.shape[1] * 16, 132)
    out = run_decode(case, window, num_partitions=parts)
    assert torch.isfinite(out).all() and (out[4] == 0).all()
    assert rel_err(out, reference(case, window)) < 1e-2


def test_decode_fp32_uses_exact_dots() -> None:
    case = make_case([1] * 3, [70, 1500, 9], **LLAMA3_8B, block_size=16, device="cuda")
    poison_unused_slots(case)
    assert rel_err(run_decode(case), reference(case)) < 1e-5


@pytest.mark.parametrize("window", [None, 300])
def test_prefill_mixed_step_matches_torch_backend(window: int | None) -> None:
    # a full prompt, a chunk after a cached prefix, decode rows, a short prompt
    q_lens = [1500, 512, 1, 1, 37]
    ctx = [1500, 2600, 4000, 1, 37]
    case = make_case(q_lens, ctx, **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda")  # fmt: skip
    out = run_prefill(case, window)
    ref = torch_reference(case, window)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.double().cpu()) < 1e-2


def test_decode_rows_through_prefill_kernel() -> None:
    """A decode-only step through paged_prefill (16-row tiles) agrees with paged_decode."""
    ctx = [1, 17, 513, 4000, 2049, 64]
    case = make_case([1] * len(ctx), ctx, **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=3)  # fmt: skip
    via_prefill = run_prefill(case)
    assert rel_err(via_prefill, run_decode(case).double().cpu()) < 1e-2
    assert rel_err(via_prefill, reference(case)) < 1e-2


def test_prefill_d64_block32() -> None:
    case = make_case([200, 1, 64], [333, 100, 64], heads=8, kv_heads=2, head_dim=64,
                     block_size=32, dtype=torch.float16, device="cuda")  # fmt: skip
    ref = torch_reference(case)
    assert rel_err(run_prefill(case), ref.double().cpu()) < 1e-2


def test_decode_cuda_graph_replays_new_values() -> None:
    """Grid and scratch come from shapes only: one capture serves any lengths and tables."""
    first = make_case([1] * 6, [5, 400, 1000, 0, 2047, 31], **LLAMA3_8B, block_size=16,
                      dtype=torch.bfloat16, device="cuda", spare_blocks=200, seed=1)  # fmt: skip
    q, tables, lens = first.q.clone(), first.block_tables.clone(), first.context_lens.clone()
    out = torch.empty_like(q)
    k_cache, v_cache = first.cache[0], first.cache[1]

    def step() -> None:
        ta.paged_decode(q, k_cache, v_cache, tables, lens, first.scale, out, partition_size=256)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator(device="cuda").manual_seed(7)
    num_blocks = k_cache.shape[0]
    for new_lens in ([2048, 0, 1, 17, 999, 64], [3, 3, 3, 3, 3, 3]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(torch.randint(0, num_blocks, tables.shape, generator=gen, device="cuda"))
        q.normal_(generator=gen)
        graph.replay()
        replayed = out.clone()
        step()
        torch.testing.assert_close(replayed, out, rtol=0, atol=0)
        case = PagedCase(q, first.cache, tables, first.query_start, lens, [1] * 6, first.scale)
        assert rel_err(replayed, reference(case)) < 1e-2


@pytest.mark.parametrize("window, parts", [(None, 32), (1000, 7)])
def test_prefill_split_k_long_context(window: int | None, parts: int) -> None:
    """A 64-token chunk at a 16k context next to decode rows, split-K as the backend picks it
    for the H200 (32 pieces), agrees with the unsplit kernel and the reference."""
    q_lens = [64, 1, 1, 1]
    ctx = [16384, 300, 9000, 2]
    case = make_case(q_lens, ctx, **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=7)  # fmt: skip
    poison_unused_slots(case)
    split = run_prefill(case, window, parts)
    assert torch.isfinite(split).all()
    assert rel_err(split, run_prefill(case, window).double().cpu()) < 1e-2
    assert rel_err(split, reference(case, window)) < 1e-2


def _tables() -> dict[str, object]:
    from ds4pool.model.kernels import triton_decode_configs as tdc

    pieces = tdc.DecodeTable(block_n=32, num_warps=2, short_piece=64, default_stages=2,
                             stages=((1, 1024, 3), (64, 16384, 1)))  # fmt: skip
    return {"shipped": tdc.DECODE_TABLE, "pieces_and_stages": pieces}


@pytest.mark.parametrize("name", list(_tables()))
def test_the_decode_tables_short_rows_equal_their_solo_run(name: str) -> None:
    """A row of <= 1,024 keys in a batch of 64 over a 16k-wide table (beside an 8k row) gives
    the bits it gives alone at batch 1 over a 1k-wide table, with the launches the backend
    takes from the table for those two shapes (they may differ in num_stages only)."""
    from ds4pool.model.attention_triton import decode_partition_size

    table = _tables()[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctx = [160, 1000, 8000, 17] + [300] * 60
    case = make_case([1] * len(ctx), ctx, **LLAMA3_8B, block_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=5)  # fmt: skip

    def decode(rows: slice, width: int) -> torch.Tensor:
        tables = torch.zeros(rows.stop - rows.start, width // 16, dtype=torch.int32, device="cuda")
        have = case.block_tables[rows, : width // 16]
        tables[:, : have.shape[1]] = have
        launch = table.launch(tables.shape[0], width)  # type: ignore[attr-defined]
        part = decode_partition_size(tables.shape[0], 8, width, sms, ta.SHORT_CONTEXT,
                                     launch.block_n)  # fmt: skip
        out = torch.full_like(case.q[rows], float("nan"))
        ta.paged_decode(case.q[rows], case.cache[0], case.cache[1], tables,
                        case.context_lens[rows], case.scale, out, partition_size=part,
                        launch=launch, short_context=ta.SHORT_CONTEXT)  # fmt: skip
        return out

    batched = decode(slice(0, len(ctx)), 16384)
    assert rel_err(batched, reference(case)) < 1e-2
    for i in (0, 1, 3):
        assert torch.equal(decode(slice(i, i + 1), 1024), batched[i : i + 1]), ctx[i]
