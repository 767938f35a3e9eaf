"""The fused decoder-layer kernels compile for an H100/H200 (sm_90) on a machine without a
GPU (as tests/unit/test_triton_compile.py does for attention): the attention prologue, the
MoE decode kernels in each split-K mode and the combine with the residual add + norm, and the
greedy argmax beside them. The interpreter accepts code the compiler rejects (a name bound to
tiles of two shapes in the two sides of a runtime branch, dtype constexprs passed down): this
runs the real pipeline.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import triton_compile

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs triton, compiled mode", allow_module_level=True)

prologue = pytest.importorskip("ds4pool.model.kernels.triton_prologue")
moe_decode = pytest.importorskip("ds4pool.model.kernels.triton_moe_decode")
moe_combine = pytest.importorskip("ds4pool.model.kernels.triton_moe_combine")
moe_gate = pytest.importorskip("ds4pool.model.kernels.triton_moe_gate")
moe_route = pytest.importorskip("ds4pool.model.kernels.triton_moe_route")
argmax = pytest.importorskip("ds4pool.model.kernels.triton_argmax")

pytest.importorskip("triton.backends.compiler")  # the NVIDIA backend, to compile for sm_90
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
# pointer parameters by element type; the rest are bf16 (activations, weights, cache)
I64_PTRS = {"pos_ptr", "slot_ptr", "ids_ptr", "groups_ptr"}
F32_PTRS = {"inv_ptr", "part_ptr", "ypart_ptr", "weights_ptr"}


def compile_sm90(
    fn: object,
    consts: dict,
    num_warps: int = 4,
    num_stages: int = 3,
    f32: frozenset = frozenset(),
    box: tuple[int, int] | None = None,
) -> object:
    """`f32`: more pointers that carry float32 in this launch (decode_experts passes its
    partials buffer in place of an unused h or y); `box`: the weights' TMA descriptor's
    block shape (USE_TMA), else w_desc is the weights' pointer again."""
    pointers = {name: "*i64" for name in I64_PTRS} | {name: "*fp32" for name in F32_PTRS | f32}
    if "USE_TMA" in fn.arg_names:  # the MoE decode kernels
        consts = {"USE_TMA": box is not None, **consts}
    types = {"w_desc": f"tensordesc<bf16[{box[0]},{box[1]}]>" if box else "*bf16"}
    return triton_compile.compile_sm90(
        fn, consts, num_warps, num_stages, pointers=pointers,
        f32_scalars={"eps", "factor", "scaling"},
        types=types,
    )  # fmt: skip


def tma_without_spills(kernel: object) -> None:
    """What the H200 can run as meant: weights by TMA copies, no register spills (where
    triton ships cuobjdump), shared memory within the 227 KiB a program may have."""
    assert "cp.async.bulk.tensor" in kernel.asm["ptx"], "the weights are not loaded by TMA"
    usage = triton_compile.resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


@pytest.mark.parametrize("norm, block_kv", [(True, 4), (False, 8)])  # Qwen3-30B-A3B, Llama-3-8B
def test_prologue_compiles(norm: bool, block_kv: int) -> None:
    consts = dict(D=128, HALF=64, HALF_PAD=64, BLOCK_Q=16, BLOCK_KV=block_kv, HAS_NORM=norm)
    compile_sm90(prologue._prologue_kernel, consts)


# a gate_up launch's routing constexprs: none (the groups are given), or the Qwen3-30B-A3B
# router's (softmax top-8 of 128, renormalised) over `tokens` (triton_moe_route.route_args)
def gate_up_route(tokens: int | None) -> dict:
    if tokens is None:
        return dict(moe_decode._no_route(None)[1], ROUTE=False)  # type: ignore[arg-type]
    return dict(ROUTE=True, ROUTER=0, NORMALIZE=True, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1,
                ROUTE_T=tokens, BLOCK_E=128, BLOCK_G=min(128, 8 * tokens), BLOCK_NG=1)  # fmt: skip


