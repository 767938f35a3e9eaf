"""The decode launch table (kernels/triton_decode_configs.py) and its sweep's choice, on CPU.

No kernel runs here: the interpreter cases of test_triton_attention.py check the launches'
numerics, tests/unit/test_triton_compile.py compiles the table's for sm_90. This checks the
lookup a graph's shape goes through, that no shape can get a short row summed another way,
and that the sweep (bench/decode_sweep.py), given timings, emits a table that pastes and
holds its fastest correct launch.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from ds4pool.model.kernels import triton_decode_configs as tdc  # noqa: E402
from ds4pool.model.kernels.triton_attention import DEFAULT_DECODE, DecodeLaunch  # noqa: E402

TABLE = tdc.DecodeTable(
    block_n=32, num_warps=2, short_piece=64, default_stages=2,
    stages=((1, 1024, 4), (1, 4096, 3), (8, 1024, 1), (64, 16384, 3)),
)  # fmt: skip


def test_a_shape_takes_the_smallest_batch_and_width_rows_that_cover_it() -> None:
    assert TABLE.launch(1, 1024) == DecodeLaunch(32, 2, 4, 64)
    assert TABLE.launch(1, 2048).num_stages == 3  # width 2,048 -> the 4,096 row
    assert TABLE.launch(2, 512).num_stages == 1  # batch 2 -> the batch-8 rows
    assert TABLE.launch(8, 4096).num_stages == 2  # batch 8 has no row that wide: default
    assert TABLE.launch(9, 1024).num_stages == 3  # batch 9 -> batch 64's 16k row covers it
    assert TABLE.launch(65, 1024).num_stages == 2  # past the largest batch: default
    assert TABLE.launch(1, 65536).num_stages == 2  # past the widest row: default


def test_no_shape_sums_a_short_row_another_way() -> None:
    # batched == solo: block_n, num_warps and short_piece are one value for every shape
    launches = {TABLE.launch(b, w) for b in range(1, 80) for w in (16, 1024, 4096, 16384, 1 << 17)}
    assert {(x.block_n, x.num_warps, x.short_piece) for x in launches} == {(32, 2, 64)}
    assert {x.num_stages for x in launches} == {1, 2, 3, 4}


def test_the_shipped_table_starts_from_the_launch_measured_before_it() -> None:
    t = tdc.DECODE_TABLE
    assert t.launch(64, 1024).block_n == t.launch(1, 1024).block_n
    assert tdc.DecodeTable().launch(1, 1024) == DEFAULT_DECODE  # no rows: the old launch


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(short_piece=48),  # not a multiple of block_n
        dict(block_n=24),
        dict(num_warps=3),
        dict(stages=((1, 1024, 0),)),
        dict(stages=((1, 1024, 2), (1, 1024, 3))),  # two rows for one shape
    ],
)
def test_a_bad_table_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        tdc.DecodeTable(**kwargs)


def test_the_interpreter_cases_cover_the_sweep() -> None:
    from tests.unit.test_triton_attention import CONFIG_PAIRS

    assert {n for n, _ in CONFIG_PAIRS} == set(tdc.SWEEP_BLOCK_N)
    assert {p for _, p in CONFIG_PAIRS} == {0, *tdc.SWEEP_SHORT_PIECES}


def fake_us(shape: object, launch: DecodeLaunch) -> float:
    """A made-up GPU: (32, 2, piece 0) is the fastest arithmetic, best at 3 stages at batch 1
    and 1 stage elsewhere; (16, 1) is faster still but computes garbage; (128, 8) fails."""
    base = shape.batch * shape.context / 100 + 5  # type: ignore[attr-defined]
    key = (launch.block_n, launch.num_warps, launch.short_piece)
    if key == (32, 2, 0):
        best = 3 if shape.batch == 1 else 1  # type: ignore[attr-defined]
        return base * (0.6 if launch.num_stages == best else 0.7)
    if key[:2] == (16, 1):
        return base * 0.1
    h = (launch.block_n * 7 + launch.num_warps * 3 + launch.num_stages + launch.short_piece) % 11
    return base * (0.9 + 0.02 * h) if key != (64, 4, 0) else base


def test_the_sweep_emits_a_table_of_its_fastest_correct_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import decode_sweep as ds

    right = torch.ones(1, 32, 128)

    def make_shapes(batches: list[int], contexts: list[int]) -> tuple[None, list[ds.Shape]]:
        return None, [
            ds.Shape(b, c, ds.graph_width(c), [], torch.zeros(b), right, right)
            for b in batches
            for c in contexts
        ]

    def time_launch(cache: object, s: ds.Shape, launch: DecodeLaunch) -> ds.Timing:
        if (launch.block_n, launch.num_warps) == (128, 8):
            return ds.Timing(math.inf, None)  # e.g. out of shared memory
        wrong = (launch.block_n, launch.num_warps) == (16, 1)
        return ds.Timing(fake_us(s, launch), right + 1 if wrong else right.clone())

    monkeypatch.setattr(ds, "make_shapes", make_shapes)
    monkeypatch.setattr(ds, "time_launch", time_launch)
    monkeypatch.setattr(ds, "reference", lambda cache, s: right)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    sw, arith = ds.sweep(list(ds.BATCHES), list(ds.CONTEXTS), budget_s=600)
    assert (arith.block_n, arith.num_warps, arith.short_piece) == (32, 2, 0)
    assert any("16" in f for f in sw.failures), "the wrong launch was not reported"
    lines = ds.report(sw, arith, emit=True)
    code = "\n".join(lines[lines.index("DECODE_TABLE = DecodeTable(") :])
    scope: dict = {"DecodeTable": tdc.DecodeTable}
    exec(code, scope)  # what the lead pastes
    table = scope["DECODE_TABLE"]
    assert table.launch(1, 1024) == DecodeLaunch(32, 2, 3, 0)
    assert table.launch(64, 16384) == DecodeLaunch(32, 2, 1, 0)
    assert table.default_stages == 1
