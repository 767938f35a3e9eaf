"""Programmatic dependent launch (model/kernels/_pdl.py) in the compiled kernels, for sm_90 on
a machine without a GPU (the interpreter has no griddepcontrol): with PDL every kernel lets
the next one start at its first instruction, and waits for the one before it ahead of every
load of an input; the skinny GEMM issues its first weight tile's loads before that wait and
its x loads after it; without PDL neither instruction is there."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import triton_compile

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs triton, compiled mode", allow_module_level=True)

pytest.importorskip("triton.backends.compiler")
linear = pytest.importorskip("ds4pool.model.kernels.triton_linear")
decode = pytest.importorskip("ds4pool.model.kernels._decode_kernels")
moe_decode = pytest.importorskip("ds4pool.model.kernels.triton_moe_decode")
moe_combine = pytest.importorskip("ds4pool.model.kernels.triton_moe_combine")
moe_gate = pytest.importorskip("ds4pool.model.kernels.triton_moe_gate")
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

LOADS = ("ld.global", "cp.async")
PTRS = {"part_ptr": "*fp32", "cnt_ptr": "*i32", "done_ptr": "*i32", "pos_ptr": "*i64",
        "slot_ptr": "*i64", "inv_ptr": "*fp32", "tables_ptr": "*i32", "lens_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "ids_ptr": "*i64",
        "groups_ptr": "*i64", "weights_ptr": "*fp32"}  # fmt: skip
SCALARS = {"eps", "factor", "scaling", "scale_log2"}


def ptx_lines(fn: object, consts: dict, warps: int = 4, stages: int = 3) -> list[str]:
    types = {"w_desc": "*bf16"} if "w_desc" in fn.arg_names else None  # type: ignore[attr-defined]
    kernel = triton_compile.compile_sm90(
        fn, consts, warps, stages, pointers=PTRS, f32_scalars=SCALARS, types=types
    )
    return kernel.asm["ptx"].splitlines()  # type: ignore[attr-defined]


def first(lines: list[str], *needles: str, unless: str = "") -> int:
    hits = [i for i, s in enumerate(lines) if any(n in s for n in needles)]
    hits = [i for i in hits if not unless or unless not in lines[i]]
    return hits[0] if hits else -1


SKINNY = {  # the table's kinds: one-row GEMV (plain, balanced), split-K dot tiles
    "gemv": dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, SPLIT=1, USE_DOT=False, BALANCED=False),
    "balanced": dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SPLIT=1, USE_DOT=False, BALANCED=True),
    "dot": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT=4, USE_DOT=True, BALANCED=False),
}


@pytest.mark.parametrize("kind", list(SKINNY))
@pytest.mark.parametrize("fused", [False, True])
def test_the_skinny_gemm_loads_weights_before_the_wait_and_x_after(kind: str, fused: bool) -> None:
    consts = dict(SKINNY[kind], HAS_BIAS=False, PRECISION="tf32", ACT=fused, ADD_NORM=fused,
                  NORM_BLOCK=4096)  # fmt: skip
    lines = ptx_lines(linear._skinny_kernel, dict(consts, PDL=True))
    trigger = first(lines, "griddepcontrol.launch_dependents")
    wait = first(lines, "griddepcontrol.wait")
    weight = first(lines, "ld.global.L1::evict_first")  # the weight tiles are evict-first
    x = first(lines, *LOADS, unless="evict_first")
    assert 0 <= trigger < weight < wait < x, (trigger, weight, wait, x)
    plain = ptx_lines(linear._skinny_kernel, dict(consts, PDL=False))
    assert first(plain, "griddepcontrol") == -1


def test_the_decode_kernel_waits_before_its_first_load() -> None:
    consts = dict(H=32, G=4, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=64, SHORT=1024,
                  FIXED_P=False, SPLIT=False, USE_WINDOW=False, PRECISION="tf32",
                  PROLOGUE=True, HAS_NORM=False, HALF=64, HALF_PAD=64, BLOCK_KV=8,
                  PDL=True)  # fmt: skip
    lines = ptx_lines(decode.decode_kernel, consts, 4, 3)
    trigger, wait = (
        first(lines, "griddepcontrol.launch_dependents"),
        first(lines, "griddepcontrol.wait"),
    )
    assert 0 <= trigger < wait < first(lines, *LOADS), (trigger, wait)


def _gate_up() -> dict:
    route = dict(moe_decode._no_route(None)[1], ROUTE=False)  # type: ignore[arg-type]
    return dict(TOP_K=8, BLOCK_T=1, BLOCK_KS=8, BLOCK_N=16, BLOCK_K=256, USE_DOT=False,
                PRECISION="tf32", SPLIT=1, USE_TMA=False, **route)  # fmt: skip


@pytest.mark.parametrize(
    "name",
    ["gate_up", "down", "combine"],
)
def test_the_moe_expert_kernels_wait_before_their_first_load(name: str) -> None:
    fn, consts = {
        "gate_up": (moe_decode._gate_up_kernel, _gate_up()),
        "down": (moe_decode._down_kernel, dict(TOP_K=8, BLOCK_T=1, BLOCK_KS=8, BLOCK_N=32,
                 BLOCK_K=256, USE_DOT=False, PRECISION="tf32", GU_SPLIT=1, SPLIT=1,
                 USE_TMA=False)),
        "combine": (moe_combine._combine_kernel, dict(TOP_K=8, BLOCK_N=2048, SPLIT=1, NORM=True)),
    }[name]  # fmt: skip
    lines = ptx_lines(fn, dict(consts, PDL=True))
    trigger, wait = (
        first(lines, "griddepcontrol.launch_dependents"),
        first(lines, "griddepcontrol.wait"),
    )
    assert 0 <= trigger < wait < first(lines, *LOADS), (name, trigger, wait)


def test_the_moe_gate_loads_the_router_before_the_wait_and_the_row_after() -> None:
    lines = ptx_lines(moe_gate._norm_logits_kernel, dict(BLOCK_H=2048, BLOCK_E=8, PDL=True), 4, 1)
    wait = first(lines, "griddepcontrol.wait")
    loads = [i for i, s in enumerate(lines) if any(n in s for n in LOADS)]
    assert loads[0] < wait < loads[-1], (loads[0], wait, loads[-1])
