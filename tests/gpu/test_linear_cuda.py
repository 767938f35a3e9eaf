"""The skinny decode GEMM (model/kernels/triton_linear.py) on the GPU: every candidate of the
sweep against cuBLAS on the projections of the 8B Llama and Qwen3-30B-A3B, split-K results
the same bits run to run and its counters left at zero, CUDA-graph replay equal to eager,
the fusions (silu·mul loads, the add + norm epilogue) against the unfused kernels on the
table's launches, and a whole model decoding through TritonOps.linear with a table that
sends every projection to it, against the same model on cuBLAS."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ds4pool.model.kernels.triton_linear_configs import (
    SKINNY_TABLE,
    SkinnyConfig,
    config_for,
    sweep_configs,
)
from ds4pool.model.loader import load_model
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_fast_path_cuda import decode_trace, worst_error

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")
SHAPES = [(4096, 6144), (4096, 4096), (2048, 5120), (4096, 2048), (1000, 72)]  # (K, N)


def case(k: int, n: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(seed + k + n + rows)
    w = (torch.randn(n, k, device=CUDA, generator=gen) * 0.02).to(torch.bfloat16)
    return torch.randn(rows, k, device=CUDA, generator=gen).to(torch.bfloat16), w


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got.float() - want.float()).abs().max()) <= 1e-2 * float(want.abs().max())


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_every_sweep_candidate_equals_cublas(k: int, n: int, rows: int) -> None:
    from ds4pool.model.kernels.triton_linear import SkinnyWorkspace, skinny_linear

    ws = SkinnyWorkspace(CUDA)
    x, w = case(k, n, rows)
    bias = torch.randn(n, device=CUDA).to(torch.bfloat16)
    want = F.linear(x, w, bias)
    from triton.runtime.errors import OutOfResources

    for cfg in sweep_configs(rows):
        try:
            got = skinny_linear(x, w, bias, cfg, ws)
        except OutOfResources:  # the sweep skips these too (shared memory of deep stages)
            continue
        assert close(got, want), cfg
        if cfg.split > 1:  # the last strip adds them in order: the same bits every time
            assert torch.equal(skinny_linear(x, w, bias, cfg, ws), got), cfg
    assert int(ws.counters.abs().sum()) == 0


def test_graph_replay_equals_eager_and_leaves_the_counters_at_zero() -> None:
    from ds4pool.model.kernels.triton_linear import SkinnyWorkspace, skinny_linear

    ws = SkinnyWorkspace(CUDA)
    cfg = SkinnyConfig(16, 256, split=4)
    x, w = case(4096, 6144, 2)
    eager = skinny_linear(x, w, None, cfg, ws)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(skinny_linear(x, w, None, cfg, ws))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("k, n", [(4096, 4096), (14336, 4096), (4096, 2048)])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_fusions_give_the_unfused_kernels_results(k: int, n: int, rows: int) -> None:
    """o_proj's and down's launches of the table (or a split-K dot where it has none) with
    the add + norm epilogue, down's with the silu·mul loads too: the residual stream the
    same bits as the unfused kernels', the normalised rows one bf16 rounding apart at most,
    the same bits run to run and in a CUDA-graph replay, the counters left at zero."""
    from ds4pool.model.kernels import triton_fused
    from ds4pool.model.kernels.triton_linear import AddNorm, SkinnyWorkspace, skinny_linear

    cfg = config_for(n, k, rows, SKINNY_TABLE) or SkinnyConfig(32, 128, split=4)
    act = k == 14336
    ws = SkinnyWorkspace(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(k + n + rows)
    x = torch.randn(rows, 2 * k if act else k, device=CUDA, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device=CUDA, generator=gen) * 0.02).to(torch.bfloat16)
    residual = torch.randn(rows, n, device=CUDA, generator=gen).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(n, device=CUDA, generator=gen)).to(torch.bfloat16)
    y = skinny_linear(triton_fused.silu_mul(x) if act else x, w, None, cfg, ws)
    want_res = residual.clone()
    want_h = triton_fused.rms_norm(y, nw, 1e-5, residual=want_res)

    def fused(res: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, w, None, cfg, ws, act=act, add_norm=AddNorm(res, nw, 1e-5))

    got_res = residual.clone()
    got_h = fused(got_res)
    assert torch.equal(got_res, want_res), cfg
    ulp = torch.finfo(torch.bfloat16).eps * want_h.float().abs().clamp_min(1e-3)
    assert bool(((got_h.float() - want_h.float()).abs() <= ulp).all()), cfg
    again_res = residual.clone()
    assert torch.equal(fused(again_res), got_h) and torch.equal(again_res, got_res)
    graph_res = residual.clone()
    out = torch.empty_like(got_h)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fused(graph_res))
    for _ in range(2):
        graph_res.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got_h) and torch.equal(graph_res, got_res), cfg
    assert int(ws.counters.abs().sum()) == 0 and int(ws.done.abs().sum()) == 0


def _trace(loaded, prompts: list[list[int]], forced: list[list[int]] | None) -> tuple:  # noqa: ANN001
    r = ModelRunner(loaded, num_blocks=256, backend="triton", cuda_graphs=True)
    return decode_trace(r, prompts, forced, 8)


@pytest.mark.parametrize("spec", ["random:100m", "random:qwen3-moe-70m"])
def test_a_model_decodes_through_the_skinny_gemm_as_on_cublas(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection shape of the model in the table, for steps of 1 row and of 3 (the
    4-row bucket), with the fusions (o_proj's and down's add + norm, down's silu·mul),
    teacher-forced by the fp32 model's tokens: the bf16 logits' error against fp32 no
    worse with the skinny GEMM than on cuBLAS (a tiny random MoE's routing flips on bf16
    rounding, so the two bf16 runs are compared through the fp32 truth)."""
    loaded32 = load_model(spec, CUDA, torch.float32)
    loaded = dataclasses.replace(
        loaded32, model=copy.deepcopy(loaded32.model).to(torch.bfloat16), dtype=torch.bfloat16
    )
    shapes = {
        tuple(m.weight.shape)
        for m in loaded.model.modules()
        if type(m) is torch.nn.Linear and m.weight.dim() == 2
    }
    launches = {  # one row: a balanced GEMV; 4 and 16: split-K dot tiles
        1: {"block_n": 4, "block_k": 256, "dot": False, "stages": 1, "waves": 2},
        4: {"block_n": 16, "block_k": 128, "split": 2, "stages": 3},
        16: {"block_n": 16, "block_k": 128, "split": 2, "stages": 3},
    }
    rows = [{"n": n, "k": k, "rows": b, **launches[b]} for n, k in shapes for b in launches]
    table = tmp_path / "all.json"
    table.write_text(json.dumps(rows))
    gen = torch.Generator().manual_seed(3)
    for lens in ((40,), (40, 9, 130)):
        prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lens]
        monkeypatch.setenv("DS4POOL_SKINNY_TABLE", "0")
        tokens, truth = _trace(loaded32, prompts, None)
        _, ref = _trace(loaded, prompts, tokens)
        monkeypatch.setenv("DS4POOL_SKINNY_TABLE", str(table))
        _, got = _trace(loaded, prompts, tokens)
        ref_err, got_err = worst_error(truth, ref), worst_error(truth, got)
        print(f"\n{spec} {len(lens)} rows: bf16 vs fp32 cuBLAS {ref_err:.3e}, skinny {got_err:.3e}")
        assert got_err <= 1.25 * ref_err + 1e-3, (got_err, ref_err)