@pytest.mark.parametrize(
    "split, dot, route",
    [(1, True, None), (2, True, None), (4, False, None), (1, True, 1), (1, False, 1),
     (2, True, 8), (1, True, 32)],
)  # fmt: skip
def test_moe_gate_up_compiles(split: int, dot: bool, route: int | None) -> None:
    """Dot or GEMV tiles, split-K, and the routing in the kernel (the router's rows fewer
    than the tile's at one token, as many at 32)."""
    consts = dict(TOP_K=8, BLOCK_T=max(16, route or 1) if dot else 1, BLOCK_KS=8, BLOCK_N=32,
                  BLOCK_K=128, USE_DOT=dot, PRECISION="tf32", SPLIT=split,
                  **gate_up_route(route))  # fmt: skip
    f32 = {"h_ptr"} if split > 1 else set()
    if route is not None:  # the logits of a bf16 model's router
        f32.add("bias_ptr")
    compile_sm90(moe_decode._gate_up_kernel, consts, 4, 4, frozenset(f32))


# router → (ROUTER, experts, top-k, groups, groups kept): Qwen3-30B-A3B, Mixtral, DeepSeek-V3
ROUTERS = {"qwen3": (0, 128, 8, 1, 1), "mixtral": (1, 8, 2, 1, 1), "deepseek": (2, 256, 8, 8, 4)}


def router_consts(name: str, tokens: int) -> dict:
    router, e, k, n_group, topk_group = ROUTERS[name]
    return dict(ROUTER=router, TOP_K=k, NORMALIZE=router != 1, HAS_BIAS=router == 2,
                N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_E=e, BLOCK_KS=k,
                BLOCK_G=min(e, k * tokens), BLOCK_NG=n_group)  # fmt: skip


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_kernel_compiles(name: str) -> None:
    """The route launch, its sums by _pairwise_sum (reshape + split) and DeepSeek's group
    limit, compiled as route_fused launches it; and the same routing inside a gate_up."""
    f32 = frozenset({"logits_ptr", "bias_ptr"})
    consts = dict(router_consts(name, 8), BLOCK_T=8)
    compile_sm90(moe_route._route_kernel, consts, 4, 3, f32)
    consts = dict(router_consts(name, 2), ROUTE=True, ROUTE_T=2, BLOCK_T=16, BLOCK_N=32,
                  BLOCK_K=128, USE_DOT=True, PRECISION="tf32", SPLIT=1)  # fmt: skip
    compile_sm90(moe_decode._gate_up_kernel, consts, 4, 3, f32)


@pytest.mark.parametrize("tokens", [1, 2])
def test_routing_in_the_gate_up_does_not_make_it_spill(tokens: int) -> None:
    """The step sizes that route in the gate_up by default (model/moe.py ROUTE_IN_GATE_UP),
    at their table configs: the router's tile adds no register spills (where triton ships
    cuobjdump), as the unrouted kernel has none."""
    from ds4pool.model.kernels.triton_moe_configs import config_for

    gu = config_for(tokens).gate_up
    consts = dict(TOP_K=8, BLOCK_T=16, BLOCK_KS=8, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
                  USE_DOT=True, PRECISION="tf32", SPLIT=gu.split_k,
                  **gate_up_route(tokens))  # fmt: skip
    f32 = frozenset({"bias_ptr"} | ({"h_ptr"} if gu.split_k > 1 else set()))
    kernel = compile_sm90(moe_decode._gate_up_kernel, consts, gu.num_warps, gu.num_stages, f32)
    usage = triton_compile.resource_usage(kernel.asm["cubin"])
    if usage is None:
        pytest.skip("no cuobjdump to read the kernel's resource usage")
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"


