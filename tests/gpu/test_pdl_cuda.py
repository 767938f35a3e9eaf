"""Programmatic dependent launch (model/kernels/_pdl.py) on the GPU: decode steps whose Triton
kernels start early (every kind of model/ops.py PDL_KINDS, not only the default's: the skinny
GEMM with its first weight tile loaded before the wait, plain and balanced, the decode
kernel, the MoE gate, gate_up, down and combine) give the same logits bits as the same
steps launched one after the other. A kernel that read an input before the kernel
making it had finished, or stored over what a running kernel still read, would show here:
the models are small, so their kernels are short and overlap the most."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds4pool.model.loader import load_model
from ds4pool.model.ops import PDL_KINDS
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_fast_path_cuda import decode_trace

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")


def _trace(loaded, prompts: list[list[int]], forced: list[list[int]] | None) -> tuple:  # noqa: ANN001
    r = ModelRunner(loaded, num_blocks=256, backend="triton", cuda_graphs=True)
    return decode_trace(r, prompts, forced, 12)


@pytest.mark.parametrize("spec", ["random:100m", "random:qwen3-moe-70m"])
@pytest.mark.parametrize("kinds", ["default", "all"])
def test_early_launched_kernels_give_the_same_logits_bits(
    spec: str, kinds: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection in the skinny GEMM's table (one row: GEMV programs by column blocks
    for half the shapes, balanced for the others, with the add + norm epilogue and the
    silu·mul loads where the layer fuses them; 3 rows: split-K dot tiles), CUDA-graph steps
    of 1 and 3 rows, teacher-forced by the run without PDL; with the default kinds (some
    launches only trigger the next one) and with every kind."""
    from ds4pool.model.kernels import _pdl

    if not _pdl.supported(CUDA):
        pytest.skip("programmatic dependent launch needs compute capability 9+")
    loaded = load_model(spec, CUDA, torch.bfloat16)
    shapes = sorted(
        {
            tuple(m.weight.shape)
            for m in loaded.model.modules()
            if type(m) is torch.nn.Linear and m.weight.dim() == 2
        }
    )
    gemv = {"block_n": 4, "block_k": 256, "dot": False, "stages": 1}
    dot = {"block_n": 16, "block_k": 128, "split": 2, "stages": 3}
    rows = []
    for i, (n, k) in enumerate(shapes):
        rows.append({"n": n, "k": k, "rows": 1, **gemv, "waves": 2 * (i % 2)})
        rows.append({"n": n, "k": k, "rows": 4, **dot})
    table = tmp_path / "all.json"
    table.write_text(json.dumps(rows))
    monkeypatch.setenv("DS4POOL_SKINNY_TABLE", str(table))
    setting = "1" if kinds == "default" else "+".join(PDL_KINDS)
    gen = torch.Generator().manual_seed(4)
    for lens in ((40,), (40, 9, 130)):
        prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lens]
        monkeypatch.setenv("DS4POOL_PDL", "0")
        tokens, plain = _trace(loaded, prompts, None)
        monkeypatch.setenv("DS4POOL_PDL", setting)
        _, early = _trace(loaded, prompts, tokens)
        assert len(plain) == len(early) > 0
        for step, (a, b) in enumerate(zip(plain, early, strict=True)):
            assert torch.equal(a, b), (spec, kinds, lens, step, float((a - b).abs().max()))
