"""The MoE decode path with the routing inside its gate_up launch (triton_moe_route's
DeferredRoute, decode_experts(route=...)) against the separate route launch, under Triton's
CPU interpreter: the same weights, ids and groups, bit for bit, and the same expert output,
for the Qwen3-MoE and Mixtral routers (and DeepSeek-V3's, which takes the same code when
asked), one token to 16, with and without norm_topk_prob, with tied logits, over GEMV and
dot tiles (the router's rows fewer than the tile's) and a split gate_up (programs past
(0, 0, 0) must not store); and whole sparse blocks, routed either way, equal bitwise.

As in test_triton_moe_decode.py, the cases run in one child interpreter (this file as a
script) that prints a JSON line each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

# up to ROUTE_IN_GATE_UP_VERIFIED_TOKENS: no step routes in the gate_up past it
TOKENS = (1, 2, 5, 16)
# route case → (router, experts, top-k, norm_topk_prob, tokens, logits, tiles): logits
# "randn" or "ties" (integers in [-2, 2]: most tokens tie, some across the k-th place);
# tiles "gemv" (one row a token, as many as the router's), "dot" (16-row tiles: the router's
# rows widened), "split" (dot tiles, the gate_up's K in 2 strips)
ROUTE_CASES: dict[str, tuple[str, int, int, bool, int, str, str]] = {}
for _t, _tiles in zip(TOKENS, ("gemv", "split", "dot", "split")):
    for _router, _e, _k in (("softmax_topk", 24, 4), ("topk_softmax", 8, 2)):
        for _norm in (True, False):
            ROUTE_CASES[f"{_router}_t{_t}_norm{int(_norm)}"] = (
                _router, _e, _k, _norm, _t, "randn", _tiles,
            )  # fmt: skip
        ROUTE_CASES[f"{_router}_t{_t}_ties"] = (_router, _e, _k, True, _t, "ties", _tiles)
ROUTE_CASES["sigmoid_group_topk_t5"] = ("sigmoid_group_topk", 32, 4, True, 5, "randn", "dot")
ROUTE_CASES["sigmoid_group_topk_t1"] = ("sigmoid_group_topk", 32, 4, False, 1, "ties", "gemv")

# block case → (router, tokens): SparseMoeBlock.forward routed in the gate_up vs apart
BLOCK_CASES = {
    "block_qwen3_t1": ("softmax_topk", 1),
    "block_qwen3_t7": ("softmax_topk", 7),
    "block_mixtral_t3": ("topk_softmax", 3),
    "block_deepseek_t2": ("sigmoid_group_topk", 2),
}
HIDDEN, INTER = 40, 48  # not powers of two: masked tails in both projections


def _config(tiles: str) -> Any:
    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig, ProjTiles

    split = 2 if tiles == "split" else 1
    return DecodeConfig(ProjTiles(32, 16, split), ProjTiles(32), gemv=tiles == "gemv")


def _moe(router: str, e: int, k: int, norm: bool) -> Any:
    from ds4pool.model.config import MoEConfig

    if router == "sigmoid_group_topk":  # 4 groups of 8, 2 kept, scaled
        return MoEConfig(e, k, INTER, router, (0,), norm, 4, 2, 2.5)
    return MoEConfig(e, k, INTER, router, (0,), norm_topk_prob=norm)


def _route_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import route_deferred, route_fused
    from ds4pool.model.routers import route

    router, e, k, norm, t, kind, tiles = ROUTE_CASES[name]
    moe = _moe(router, e, k, norm)
    gen = torch.Generator().manual_seed(len(name) + t)
    if kind == "ties":
        logits = torch.randint(-2, 3, (t, e), generator=gen).float()
    else:
        logits = torch.randn(t, e, generator=gen)
    bias = torch.rand(e, generator=gen) * 0.2 if router == "sigmoid_group_topk" else None
    x = torch.randn(t, HIDDEN, generator=gen)
    gate_up = torch.randn(e, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    down = torch.randn(e, HIDDEN, INTER, generator=gen) * INTER**-0.5
    config = _config(tiles)
    w, ids, groups = route_fused(moe, logits, bias)
    apart = decode_experts(x, w, ids, groups, gate_up, down, config=config)
    deferred = route_deferred(moe, logits, bias)
    for buf in (deferred.weights, deferred.ids, deferred.groups):
        buf.fill_(7)  # what the gate_up launch must overwrite
    fused = decode_experts(
        x, deferred.weights, deferred.ids, deferred.groups, gate_up, down, config=config,
        route=deferred,
    )  # fmt: skip
    want_w, want_ids = route(moe, logits, bias)
    return {
        "name": name,
        "weights_equal": torch.equal(deferred.weights, w),
        "ids_equal": torch.equal(deferred.ids, ids) and deferred.ids.dtype == torch.int64,
        "groups_equal": torch.equal(deferred.groups, groups),
        "out_equal": torch.equal(fused, apart),
        "distinct": len(set(ids.flatten().tolist())),
        # the separate launch still is the torch router (where no tie makes the order moot)
        "torch_ids_equal": torch.equal(ids.sort(dim=1)[0], want_ids.sort(dim=1)[0]),
        "torch_weights_err": float((w.sort(dim=1)[0] - want_w.sort(dim=1)[0]).abs().max()),
        "ties": kind == "ties",
    }


def _block_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.moe import SparseMoeBlock

    router, t = BLOCK_CASES[name]
    moe = _moe(router, 32 if router == "sigmoid_group_topk" else 12, 3, True)
    block = SparseMoeBlock(moe, HIDDEN)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        if block.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.copy_(torch.rand(moe.num_experts, generator=gen))
    x = torch.randn(t, HIDDEN, generator=gen)
    seen: list[torch.Tensor] = []
    block.observer = lambda ids: seen.append(ids.clone())
    block.impl = "decode"
    with torch.no_grad():
        block.decode_route_in_gate_up = False
        apart = block(x)
        block.decode_route_in_gate_up = True
        fused = block(x)
        block.impl = "loop"
        loop = block(x)
    return {
        "name": name,
        "out_equal": torch.equal(fused, apart),
        "observed_equal": torch.equal(seen[1], seen[0]),  # the ids the observer sees
        "rel_to_loop": float((fused - loop).abs().max() / loop.abs().max()),
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("name", list(ROUTE_CASES))
def test_routing_in_the_gate_up_is_the_route_launch_bitwise(
    results: dict[str, dict], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["ids_equal"], "the gate_up launch stored other expert ids"
    assert r["weights_equal"], "the gate_up launch stored other routing weights"
    assert r["groups_equal"], "the gate_up launch stored other expert groups"
    assert r["out_equal"], "the experts' output differs from the separately routed path's"
    t = ROUTE_CASES[name][4]
    assert r["distinct"] > 1 or t == 1, "too few experts chosen to test the groups"
    if not r["ties"]:
        assert r["torch_ids_equal"] and r["torch_weights_err"] < 1e-6, r


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_sparse_block_routed_in_the_gate_up_equals_the_separate_route(
    results: dict[str, dict], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["out_equal"] and r["observed_equal"], r
    assert r["rel_to_loop"] < 1e-5, r


def test_which_steps_route_in_the_gate_up() -> None:
    """Qwen3-MoE and Mixtral at up to ROUTE_IN_GATE_UP_MAX_TOKENS tokens, DeepSeek-V3 only
    when asked; the block attribute overrides both ways, but never past the tokens the H200
    verified (ROUTE_IN_GATE_UP_VERIFIED_TOKENS)."""
    from ds4pool.model.config import MoEConfig
    from ds4pool.model.moe import (
        ROUTE_IN_GATE_UP_MAX_TOKENS,
        ROUTE_IN_GATE_UP_VERIFIED_TOKENS,
        SparseMoeBlock,
    )

    most = ROUTE_IN_GATE_UP_MAX_TOKENS
    qwen = SparseMoeBlock(MoEConfig(8, 2, 16, "softmax_topk", (0,)), 32)
    mixtral = SparseMoeBlock(MoEConfig(8, 2, 16, "topk_softmax", (0,)), 32)
    deepseek = SparseMoeBlock(MoEConfig(8, 2, 16, "sigmoid_group_topk", (0,)), 32)
    assert qwen.routes_in_gate_up(1) and qwen.routes_in_gate_up(most)
    assert mixtral.routes_in_gate_up(1) and not mixtral.routes_in_gate_up(most + 1)
    assert not deepseek.routes_in_gate_up(1)
    deepseek.decode_route_in_gate_up = True
    qwen.decode_route_in_gate_up = False
    verified = ROUTE_IN_GATE_UP_VERIFIED_TOKENS
    assert deepseek.routes_in_gate_up(verified) and not qwen.routes_in_gate_up(1)
    assert not deepseek.routes_in_gate_up(verified + 1)  # a route launch, whatever asked


if __name__ == "__main__":
    print_cases(ROUTE_CASES, _route_case)
    print_cases(BLOCK_CASES, _block_case)
