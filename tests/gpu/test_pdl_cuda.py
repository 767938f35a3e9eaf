"""Programmatic dependent launch (kernels/_pdl.py) changes when the decode path's kernels are
placed, never what they compute: a Qwen3-MoE-shaped model (attention prologue → paged decode,
the fused gate, the experts' combine) decodes to the same bits with it on and off, replayed
from CUDA graphs and eagerly. A kernel that read its predecessor's output before its
gdc_wait would show here as a difference."""

from __future__ import annotations

import pytest
import torch

from ds4pool.model.kernels import _pdl
from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_moe_cuda import decode, tiny_moe

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")


@pytest.mark.parametrize("graphs", [True, False])
def test_pdl_on_and_off_decode_the_same_bits(graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    loaded = tiny_moe(torch.bfloat16)
    for m in loaded.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.impl = "decode"
    gen = torch.Generator().manual_seed(2)
    # a 1,100-token prompt: its table is wider than the short-row limit, so the decode launch
    # splits (decode_kernel, then its reduce, both PDL launches)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 1100, 23)]
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(_pdl.ENV, flag)
        assert _pdl.enabled(torch.device("cuda")) == (flag == "1")
        runner = ModelRunner(loaded, num_blocks=128, cuda_graphs=graphs)
        runs[flag] = decode(runner, prompts, 10)
    (on_tokens, on_logits), (off_tokens, off_logits) = runs["1"], runs["0"]
    assert on_tokens == off_tokens
    assert all(torch.equal(a, b) for a, b in zip(on_logits, off_logits))
