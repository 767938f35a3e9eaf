"""The skinny decode GEMM (model/kernels/triton_linear.py) and its table
(triton_linear_configs.py): the kernel under Triton's CPU interpreter against F.linear for
every kind of launch (tl.dot tiles, the GEMV of one and of a few rows, split-K with its
arrival counters, balanced programs), TritonOps.linear's choice of kernel, the table's
lookup and JSON; and the table's launches compiled for sm_90 (pipelined, no spills).

The interpreter cases run in one child process (this file as a script) that prints a JSON
line each, as in test_triton_moe_gate.py.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from ds4pool.model.kernels.triton_linear_configs import (
    MAX_ROWS,
    SKINNY_TABLE,
    SkinnyConfig,
    bucket,
    config_for,
    sweep_configs,
    sweep_schedules,
    table_from_json,
    table_to_json,
)
from tests.interpreter import interpreter_results, print_cases

# case → (rows, K, N, dtype, bias): ragged N and K (masked tiles), one row, a full bucket
SHAPES: dict[str, tuple[int, int, int, str, bool]] = {
    "one_row": (1, 256, 96, "float32", True),
    "ragged": (3, 200, 40, "float32", False),
    "sixteen_rows": (16, 512, 64, "float32", True),
    "four_rows_fp16": (4, 300, 50, "float16", True),  # (the interpreter's bf16 dot is wrong)
}
CONFIGS = {
    "dot": SkinnyConfig(16, 64),
    "dot_split3": SkinnyConfig(16, 64, split=3),
    "dot_wide_split2": SkinnyConfig(32, 128, split=2),
    "dot_balanced": SkinnyConfig(16, 64, waves=1),
    "gemv": SkinnyConfig(8, 64, dot=False),
    "gemv_split2": SkinnyConfig(8, 64, split=2, dot=False),
    "gemv_balanced": SkinnyConfig(4, 64, dot=False, waves=2),
}
KERNEL_CASES = [
    f"{shape}:{cfg}"
    for shape, (rows, *_rest) in SHAPES.items()
    for cfg, c in CONFIGS.items()
    if c.dot or rows <= 4
]
OPS_CASES = ["ops_table", "ops_fallbacks", "ops_fused"]
# the fusions (silu·mul prologue, add + norm epilogue) on every kind of launch; "wide" is
# normalised in pieces (a norm_block smaller than its rows)
FUSED_SHAPES = {**SHAPES, "wide": (2, 64, 1100, "float16", False)}
FUSED_CASES = [
    f"fused:{shape}:{cfg}"
    for shape in ("one_row", "four_rows_fp16", "wide")
    for cfg, c in CONFIGS.items()
    if c.dot or FUSED_SHAPES[shape][0] <= 4
]


def _kernel_case(name: str) -> dict[str, Any]:
    import torch
    from torch.nn import functional as F

    from ds4pool.model.kernels.triton_linear import SkinnyWorkspace, skinny_linear

    shape, cfg_name = name.split(":")
    rows, k, n, dtype_name, has_bias = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if has_bias else None
    ws = SkinnyWorkspace(torch.device("cpu"), 64)
    cfg = CONFIGS[cfg_name]
    got = skinny_linear(x, w, b, cfg, ws)
    again = skinny_linear(x, w, b, cfg, ws)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    return {
        "name": name,
        "shape": list(got.shape),
        "dtype": str(got.dtype),
        "err": float((got.float() - want).abs().max() / want.abs().max()),
        "tolerance": 1e-5 if dtype == torch.float32 else 1e-2,
        "run_to_run_equal": bool(torch.equal(got, again)),
        "counters_zero": int(ws.counters.abs().sum()) == 0,
    }


def _fused_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.kernels import triton_fused
    from ds4pool.model.kernels.triton_linear import AddNorm, SkinnyWorkspace, skinny_linear

    _, shape, cfg_name = name.split(":")
    rows, k, n, dtype_name, has_bias = FUSED_SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(len(name))
    gate_up = torch.randn(rows, 2 * k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if has_bias else None
    residual = torch.randn(rows, n, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    ws = SkinnyWorkspace(torch.device("cpu"), 256)
    cfg = CONFIGS[cfg_name]
    # unfused: the silu·mul kernel, the projection, the add + norm kernel
    y = skinny_linear(triton_fused.silu_mul(gate_up), w, b, cfg, ws)
    want_res = residual.clone()
    want_h = triton_fused.rms_norm(y, nw, 1e-5, residual=want_res)
    act_y = skinny_linear(gate_up, w, b, cfg, ws, act=True)
    pieces = 512 if shape == "wide" else 8192  # wide: the epilogue's rows in pieces

    def fused(res: torch.Tensor) -> torch.Tensor:
        add_norm = AddNorm(res, nw, 1e-5)
        return skinny_linear(gate_up, w, b, cfg, ws, act=True, add_norm=add_norm, norm_block=pieces)

    got_res, again_res = residual.clone(), residual.clone()
    got_h, again_h = fused(got_res), fused(again_res)
    # one rounding of the last step apart at most (the squares are summed in another order)
    ulp = torch.finfo(dtype).eps * want_h.float().abs().clamp_min(1e-3)
    return {
        "name": name,
        "act_bitwise": bool(torch.equal(act_y, y)),
        "residual_bitwise": bool(torch.equal(got_res, want_res)),
        "norm_within_one_rounding": bool(((got_h.float() - want_h.float()).abs() <= ulp).all()),
        "norm_err": float((got_h.float() - want_h.float()).abs().max()),
        "run_to_run_equal": bool(torch.equal(got_h, again_h) and torch.equal(got_res, again_res)),
        "counters_zero": int(ws.counters.abs().sum()) + int(ws.done.abs().sum()) == 0,
    }


def _ops_case(name: str) -> dict[str, Any]:
    import tempfile

    import torch
    from torch import nn

    from ds4pool.model.kernels.triton_linear import SkinnyWorkspace, skinny_linear
    from ds4pool.model.ops import TritonOps

    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(96, 48, bias=True)
    cfg = SkinnyConfig(16, 32, split=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        path.write_text(table_to_json({(48, 96): ((1, cfg), (16, cfg))}))
        os.environ["DS4POOL_SKINNY_TABLE"] = str(path)
        ops = TritonOps()
    if name == "ops_fused":  # linear_add_rms_norm: fused with the table, the module without
        from ds4pool.model.layers import RMSNorm
        from ds4pool.model.ops import TorchOps

        lin = lin.to(torch.float16)
        norm = RMSNorm(48, 1e-6).to(torch.float16)
        x = torch.randn(1, 96, generator=g).to(torch.float16)
        residual = torch.randn(1, 48, generator=g).to(torch.float16)
        fused_r, fused_h = ops.linear_add_rms_norm(lin, x, norm, residual.clone())
        ops.fuse_add_norm = False
        plain_r, plain_h = ops.linear_add_rms_norm(lin, x, norm, residual.clone())
        ref_r, ref_h = TorchOps().linear_add_rms_norm(lin.float(), x.float(), norm.float(),
                                                       residual.float())  # fmt: skip
        return {
            "name": name,
            "residual_equal": bool(torch.equal(fused_r, plain_r)),
            "h_err": float((fused_h.float() - plain_h.float()).abs().max()),
            "ref_err": float((fused_h.float() - ref_h).abs().max()),
        }
    if name == "ops_table":
        lin = lin.to(torch.float16)
        out = {}
        for rows in (1, 9):
            x = torch.randn(rows, 96, generator=g).to(torch.float16)
            direct = skinny_linear(x, lin.weight, lin.bias, cfg, SkinnyWorkspace(x.device, 8))
            out[f"rows{rows}_skinny"] = bool(torch.equal(ops.linear(lin, x), direct))
        # a down projection (x = gate | up): silu·mul fused for one row; for more, its own
        # launch, and the projection still the skinny GEMM
        from ds4pool.model.kernels.triton_fused import silu_mul

        for rows in (1, 9):
            gu = torch.randn(rows, 192, generator=g).to(torch.float16)
            ws = SkinnyWorkspace(gu.device, 8)
            direct = skinny_linear(silu_mul(gu), lin.weight, lin.bias, cfg, ws)
            out[f"act_rows{rows}_skinny"] = bool(torch.equal(ops.linear(lin, gu, act=True), direct))
        return {"name": name, **out}
    # fp32 (tl.dot would be tf32), a bucket the table has no row for, more than 16 rows
    x32 = torch.randn(2, 96, generator=g)
    bf = lin.to(torch.float16)
    x4 = torch.randn(3, 96, generator=g).to(torch.float16)
    x17 = torch.randn(MAX_ROWS + 1, 96, generator=g).to(torch.float16)
    lin32 = nn.Linear(96, 48)
    return {
        "name": name,
        "fp32_is_module": bool(torch.equal(ops.linear(lin32, x32), lin32(x32))),
        "unlisted_bucket_is_module": bool(torch.equal(ops.linear(bf, x4), bf(x4))),
        "many_rows_is_module": bool(torch.equal(ops.linear(bf, x17), bf(x17))),
    }


def run_case(name: str) -> dict[str, Any]:
    if name.startswith("fused:"):
        return _fused_case(name)
    return _ops_case(name) if name in OPS_CASES else _kernel_case(name)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return interpreter_results(__file__, timeout=300)


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_the_kernel_equals_f_linear(results: dict[str, dict[str, Any]], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    rows, _k, n, dtype, _b = SHAPES[name.split(":")[0]]
    assert r["shape"] == [rows, n] and r["dtype"] == f"torch.{dtype}"
    assert r["err"] <= r["tolerance"], r
    assert r["run_to_run_equal"], "split-K's last strip adds the partials in a fixed order"
    assert r["counters_zero"], "every call leaves the arrival counters at zero"


@pytest.mark.parametrize("name", FUSED_CASES)
def test_the_fusions_give_the_unfused_kernels_results(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["act_bitwise"], "silu·mul in the loads: the silu_mul kernel's bits"
    assert r["residual_bitwise"], r
    assert r["norm_within_one_rounding"], r
    assert r["run_to_run_equal"], r
    assert r["counters_zero"], "every call leaves the arrival counters at zero"


def test_triton_ops_fuses_the_add_and_norm(results: dict[str, dict[str, Any]]) -> None:
    r = results["ops_fused"]
    assert "error" not in r, r.get("error")
    assert r["residual_equal"], r
    assert r["h_err"] <= 2e-3 and r["ref_err"] <= 2e-2, r


def test_triton_ops_takes_the_table_config(results: dict[str, dict[str, Any]]) -> None:
    r = results["ops_table"]
    assert "error" not in r, r.get("error")
    assert r["rows1_skinny"] and r["rows9_skinny"], r
    assert r["act_rows1_skinny"] and r["act_rows9_skinny"], r


def test_triton_ops_falls_back_to_the_module(results: dict[str, dict[str, Any]]) -> None:
    r = results["ops_fallbacks"]
    assert "error" not in r, r.get("error")
    assert r["fp32_is_module"] and r["unlisted_bucket_is_module"] and r["many_rows_is_module"], r


def test_buckets_and_lookup() -> None:
    assert [bucket(r) for r in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError):
        bucket(MAX_ROWS + 1)
    a, c = SkinnyConfig(2, 1024, dot=False, stages=1), SkinnyConfig(32, 256)
    table = {(6144, 4096): ((1, a), (16, c))}
    assert config_for(6144, 4096, 1, table) == a
    assert config_for(6144, 4096, 3, table) is None  # no 4-row row: cuBLAS, not a neighbour's
    assert config_for(6144, 4096, 9, table) == c
    assert config_for(6144, 4096, 17, table) is None
    assert config_for(4096, 6144, 1, table) is None  # (N, K), not (K, N)


def test_table_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(table_to_json(SKINNY_TABLE))
    assert table_from_json(path) == SKINNY_TABLE
    assert all(isinstance(r["n"], int) for r in json.loads(path.read_text()))


def test_a_bad_table_file_is_one_line_error(tmp_path: Path) -> None:
    from ds4pool.errors import DeviceError
    from ds4pool.model.ops import _skinny_table

    bad = tmp_path / "bad.json"
    odd_block = '[{"n": 8, "k": 8, "rows": 1, "block_n": 3, "block_k": 8}]'
    for text in ("not json", '[{"n": 1}]', odd_block):
        bad.write_text(text)
        with pytest.raises(DeviceError, match="DS4POOL_SKINNY_TABLE"):
            _skinny_table(str(bad))
    with pytest.raises(DeviceError, match="not a skinny-GEMM table"):
        _skinny_table(str(tmp_path / "missing.json"))
    assert _skinny_table("0") == {}


def test_a_bad_fusion_row_limit_is_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds4pool.errors import DeviceError
    from ds4pool.model.ops import TritonOps

    monkeypatch.setenv("DS4POOL_SKINNY_FUSE_ROWS", "four")
    with pytest.raises(DeviceError, match="DS4POOL_SKINNY_FUSE_ROWS=four: not a row count"):
        TritonOps()
    monkeypatch.setenv("DS4POOL_SKINNY_FUSE_ROWS", "4")
    assert TritonOps().fuse_max_rows == 4
    monkeypatch.delenv("DS4POOL_SKINNY_FUSE_ROWS")
    assert TritonOps().fuse_max_rows == 1


def test_pdl_kinds_by_setting_and_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4POOL_PDL: the default kinds, none, a list, or a one-line error; which skinny-GEMM
    launches start early (GEMV by column blocks) and which only trigger the next kernel
    (balanced, dot), and none off the GPUs that have PDL."""
    import torch

    from ds4pool.errors import DeviceError
    from ds4pool.model.ops import PDL_DEFAULT, TritonOps, pdl_kinds

    assert pdl_kinds("") == pdl_kinds("1") == pdl_kinds("on") == frozenset(PDL_DEFAULT)
    assert pdl_kinds("0") == pdl_kinds("off") == frozenset()
    assert pdl_kinds("skinny+moe") == pdl_kinds("moe,skinny") == {"skinny", "moe"}
    for bad in ("yes", "skinny+fast", "+"):
        with pytest.raises(DeviceError, match=f"DS4POOL_PDL={re.escape(bad)}: not 0, 1 or"):
            pdl_kinds(bad)
    monkeypatch.setenv("DS4POOL_PDL", "sometimes")
    with pytest.raises(DeviceError, match="DS4POOL_PDL=sometimes"):
        TritonOps()
    monkeypatch.delenv("DS4POOL_PDL")
    ops = TritonOps()
    cuda = torch.device("cuda")
    ops._pdl_devices[cuda] = True  # as on an H200, without one
    gemv, balanced = SkinnyConfig(2, 1024, dot=False), SkinnyConfig(8, 1024, dot=False, waves=8)
    dot = SkinnyConfig(32, 256)
    assert ops._skinny_pdl(cuda, gemv) == (True, True)
    assert ops._skinny_pdl(cuda, balanced) == ops._skinny_pdl(cuda, dot) == (False, True)
    assert ops.pdl_on(cuda, "moe") and not ops.pdl_on(cuda, "decode")
    ops.pdl = pdl_kinds("0")
    assert ops._skinny_pdl(cuda, gemv) == (False, False)
    assert not TritonOps().pdl_on(torch.device("cpu"), "skinny")


