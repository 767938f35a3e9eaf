"""The skinny decode GEMM (model/kernels/triton_linear.py) on the GPU: every candidate of the
sweep against cuBLAS on the projections of the 8B Llama and Qwen3-30B-A3B, split-K results
the same bits run to run and its counters left at zero, CUDA-graph replay equal to eager,
and a whole model decoding through TritonOps.linear with a table that sends every
projection to it, against the same model on cuBLAS."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ds4pool.model.kernels.triton_linear_configs import SkinnyConfig, sweep_configs
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


def _trace(loaded, prompts: list[list[int]], forced: list[list[int]] | None) -> tuple:  # noqa: ANN001
    r = ModelRunner(loaded, num_blocks=256, backend="triton", cuda_graphs=True)
    return decode_trace(r, prompts, forced, 8)


@pytest.mark.parametrize("spec", ["random:100m", "random:qwen3-moe-70m"])
def test_a_model_decodes_through_the_skinny_gemm_as_on_cublas(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection shape of the model in the table, for steps of 1 row and of 3 (the
    4-row bucket), teacher-forced by the fp32 model's tokens: the bf16 logits' error
    against fp32 no worse with the skinny GEMM than on cuBLAS (a tiny random MoE's routing
    flips on bf16 rounding, so the two bf16 runs are compared through the fp32 truth)."""
    loaded32 = load_model(spec, CUDA, torch.float32)
    loaded = dataclasses.replace(
        loaded32, model=copy.deepcopy(loaded32.model).to(torch.bfloat16), dtype=torch.bfloat16
    )
    shapes = {
        tuple(m.weight.shape)
        for m in loaded.model.modules()
        if type(m) is torch.nn.Linear and m.weight.dim() == 2
    }
    rows = [
        {"n": n, "k": k, "rows": b, "block_n": 16, "block_k": 128, "split": 2, "dot": True,
         "warps": 4, "stages": 3}
        for n, k in shapes for b in (1, 4, 16)
    ]  # fmt: skip
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
