"""The Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs kernels as numpy and accepts code the compiler rejects (loop-carried
type changes, unsupported early returns); this compiles the real pipeline down to a cubin
with the specialisation the JIT gives torch tensors (16-byte aligned pointers, strides
divisible by 16) and checks that the K/V loads are software-pipelined (async copies).
Skipped where triton or its NVIDIA backend is missing, or under the interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import triton_compile

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs triton, compiled mode", allow_module_level=True)

triton = pytest.importorskip("triton")
ta = pytest.importorskip("ds4pool.model.kernels.triton_attention")
dk = pytest.importorskip("ds4pool.model.kernels._decode_kernels")
pk = pytest.importorskip("ds4pool.model.kernels._prefill_kernels")

pytest.importorskip("triton.backends.compiler")  # the NVIDIA backend, to compile for sm_90
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
POINTERS = {"tables_ptr": "*i32", "lens_ptr": "*i32", "qstart_ptr": "*i32"}
POINTERS |= {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
# the decode kernel's fused prologue (PROLOGUE): positions, slots, inv_freq
POINTERS |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "inv_ptr": "*fp32"}


def compile_sm90(fn: object, consts: dict, num_warps: int, num_stages: int) -> object:
    return triton_compile.compile_sm90(
        fn, consts, num_warps, num_stages, pointers=POINTERS,
        f32_scalars={"scale_log2", "eps", "factor"}, align_strides=True,
    )  # fmt: skip


def async_copies(kernel: object) -> int:
    return kernel.asm["ttgir"].count("async_copy_global_to_local")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "split, window, fixed_p", [(True, False, False), (False, True, False), (True, True, True)]
)
def test_decode_compiles_pipelined(split: bool, window: bool, fixed_p: bool) -> None:
    launch = ta.DEFAULT_DECODE
    consts = dict(H=32, G=4, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=launch.block_n,
                  SHORT=0 if fixed_p else ta.SHORT_CONTEXT,
                  FIXED_P=fixed_p, SPLIT=split, USE_WINDOW=window,
                  PRECISION="tf32")  # fmt: skip
    kernel = compile_sm90(dk.decode_kernel, consts, launch.num_warps, launch.num_stages)
    assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"


@pytest.mark.parametrize(
    "g, split, norm, fixed_p",
    [(4, True, True, False), (8, False, False, False), (8, True, True, True)],
)
def test_decode_with_prologue_compiles_pipelined(
    g: int, split: bool, norm: bool, fixed_p: bool
) -> None:
    """The decode kernel doing the attention prologue (Llama-3-8B's 32 / 8 heads, Qwen3-30B-
    A3B's 32 / 4): its K/V loads stay pipelined, and the barrier after the k/v store comes
    before the first of them (the pipeline's prologue loads the first tiles ahead of the
    loop: they must not be issued before the store is seen)."""
    launch = ta.DEFAULT_DECODE
    consts = dict(H=32, G=g, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=launch.block_n,
                  SHORT=0 if fixed_p else ta.SHORT_CONTEXT, FIXED_P=fixed_p, SPLIT=split,
                  USE_WINDOW=False, PRECISION="tf32", PROLOGUE=True, HAS_NORM=norm, HALF=64,
                  HALF_PAD=64, BLOCK_KV=32 // g)  # fmt: skip
    kernel = compile_sm90(dk.decode_kernel, consts, launch.num_warps, launch.num_stages)
    ttgir = kernel.asm["ttgir"]  # type: ignore[attr-defined]
    assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"
    assert kernel.metadata.shared <= H200_SHARED_BYTES, kernel.metadata.shared
    barrier = ttgir.find("ttg.barrier")
    assert 0 <= barrier < ttgir.find("async_copy_global_to_local"), "loads before the barrier"
    ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
    assert ptx.find("bar.sync") < ptx.find("cp.async"), "cp.async issued before bar.sync"


def _norm_reduce_layouts(ttgir: str) -> list[str]:
    """(shape, layout) of each reduction of the q/k RMSNorm (`inv = ...` in
    triton_prologue._norm_rope): the layout sets the order of the sum of squares."""
    import re

    layouts = dict(re.findall(r"^(#[\w]+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    lines, got = ttgir.splitlines(), []
    for i, line in enumerate(lines):
        if re.search(r"%inv\w* = \"tt.reduce\"", line):
            j = next(j for j in range(i, len(lines)) if re.search(r"\}\) : \(tensor", lines[j]))
            shape, layout = re.search(r"tensor<([\dx]+)xf32, (#\w+)>", lines[j]).groups()
            got.append(f"{shape} {layouts[layout]}")
    return sorted(got)


@pytest.mark.parametrize("g", [4, 8])
def test_the_fused_norms_reduce_in_the_prologue_kernels_layouts(g: int) -> None:
    """Bit for bit with the prologue's launch needs the same sum-of-squares order: every
    warp count the decode table launches gives the fused q and k norm reductions the
    layouts the prologue kernel (num_warps 4) gives its q and kv blocks. (Both kernels get
    the same q/k views, so the JIT specialises their strides alike; the layouts depend on
    that: unaligned strides give both other ones.)"""
    from ds4pool.model.kernels import triton_prologue as tp

    pro = triton_compile.compile_sm90(
        tp._prologue_kernel, dict(D=128, HALF=64, HALF_PAD=64, BLOCK_Q=16, BLOCK_KV=32 // g,
        HAS_NORM=True), 4, 1, pointers=POINTERS, f32_scalars={"eps", "factor"},
        align_strides=True,
    )  # fmt: skip
    want = _norm_reduce_layouts(pro.asm["ttgir"])  # type: ignore[attr-defined]
    assert len(want) == 4, want  # two halves each of q and k
    for warps in sorted({launch.num_warps for launch in _decode_table_launches()}):
        consts = dict(H=32, G=g, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=64,
                      SHORT=ta.SHORT_CONTEXT, FIXED_P=False, SPLIT=True, USE_WINDOW=False,
                      PRECISION="tf32", PROLOGUE=True, HAS_NORM=True, HALF=64, HALF_PAD=64,
                      BLOCK_KV=32 // g)  # fmt: skip
        kernel = compile_sm90(dk.decode_kernel, consts, warps, 2)
        assert _norm_reduce_layouts(kernel.asm["ttgir"]) == want, warps  # type: ignore[attr-defined]


@pytest.mark.parametrize("fixed_p", [True, False])
def test_decode_reduce_compiles(fixed_p: bool) -> None:
    consts = dict(H=32, D=128, D_PAD=128, SHORT=0 if fixed_p else ta.SHORT_CONTEXT,
                  BLOCK_N=64, FIXED_P=fixed_p, P_CHUNK=16, USE_WINDOW=True)  # fmt: skip
    compile_sm90(dk.decode_reduce_kernel, consts, 4, 2)


@pytest.mark.parametrize("window, split", [(False, False), (True, False), (False, True)])
def test_prefill_compiles_pipelined(window: bool, split: bool) -> None:
    launch = ta.DEFAULT_PREFILL
    consts = dict(G=4, D=128, D_PAD=128, BS=16, BLOCK_M=launch.block_m,
                  BLOCK_Q=launch.block_m // 4, BLOCK_N=launch.block_n, USE_WINDOW=window,
                  PRECISION="tf32", SPLIT=split)  # fmt: skip
    kernel = compile_sm90(pk.prefill_kernel, consts, launch.num_warps, launch.num_stages)
    assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"
    assert kernel.asm["ttgir"].count("warp_group_dot") > 0, "no Hopper wgmma"


@pytest.mark.parametrize("split", [False, True])
def test_the_deep_prefill_launch_fits_where_it_is_chosen(split: bool) -> None:
    """DEEP_PREFILL (Hopper's prefill launch) compiles for sm_90, pipelined, within the
    shared memory `prefill_launch` asks a device for before choosing it."""
    launch = ta.DEEP_PREFILL
    consts = dict(G=4, D=128, D_PAD=128, BS=16, BLOCK_M=launch.block_m,
                  BLOCK_Q=launch.block_m // 4, BLOCK_N=launch.block_n, USE_WINDOW=False,
                  PRECISION="tf32", SPLIT=split)  # fmt: skip
    kernel = compile_sm90(pk.prefill_kernel, consts, launch.num_warps, launch.num_stages)
    assert kernel.metadata.shared <= ta.DEEP_PREFILL_SHARED, kernel.metadata.shared
    assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"


@pytest.mark.parametrize("deep", [True, False], ids=["deep", "default"])
@pytest.mark.parametrize("small_m", [16, 32])
def test_the_small_tile_costs_no_shared_memory(deep: bool, small_m: int) -> None:
    """PrefillLaunch.small_m compiles a second, small tile into the kernel (decode rows of a
    mixed step): its K/V loads are pipelined too, the large tile keeps Hopper's wgmma, and
    the program needs no more shared memory or registers than without it (the two
    pipelines' buffers are not live at once), so DEEP_PREFILL still fits where it is chosen."""
    launch = ta.DEEP_PREFILL if deep else ta.DEFAULT_PREFILL
    consts = dict(G=4, D=128, D_PAD=128, BS=16, BLOCK_M=launch.block_m,
                  BLOCK_Q=launch.block_m // 4, BLOCK_N=launch.block_n, USE_WINDOW=False,
                  PRECISION="tf32", SPLIT=True)  # fmt: skip
    plain = compile_sm90(pk.prefill_kernel, consts, launch.num_warps, launch.num_stages)
    small = compile_sm90(
        pk.prefill_kernel, consts | {"SMALL_M": small_m}, launch.num_warps, launch.num_stages
    )
    assert small.metadata.shared <= plain.metadata.shared, small.metadata.shared
    assert async_copies(small) == 2 * async_copies(plain), "small tile's loads not pipelined"
    assert small.asm["ttgir"].count("warp_group_dot") > 0, "no Hopper wgmma"
    usage = triton_compile.resource_usage(small.asm["cubin"])
    if usage is not None:  # where triton ships cuobjdump
        before = triton_compile.resource_usage(plain.asm["cubin"])
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
        assert before is not None and usage["REG"] <= before["REG"], (usage, before)


def test_prefill_launch_by_device() -> None:
    assert ta.prefill_launch((9, 0), 227 * 1024) == ta.DEEP_PREFILL  # H100 / H200
    assert ta.prefill_launch((8, 0), 163 * 1024) == ta.DEFAULT_PREFILL  # A100: not measured
    assert ta.prefill_launch((12, 0), 99 * 1024) == ta.DEFAULT_PREFILL  # too little memory
    assert ta.prefill_launch((9, 0), 0) == ta.DEFAULT_PREFILL  # a torch without the field


def test_prefill_compiles_for_decode_rows() -> None:
    """max_query_len 1: paged_prefill shrinks the tile to 16 rows (G=4 heads of one token)."""
    consts = dict(G=4, D=128, D_PAD=128, BS=16, BLOCK_M=16, BLOCK_Q=4, BLOCK_N=64,
                  USE_WINDOW=False, PRECISION="tf32", SPLIT=True)  # fmt: skip
    kernel = compile_sm90(pk.prefill_kernel, consts, 4, ta.DEFAULT_PREFILL.num_stages)
    assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"


def test_prefill_reduce_compiles() -> None:
    compile_sm90(pk.prefill_reduce_kernel, dict(H=32, D=128, D_PAD=128, P_CHUNK=16), 4, 2)


def test_prefill_split_policy() -> None:
    """Split only a grid that leaves SMs idle; never into pieces under 512 keys, at most 64."""
    assert ta.prefill_num_partitions(programs=512, max_context=16384, num_sms=132) == 1
    assert ta.prefill_num_partitions(programs=16, max_context=16384, num_sms=132) == 32
    assert ta.prefill_num_partitions(programs=128, max_context=16384, num_sms=132) == 5
    assert ta.prefill_num_partitions(programs=16, max_context=700, num_sms=132) == 1
    assert ta.prefill_num_partitions(programs=1, max_context=1 << 20, num_sms=132) == 64


def _decode_table_launches() -> list[object]:
    """Every launch DECODE_TABLE can return: its rows' and its default's."""
    from ds4pool.model.kernels.triton_decode_configs import DECODE_TABLE as t

    shapes = [(b, w) for b, w, _ in t.stages] + [(1 << 20, 1 << 30)]  # the last: the default
    return sorted({t.launch(b, w) for b, w in shapes}, key=repr)


H200_SHARED_BYTES = 227 * 1024  # the most shared memory one program may use on sm_90


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("launch", _decode_table_launches(), ids=repr)
def test_the_decode_tables_launches_compile_and_fit(launch: object, split: bool) -> None:
    """What a pasted sweep result would launch compiles for sm_90 and fits in shared memory
    (a launch that does not would fail at the first decode, not at the sweep's machine)."""
    consts = dict(H=32, G=4, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=launch.block_n,
                  SHORT=ta.SHORT_CONTEXT, FIXED_P=False, SPLIT=split, USE_WINDOW=False,
                  PRECISION="tf32")  # fmt: skip
    kernel = compile_sm90(dk.decode_kernel, consts, launch.num_warps, launch.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, kernel.metadata.shared
    if launch.num_stages > 1:
        assert async_copies(kernel) > 0, "K/V loads are not software-pipelined"