@pytest.mark.parametrize("gu_split, split", [(1, 1), (2, 1), (1, 4), (4, 2)])
def test_moe_down_compiles(gu_split: int, split: int) -> None:
    consts = dict(TOP_K=8, BLOCK_T=16, BLOCK_KS=8, BLOCK_N=32, BLOCK_K=64, USE_DOT=True,
                  PRECISION="tf32", GU_SPLIT=gu_split, SPLIT=split)  # fmt: skip
    f32 = ({"h_ptr"} if gu_split > 1 else set()) | ({"y_ptr"} if split > 1 else set())
    compile_sm90(moe_decode._down_kernel, consts, 8, 2, frozenset(f32))


@pytest.mark.parametrize("norm, split", [(False, 1), (True, 1), (True, 2)])
def test_moe_combine_compiles(norm: bool, split: int) -> None:
    consts = dict(TOP_K=8, BLOCK_N=2048 if norm else 256, SPLIT=split, NORM=norm)
    compile_sm90(moe_combine._combine_kernel, consts, f32=frozenset({"y_ptr"} if split > 1 else ()))


# TMA weight boxes (ProjTiles.tma) at the H200's one-token configs (triton_moe_configs
# DECODE_CONFIGS[0]) and a wide box: dot and GEMV tiles, with and without split-K
@pytest.mark.parametrize(
    "n, k, split, dot, stages",
    [(32, 128, 1, True, 4), (64, 256, 1, True, 2), (32, 128, 2, False, 3)],
)
def test_moe_gate_up_compiles_with_tma(n: int, k: int, split: int, dot: bool, stages: int) -> None:
    consts = dict(TOP_K=8, BLOCK_T=16 if dot else 1, BLOCK_KS=8, BLOCK_N=n, BLOCK_K=k,
                  USE_DOT=dot, PRECISION="tf32", SPLIT=split, **gate_up_route(1))  # fmt: skip
    f32 = frozenset({"h_ptr", "bias_ptr"} if split > 1 else {"bias_ptr"})
    tma_without_spills(compile_sm90(moe_decode._gate_up_kernel, consts, 4, stages, f32, (n, k)))


# (a down that activates gate_up partials, GU_SPLIT > 1, holds both partial tiles: at these
# tiles it spills with pointer loads and with TMA alike, less with TMA; the sweep times it)
@pytest.mark.parametrize("gu_split, split, warps", [(1, 1, 2), (1, 2, 4)])
def test_moe_down_compiles_with_tma(gu_split: int, split: int, warps: int) -> None:
    consts = dict(TOP_K=8, BLOCK_T=16, BLOCK_KS=8, BLOCK_N=64, BLOCK_K=128, USE_DOT=True,
                  PRECISION="tf32", GU_SPLIT=gu_split, SPLIT=split)  # fmt: skip
    f32 = ({"h_ptr"} if gu_split > 1 else set()) | ({"y_ptr"} if split > 1 else set())
    kernel = compile_sm90(moe_decode._down_kernel, consts, warps, 4, frozenset(f32), (64, 128))
    tma_without_spills(kernel)


def test_moe_gate_compiles_without_spills() -> None:
    """The add + norm + router launch at Qwen3-30B-A3B's shape (2048 wide, 8 experts a
    program, 4 warps: triton_moe_gate's one launch for every T)."""
    kernel = compile_sm90(moe_gate._norm_logits_kernel, dict(BLOCK_H=2048, BLOCK_E=8), 4, 1)
    usage = triton_compile.resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"


def test_the_argmax_kernel_compiles() -> None:
    pointers = {"val_ptr": "*fp32", "nan_ptr": "*i32", "idx_ptr": "*i32", "cnt_ptr": "*i32",
                "out_ptr": "*i64"}  # fmt: skip
    kernel = triton_compile.compile_sm90(
        argmax._argmax_kernel, dict(BLOCK=argmax.BLOCK, CHUNKS_PAD=32), 4, 1, pointers=pointers
    )
    assert "atom.global" in kernel.asm["ptx"]