def test_config_validation() -> None:
    for bad in (
        dict(block_n=8, block_k=64),  # dot tiles need 16 columns
        dict(block_n=24, block_k=64, dot=False),
        dict(block_n=16, block_k=64, split=0),
        dict(block_n=16, block_k=64, split=2, waves=2),  # balanced programs do not split
    ):
        with pytest.raises(ValueError):
            SkinnyConfig(**bad)


def test_sweep_candidates_are_valid_and_gemv_only_for_few_rows() -> None:
    for rows in (1, 4, 16):
        cands = sweep_configs(rows)
        assert len(set(cands)) == len(cands)
        assert any(not c.dot for c in cands) == (rows <= 4)
        for c in cands[:3]:
            assert all(isinstance(s, SkinnyConfig) for s in sweep_schedules(c))


needs_compiler = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton, compiled mode",
)


@needs_compiler
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("key", sorted(SKINNY_TABLE))
def test_the_table_compiles_for_sm90_pipelined_without_spills(key: tuple[int, int]) -> None:
    pytest.importorskip("triton.backends.compiler")
    from ds4pool.model.kernels.triton_linear import NORM_BLOCK, _skinny_kernel
    from tests import triton_compile

    # each launch plain and with both fusions (silu·mul loads, the add + norm epilogue)
    for (rows, cfg), fused in itertools.product(SKINNY_TABLE[key], (False, True)):
        consts = dict(
            BLOCK_M=MAX_ROWS if cfg.dot else 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT=cfg.split, USE_DOT=cfg.dot, HAS_BIAS=False, BALANCED=cfg.waves > 0,
            PRECISION="tf32", ACT=fused, ADD_NORM=fused, NORM_BLOCK=NORM_BLOCK,
        )  # fmt: skip
        kernel = triton_compile.compile_sm90(
            _skinny_kernel, consts, cfg.warps, cfg.stages,
            pointers={"part_ptr": "*fp32", "cnt_ptr": "*i32", "done_ptr": "*i32"},
            align_strides=True, aligned={"n", "k", "k_chunk"}, f32_scalars={"eps"},
        )  # fmt: skip
        if cfg.dot:  # Triton pipelines a dot loop's loads (cp.async), not the GEMV's
            assert "cp.async" in kernel.asm["ptx"], (key, rows, cfg)
        usage = triton_compile.resource_usage(kernel.asm["cubin"])
        if usage is not None:
            assert usage.get("LOCAL", 0) == 0, (key, rows, cfg, usage)
        assert kernel.metadata.shared <= 227 * 1024


if __name__ == "__main__":
    print_cases(KERNEL_CASES + FUSED_CASES + OPS_CASES, run_case)
