"""The MoE decode path's configuration table (model/kernels/triton_moe_configs.py; no triton
needed): a step takes the first row that covers its token count, the default past the last;
tile sizes the kernels cannot take are refused where the row is written."""

from __future__ import annotations

import pytest

from ds4pool.model.kernels.triton_moe_configs import (
    DEFAULT,
    DecodeConfig,
    ProjTiles,
    config_for,
    sweep_gemv_shapes,
    sweep_schedules,
    sweep_shapes,
)


def test_a_step_takes_the_first_row_that_covers_it() -> None:
    one = DecodeConfig(ProjTiles(32, 256, 2), ProjTiles(64, 128), gemv=True)
    few = DecodeConfig(ProjTiles(16, 128, 4), ProjTiles(32, 64, 2))
    table = ((1, one), (4, few))
    assert config_for(1, table) is one
    assert config_for(2, table) is few and config_for(4, table) is few
    assert config_for(5, table) is DEFAULT


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_n": 24},
        {"block_n": 6},
        {"block_n": 32, "block_k": 100},
        {"block_n": 16, "split_k": 0},
    ],
)
def test_tiles_the_kernels_cannot_take_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ProjTiles(**kwargs)


def test_narrow_tiles_only_for_gemv() -> None:
    narrow = ProjTiles(4, 1024)
    assert DecodeConfig(narrow, narrow, gemv=True).gate_up.block_n == 4
    for gemv in (None, False):  # tl.dot tiles (a step past GEMV_MAX_TOKENS) need 16 columns
        with pytest.raises(ValueError):
            DecodeConfig(narrow, ProjTiles(32), gemv=gemv)
    gemv_shapes = sweep_gemv_shapes()
    assert all(s.block_n < 16 for s in gemv_shapes) and len(set(gemv_shapes)) == len(gemv_shapes)


def test_the_sweep_tries_each_shape_and_its_schedules() -> None:
    shapes = sweep_shapes()
    assert len(set(shapes)) == len(shapes) == 27
    assert DEFAULT.gate_up.block_n in {s.block_n for s in shapes}
    schedules = sweep_schedules(shapes[0])
    assert {(s.num_warps, s.num_stages) for s in schedules} >= {(4, 3)}
    assert {s.tma for s in schedules} == {False, True}  # each schedule both ways
    assert not any(s.tma for s in shapes)
    assert all(s.block_n == shapes[0].block_n and s.split_k == shapes[0].split_k for s in schedules)
