"""The small-batch MoE decode kernels (model/kernels/triton_moe_decode.py) under Triton's CPU
interpreter: the fused router against the torch routers, the expert groups, and whole sparse
blocks on the decode path against the per-expert reference loop for the Qwen3-MoE, Mixtral
and DeepSeek-V3 routers.

As in test_triton_moe.py, TRITON_INTERPRET=1 must be set before the kernels are decorated:
the cases run in one child interpreter (this file as a script) that prints a JSON line each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

# router case → (router, norm_topk_prob, tokens, experts, top-k, groups, groups kept):
# non-power-of-two experts and tokens, one token, 16 tokens, DeepSeek-V3's group limit
ROUTER_CASES: dict[str, tuple[str, bool, int, int, int, int, int]] = {
    "qwen3_norm_one_token": ("softmax_topk", True, 1, 60, 4, 1, 1),
    "qwen3_plain_ragged": ("softmax_topk", False, 5, 24, 3, 1, 1),
    "mixtral_16_tokens": ("topk_softmax", False, 16, 8, 2, 1, 1),
    "deepseek_v3_groups": ("sigmoid_group_topk", True, 7, 32, 4, 8, 3),
    "deepseek_v3_one_group": ("sigmoid_group_topk", False, 3, 20, 6, 1, 1),
    "deepseek_v3_singleton_groups": ("sigmoid_group_topk", True, 2, 8, 2, 8, 4),
}
# block case → (router, tokens, dtype, GEMV up to this many tokens; None: the default):
# the whole SparseMoeBlock on the decode path vs the loop, both kinds of expert tiles
BLOCK_CASES: dict[str, tuple[str, int, str, int | None]] = {
    "qwen3_moe_t1_gemv": ("softmax_topk", 1, "float32", None),
    "qwen3_moe_t1_dot": ("softmax_topk", 1, "float32", 0),
    "qwen3_moe_t5_gemv": ("softmax_topk", 5, "float32", 8),
    "qwen3_moe_t7_dot": ("softmax_topk", 7, "float32", None),
    "qwen3_moe_t20_dot": ("softmax_topk", 20, "float32", None),
    "qwen3_moe_fp16": ("softmax_topk", 6, "float16", None),
    "mixtral_t3": ("topk_softmax", 3, "float32", None),
    "deepseek_v3_t5": ("sigmoid_group_topk", 5, "float32", None),
    "deepseek_v3_t1": ("sigmoid_group_topk", 1, "float32", None),
}


# config cases: tile shapes the sweep tries (triton_moe_configs.sweep_shapes, both
# projections at once, the split-K partial paths included) at one token (GEMV tiles) and
# five (dot tiles), fp32. Under the interpreter, the 9 of the 27 shapes of an orthogonal
# array: every value of block_n, block_k and split_k and every pair of them (the kernels
# branch on each alone, never on a triple); all 27 run compiled in tests/gpu/test_moe_cuda.py.
CONFIG_TOKENS = (1, 5)


def _config_cases() -> list[str]:
    from ds4pool.model.kernels.triton_moe_configs import (
        SWEEP_BLOCK_K,
        SWEEP_BLOCK_N,
        SWEEP_SPLIT_K,
    )

    levels = range(len(SWEEP_BLOCK_N))
    assert len(SWEEP_BLOCK_K) == len(SWEEP_SPLIT_K) == len(levels) == 3
    shapes = [
        (SWEEP_BLOCK_N[i], SWEEP_BLOCK_K[j], SWEEP_SPLIT_K[(i + j) % 3])
        for i in levels
        for j in levels
    ]
    plain = [f"config_t{t}_n{n}_k{k}_s{sp}" for t in CONFIG_TOKENS for n, k, sp in shapes]
    # weights by TMA boxes (ProjTiles.tma): both tile kinds, with and without split-K, a box
    # wider than the row (the zero fill past K) and one taller than the intermediate size
    tma = ["config_t1_n16_k64_s2_tma", "config_t1_n64_k256_s1_tma", "config_t5_n32_k128_s1_tma",
           "config_t5_n128_k64_s4_tma"]  # fmt: skip
    # GEMV-only tiles (narrower than tl.dot's 16 columns; one token): whole and split strips
    narrow = ["config_t1_n4_k512_s1", "config_t1_n2_k1024_s2", "config_t1_n8_k64_s4"]
    return plain + tma + narrow


def _config_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.config import MoEConfig
    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig, ProjTiles
    from ds4pool.model.moe import SparseMoeBlock

    _, t, n, k, s, *tma = name.split("_")
    tokens = int(t[1:])
    tiles = ProjTiles(int(n[1:]), int(k[1:]), int(s[1:]), tma=bool(tma))
    # hidden 136, width 72: K strips that end mid-block, splits of unequal work (a split
    # of a strip shorter than split x BLOCK_K has fewer programs: the down's from BLOCK_K
    # 128 on, the gate_up's at 256, have one; the kernels' code is the same at every BLOCK_K)
    moe = MoEConfig(6, 2, 72, "softmax_topk", (0,), norm_topk_prob=True)  # few programs
    block = SparseMoeBlock(moe, 136)
    gen = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    x = torch.randn(tokens, 136, generator=gen)
    with torch.no_grad():
        block.impl = "loop"
        truth = block.double()(x.double())
        block.impl = "decode"
        block.decode_config = DecodeConfig(tiles, tiles, gemv=True if tiles.block_n < 16 else None)
        block.decode_gemv_tokens = 1  # one token by GEMV, more by dot tiles
        got = block.float()(x.float()).double()
    return {"name": name, "rel": float((got - truth).abs().max() / truth.abs().max())}


# fused norm case → down projection's split-K: decode_experts with the layer's residual add
# and RMSNorm in the combine vs the plain combine followed by TritonOps.add_rms_norm
NORM_CASES = {"combine_norm_s1": 1, "combine_norm_s2": 2}


def _norm_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.kernels.triton_moe_configs import DEFAULT, DecodeConfig, ProjTiles
    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import expert_groups
    from ds4pool.model.layers import RMSNorm
    from ds4pool.model.ops import TritonOps
    from ds4pool.model.routers import route_softmax_topk

    gen = torch.Generator().manual_seed(7)
    t, e, k, hidden, inter = 3, 6, 2, 48, 136  # a non-power-of-two row (masked tail)
    x = torch.randn(t, hidden, generator=gen)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = route_softmax_topk(torch.randn(t, e, generator=gen), k, True)
    groups = expert_groups(ids, e)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    config = DecodeConfig(DEFAULT.gate_up, ProjTiles(32, 64, NORM_CASES[name]))
    residual = torch.randn(t, hidden, generator=gen)
    plain = decode_experts(x, weights, ids, groups, gate_up, down, config=config)
    want_res, want_h = TritonOps().add_rms_norm(norm, plain, residual.clone())
    got_res = residual.clone()
    got_h = decode_experts(
        x, weights, ids, groups, gate_up, down, config=config, residual=got_res,
        norm_weight=norm.weight.detach(), eps=norm.eps,
    )  # fmt: skip
    return {
        "name": name,
        "residual_equal": torch.equal(got_res, want_res),
        "norm_err": float((got_h - want_h).abs().max()),
        "moved": float((got_res - residual).abs().max()),
    }


def _router_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.config import MoEConfig
    from ds4pool.model.kernels.triton_moe_route import expert_groups, route_fused
    from ds4pool.model.routers import route

    router, norm, t, e, k, n_group, topk_group = ROUTER_CASES[name]
    moe = MoEConfig(e, k, 16, router, (0,), norm, n_group, topk_group, 2.5)
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(t, e, generator=gen)
    bias = torch.rand(e, generator=gen) * 0.2 if router == "sigmoid_group_topk" else None
    w, ids, groups = route_fused(moe, logits, bias)
    want_w, want_ids = route(moe, logits, bias)
    if router == "sigmoid_group_topk":  # the reference's top-k is unsorted: compare as sets
        order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
        w, ids = w.gather(1, order), ids.gather(1, order)
        want_w, want_ids = want_w.gather(1, want_order), want_ids.gather(1, want_order)
    distinct = sorted(set(want_ids.flatten().tolist()))
    want_groups = distinct + [-1] * (min(e, t * k) - len(distinct))
    return {
        "name": name,
        "ids_equal": torch.equal(ids, want_ids) and ids.dtype == torch.int64,
        "weights_err": float((w - want_w).abs().max()),
        "groups": groups.tolist(),
        "want_groups": want_groups,
        "groups_from_ids": expert_groups(want_ids, e).tolist(),
    }


def _block_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.config import MoEConfig
    from ds4pool.model.moe import SparseMoeBlock

    router, t, dtype, gemv_tokens = BLOCK_CASES[name]
    hidden = 48
    if router == "sigmoid_group_topk":  # groups of 4, 2 kept, 2 shared experts, scaled
        moe = MoEConfig(16, 4, 40, router, (0,), True, 4, 2, 2.5, num_shared_experts=2)
    else:
        moe = MoEConfig(12, 3, 40, router, (0,), norm_topk_prob=True)
    block = SparseMoeBlock(moe, hidden)
    block.decode_gemv_tokens = gemv_tokens
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        if block.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.copy_(torch.rand(16, generator=gen) * 0.1)
    x = torch.randn(t, hidden, generator=gen)
    with torch.no_grad():
        block.impl = "loop"
        truth = block.double()(x.double())
        block.impl = "decode"
        got = block.to(getattr(torch, dtype))(x.to(getattr(torch, dtype))).double()
    return {
        "name": name,
        "rel": float((got - truth).abs().max() / truth.abs().max()),
        "tolerance": 1e-5 if dtype == "float32" else 3e-3,
    }


def test_tma_boxes_only_where_the_weights_can_be_described() -> None:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ds4pool.model.kernels.triton_moe_tiles import weight_boxes

    w = torch.zeros(3, 40, 64, dtype=torch.float16)
    boxes = weight_boxes(w, True, 32, 64)
    assert isinstance(boxes, TensorDescriptor)
    assert list(boxes.shape) == [120, 64] and list(boxes.block_shape) == [32, 64]
    assert weight_boxes(w, False, 32, 64) is w  # the config asks for pointer loads
    odd = torch.zeros(3, 40, 12, dtype=torch.float16)  # 24-byte rows: TMA cannot
    assert weight_boxes(odd, True, 32, 16) is odd
    gaps = w[:, :20]  # experts 40 rows apart: not one [E·N, K] matrix
    assert weight_boxes(gaps, True, 16, 64) is gaps


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("name", list(ROUTER_CASES))
def test_fused_router_matches_the_torch_router(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["ids_equal"], "the fused router chose other experts (or another order)"
    assert r["weights_err"] < 1e-6, r
    assert r["groups"] == r["want_groups"], "groups must list the distinct experts, then -1"
    assert r["groups_from_ids"] == r["want_groups"]


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_decode_path_block_matches_the_reference_loop(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["rel"] < r["tolerance"], r


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_combine_with_the_residual_add_and_norm(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["moved"] > 0.1, "the residual must be updated in place"
    assert r["residual_equal"], "residual + experts must round as the unfused add does"
    assert r["norm_err"] < 1e-6, r


def test_every_swept_config_matches_the_reference_loop(results: dict[str, dict]) -> None:
    bad = {n: results[n].get("error") or results[n]["rel"] for n in _config_cases()}
    bad = {n: r for n, r in bad.items() if not (isinstance(r, float) and r < 1e-5)}
    assert not bad, bad


if __name__ == "__main__":
    print_cases(ROUTER_CASES, _router_case)
    print_cases(BLOCK_CASES, _block_case)
    print_cases(_config_cases(), _config_case)
    print_cases(NORM_CASES, _norm_case)
