"""The add + RMSNorm + router-linear launch (kernels/triton_moe_gate.py) on the GPU: against
the fused add + norm kernel and F.linear it replaces, and a whole Qwen3-MoE-shaped model with
the launch on and off (SparseMoeBlock.fuse_gate), replayed from CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_moe_cuda import CUDA, decode, rel_err, tiny_moe

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("experts", [128, 60, 8])
def test_one_launch_equals_the_add_norm_and_the_router_linear(tokens: int, experts: int) -> None:
    from ds4pool.model.kernels.triton_fused import rms_norm
    from ds4pool.model.kernels.triton_moe_gate import add_norm_logits

    gen = torch.Generator(device=CUDA).manual_seed(tokens + experts)
    hidden, dt = 2048, torch.bfloat16
    a = torch.randn(tokens, hidden, device=CUDA, generator=gen).to(dt)
    residual = torch.randn(tokens, hidden, device=CUDA, generator=gen).to(dt)
    norm_w = (torch.rand(hidden, device=CUDA, generator=gen) + 0.5).to(dt)
    router_w = (torch.randn(experts, hidden, device=CUDA, generator=gen) * 0.02).to(dt)
    got_r, got_h, got_l = add_norm_logits(a, residual, norm_w, 1e-6, router_w)
    want_r = residual.clone()
    want_h = rms_norm(a, norm_w, 1e-6, residual=want_r)
    assert torch.equal(got_r, want_r)
    assert torch.equal(got_h, want_h)
    assert got_l.dtype == dt
    assert rel_err(got_l, F.linear(want_h, router_w)) < 1e-2
    # a row's logits are the same bits whatever the other rows of the step
    solo = add_norm_logits(a[-1:], residual[-1:], norm_w, 1e-6, router_w)[2]
    assert torch.equal(solo[0], got_l[-1])


def test_a_moe_model_with_the_fused_gate_decodes_as_without_it() -> None:
    loaded = tiny_moe(torch.bfloat16)
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    runs = {}
    for fused in (True, False):
        for b in blocks:
            b.impl, b.fuse_gate = "decode", fused
        runner = ModelRunner(loaded, num_blocks=64, cuda_graphs=True)
        runs[fused] = decode(runner, prompts, 12)
        assert runner.graphs is not None and runner.graphs.captures >= 1
    (f_tokens, f_logits), (u_tokens, u_logits) = runs[True], runs[False]
    same = sum(a == b for fa, ua in zip(f_tokens, u_tokens) for a, b in zip(fa, ua))
    assert same >= 0.95 * sum(len(x) for x in f_tokens), (f_tokens, u_tokens)
    assert rel_err(f_logits[0], u_logits[0]) < 2e-2
