"""The add + RMSNorm + router-linear launch of a sparse layer's decode path
(model/kernels/triton_moe_gate.py) under Triton's CPU interpreter: against the two launches it
replaces (triton_fused.rms_norm with the residual, then F.linear), alone and inside a whole
decoder layer (LlamaDecoderLayer with TritonOps: SparseMoeBlock.decode_layer against the
unfused add_rms_norm + add_norm).

As in test_triton_moe_decode.py, the cases run in one child interpreter (this file as a
script) that prints a JSON line each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

# case → (tokens, hidden, experts, dtype, experts a program; 0: the default):
# non-power-of-two hidden and experts, one token, a program per expert, a partial last block
KERNEL_CASES: dict[str, tuple[int, int, int, str, int]] = {
    "one_token": (1, 64, 16, "float32", 0),
    "ragged": (5, 48, 20, "float32", 0),
    "fp16_many_tokens": (17, 64, 8, "float16", 0),
    "an_expert_a_program": (3, 48, 20, "float32", 1),
    "wide_blocks": (2, 48, 20, "float32", 16),
}
# case → (router, tokens)
LAYER_CASES: dict[str, tuple[str, int]] = {
    "qwen3_t1": ("softmax_topk", 1),
    "qwen3_t6": ("softmax_topk", 6),
    "mixtral_t3": ("topk_softmax", 3),
}


def _kernel_case(name: str) -> dict[str, Any]:
    import torch
    from torch.nn import functional as F

    from ds4pool.model.kernels.triton_fused import rms_norm
    from ds4pool.model.kernels.triton_moe_gate import add_norm_logits

    t, hidden, experts, dtype_name, block_e = KERNEL_CASES[name]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(len(name))
    a = torch.randn(t, hidden, generator=g).to(dtype)
    residual = torch.randn(t, hidden, generator=g).to(dtype)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    router_w = (torch.randn(experts, hidden, generator=g) * 0.1).to(dtype)
    before = residual.clone()
    got_r, got_h, got_l = add_norm_logits(a, residual, norm_w, 1e-6, router_w, block_e=block_e)
    want_r = residual.clone()
    want_h = rms_norm(a, norm_w, 1e-6, residual=want_r)
    want_l = F.linear(want_h.float(), router_w.float())
    return {
        "name": name,
        "residual_untouched": bool(torch.equal(residual, before)),
        "residual_equal": bool(torch.equal(got_r, want_r)),
        "h_equal": bool(torch.equal(got_h, want_h)),
        "logits_dtype": str(got_l.dtype),
        "logits_err": float((got_l.float() - want_l).abs().max() / want_l.abs().max()),
        "tolerance": 1e-6 if dtype == torch.float32 else 2e-3,
    }


def _layer_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.config import MoEConfig
    from ds4pool.model.layers import RMSNorm
    from ds4pool.model.moe import SparseMoeBlock
    from ds4pool.model.ops import TritonOps

    router, t = LAYER_CASES[name]
    hidden = 48
    moe = MoEConfig(
        num_experts=12,
        top_k=3,
        intermediate_size=24,
        router=router,
        sparse_layers=(0,),
        norm_topk_prob=True,
    )
    torch.manual_seed(len(name))
    block = SparseMoeBlock(moe, hidden)
    block.impl = "decode"  # on the CPU "auto" would take the loop
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    pre, nxt = RMSNorm(hidden, 1e-6), RMSNorm(hidden, 1e-6)
    pre.weight.data.uniform_(0.5, 1.5)
    nxt.weight.data.uniform_(0.5, 1.5)
    a, residual = torch.randn(t, hidden), torch.randn(t, hidden)
    ops = TritonOps()
    with torch.no_grad():
        block.fuse_gate = True
        fused = block.decode_layer(a, residual.clone(), pre, nxt, ops)
        r1, h1 = ops.add_rms_norm(pre, a, residual.clone())
        want = block.add_norm(h1, r1, nxt, ops)
        block.fuse_gate = False
        off = block.decode_layer(a, residual.clone(), pre, nxt, ops)
    assert fused is not None and want is not None
    return {
        "name": name,
        "off_is_none": off is None,
        "residual_err": float((fused[0] - want[0]).abs().max()),
        "h_err": float((fused[1] - want[1]).abs().max() / want[1].abs().max()),
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=300)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_one_launch_equals_the_add_norm_and_the_router_linear(
    results: dict[str, dict], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["residual_untouched"], "the input residual must not be updated in place"
    assert r["residual_equal"], "residual + a must round as the fused add + norm does"
    assert r["h_equal"], "the normalised row must be the rms_norm kernel's, bit for bit"
    assert r["logits_err"] < r["tolerance"], r


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_a_sparse_layer_through_the_fused_gate_matches_the_unfused_one(
    results: dict[str, dict], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["off_is_none"], "fuse_gate = False must leave the layer to the unfused path"
    assert r["residual_err"] < 1e-5, r
    assert r["h_err"] < 1e-5, r


if __name__ == "__main__":
    print_cases(KERNEL_CASES, _kernel_case)
    print_cases(LAYER_CASES, _layer_case)
