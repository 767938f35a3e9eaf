"""The paged MLA decode kernel compiles for an H100/H200 (sm_90) on a machine without a GPU,
at DeepSeek-V3's latent shape (R = 512, r = 64), with its latent loads software-pipelined and
no register spills (cuobjdump's resource usage of the cubin, where triton ships the tool).
Skipped where triton or its NVIDIA backend is missing, or under the interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import triton_compile
from tests.triton_compile import resource_usage

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs triton, compiled mode", allow_module_level=True)

tm = pytest.importorskip("ds4pool.model.kernels.triton_mla")
dk = pytest.importorskip("ds4pool.model.kernels._decode_kernels")
nvidia = pytest.importorskip("triton.backends.nvidia")  # the NVIDIA backend, to compile for sm_90
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
# AttentionMetadata's int64 tables and lengths, as TritonMLAAttention passes them
POINTERS = {"tables_ptr": "*i64", "lens_ptr": "*i64"}
POINTERS |= {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def compile_decode(split: bool, dtype: str) -> object:
    launch = tm.DEFAULT_MLA_DECODE
    consts = dict(H=16, BLOCK_H=launch.block_h, R=512, R_PAD=512, ROPE=64, ROPE_PAD=64, BS=16,
                  BLOCK_N=launch.block_n, SHORT=0 if split else 1024,
                  SPLIT=split, PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    pointers = POINTERS | {p: f"*{dtype}" for p in ("q_ptr", "cache_ptr", "out_ptr")}
    return triton_compile.compile_sm90(
        tm.mla_decode_kernel, consts, launch.num_warps, launch.num_stages, pointers=pointers,
        f32_scalars={"scale_log2"}, align_strides=True,
    )  # fmt: skip


@pytest.mark.parametrize("split, dtype", [(True, "bf16"), (False, "bf16"), (True, "fp32")])
def test_mla_decode_compiles_pipelined_without_spills(split: bool, dtype: str) -> None:
    kernel = compile_decode(split, dtype)
    ttgir = kernel.asm["ttgir"]  # type: ignore[attr-defined]
    assert ttgir.count("async_copy_global_to_local") > 0, "latent loads are not pipelined"
    usage = resource_usage(kernel.asm["cubin"])  # type: ignore[attr-defined]
    if usage is None:
        pytest.skip("no cuobjdump to read the cubin's register use")
    if dtype == "bf16":  # the model's dtype: no spill, well under the 255 cap (4 warps sat at 254)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
        assert usage["REG"] < 200, usage
    else:  # the partition size as a run-time value (no compile per eager shape) costs the
        # fp32 split variant an 8-byte stack frame (it had none with a constexpr size)
        assert usage["LOCAL"] == 0 and usage["STACK"] <= 8, f"register spills: {usage}"


def test_the_dense_reduce_compiles_at_the_latent_width() -> None:
    consts = dict(H=16, D=512, D_PAD=512, SHORT=0, BLOCK_N=32, FIXED_P=False,
                  P_CHUNK=16, USE_WINDOW=False)  # fmt: skip
    triton_compile.compile_sm90(
        dk.decode_reduce_kernel, consts, 4, 2, pointers=POINTERS, align_strides=True
    )
