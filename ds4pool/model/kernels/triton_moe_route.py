"""The MoE routers of model/routers.py fused into one Triton launch for small decode steps,
with the step's expert groups that the decode kernels (triton_moe_decode.py) run over.

    logits [T, E] → weights [T, k] float32, ids [T, k] int64, groups [G] int32

One program holds the whole [T, E] tile (T ≤ a few dozen at decode): the k experts are
taken by k rounds of argmax (descending; the lowest index on ties, as torch.topk), so the
launch count does not depend on T. G = min(E, T·k) is fixed by the shapes; `groups` lists
the distinct experts the step chose in ascending order, then -1.

Routers (ROUTER): 0 Qwen3-MoE (softmax over all E in float32, top-k, renormalised when
norm_topk_prob), 1 Mixtral (top-k logits, softmax over those k), 2 DeepSeek-V3 (sigmoid
scores; the scores plus e_score_correction_bias choose, group-limited: groups ranked by the
sum of their two best, the best topk_group kept; weights are the chosen experts' uncorrected
scores, renormalised when asked, times routed_scaling_factor). DeepSeek-V3's reference takes
its top-k unsorted, so its slot order is the torch implementation's; here it is descending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4pool.model.config import MoEConfig

ROUTER_IDS = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_group_topk": 2}


@triton.jit
def _store_groups(used, experts, groups_ptr, num_groups, BLOCK_G: tl.constexpr):
    """used [BLOCK_E] int32 (1: some pair chose expert e) → groups[: count] = those experts in
    ascending order, groups[count: num_groups] = -1."""
    rank = tl.cumsum(used, axis=0) - 1
    tl.store(groups_ptr + rank, experts, mask=used > 0)
    count = tl.sum(used, axis=0)
    g = tl.arange(0, BLOCK_G)
    tl.store(groups_ptr + g, tl.full([BLOCK_G], -1, tl.int32), mask=(g >= count) & (g < num_groups))


@triton.jit
def _group_limit(choice, col, e, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_NG: tl.constexpr):  # fmt: skip
    """choice [BLOCK_T, BLOCK_E] with -inf outside the TOPK_GROUP best of N_GROUP groups, a
    group ranked by the sum of its two best (one where a group has one expert)."""
    size = e // N_GROUP
    group = col // size  # [BLOCK_E]
    ng = tl.arange(0, BLOCK_NG)
    scores = tl.full((BLOCK_T, BLOCK_NG), float("-inf"), tl.float32)
    for gi in range(N_GROUP):  # a loop, not unrolled: compile time
        v = tl.where((group == gi)[None, :], choice, float("-inf"))
        first = tl.argmax(v, axis=1, tie_break_left=True)
        best = tl.max(v, axis=1)
        second = tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), v), axis=1)
        pair = best + tl.where(size >= 2, second, 0.0)
        scores = tl.where(ng[None, :] == gi, pair[:, None], scores)
    keep = tl.zeros(choice.shape, dtype=tl.int1)
    for _ in range(TOPK_GROUP):
        gbest = tl.argmax(scores, axis=1, tie_break_left=True)
        keep = keep | (group[None, :] == gbest[:, None])
        scores = tl.where(ng[None, :] == gbest[:, None], float("-inf"), scores)
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _pairwise_sum(v, ROWS: tl.constexpr, N: tl.constexpr):
    """v [ROWS, N] (N a power of two, at most 1024) → [ROWS]: Σ over the row as a fixed tree
    of pairs. Every add takes two values, and a + b == b + a, so the bits do not depend on
    how the compiler lays the tile over threads (num_warps, the kernel around it), which a
    tl.sum's order does: each kernel that routes gets the weights of the others."""
    for i in tl.static_range(10):
        if (N >> i) > 1:
            a, b = tl.split(tl.reshape(v, (ROWS, N >> (i + 1), 2)))
            v = a + b
    return tl.reshape(v, (ROWS,))


@triton.jit
def _route_choice(
    logits_ptr, bias_ptr, t, e, stride_l,
    ROUTER: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_NG: tl.constexpr,
):  # fmt: skip
    """The experts each token chooses: (x [BLOCK_T, BLOCK_E] float32 logits, -inf past E;
    top_w [BLOCK_T, BLOCK_KS] the chosen experts' scores, top_i their ids int32, slot j the
    j-th best (both 0 past TOP_K); used [BLOCK_E] int32, 1 where a token of the step chose
    expert e)."""
    tok = tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_E)
    slot = tl.arange(0, BLOCK_KS)
    t_ok = tok < t
    e_ok = col < e
    x = tl.load(
        logits_ptr + tok[:, None] * stride_l + col[None, :],
        mask=t_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))  # [BLOCK_T, BLOCK_E]
    scores = x  # what the weights are made of (DeepSeek: the sigmoid scores)
    vals = x  # what chooses
    if ROUTER == 2:
        scores = tl.sigmoid(x)  # 0 on padded columns
        vals = scores
        if HAS_BIAS:
            vals = vals + tl.load(bias_ptr + col, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        vals = tl.where(e_ok[None, :], vals, float("-inf"))
        if N_GROUP > 1:
            vals = _group_limit(vals, col, e, N_GROUP, TOPK_GROUP, BLOCK_T, BLOCK_NG)
    top_w = tl.zeros((BLOCK_T, BLOCK_KS), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_KS), dtype=tl.int32)
    used = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j in range(TOP_K):  # a loop, not unrolled: compile time
        idx = tl.argmax(vals, axis=1, tie_break_left=True)
        hit = col[None, :] == idx[:, None]
        picked = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # scores[t, idx[t]]: exact
        top_w = tl.where(slot[None, :] == j, picked[:, None], top_w)
        top_i = tl.where(slot[None, :] == j, idx[:, None], top_i)
        used = tl.maximum(used, tl.max((hit & t_ok[:, None]).to(tl.int32), axis=0))
        vals = tl.where(hit, float("-inf"), vals)
    return x, top_w, top_i, used


@triton.jit
def _route_weights(
    x, top_w, scaling,
    ROUTER: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr,
):  # fmt: skip
    """_route_choice's (x, top_w) → the weights [BLOCK_T, BLOCK_KS] float32, 0 past TOP_K."""
    s_ok = tl.arange(0, BLOCK_KS)[None, :] < TOP_K
    top = tl.max(x, axis=1)  # [BLOCK_T]
    if ROUTER == 0:  # softmax over all E, then the top k
        denom = _pairwise_sum(tl.exp(x - top[:, None]), BLOCK_T, BLOCK_E)
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]) / denom[:, None], 0.0)
        if NORMALIZE:
            w = w / _pairwise_sum(w, BLOCK_T, BLOCK_KS)[:, None]
    elif ROUTER == 1:  # softmax over the k chosen logits
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]), 0.0)
        w = w / _pairwise_sum(w, BLOCK_T, BLOCK_KS)[:, None]
    else:
        w = tl.where(s_ok, top_w, 0.0)
        if NORMALIZE:
            w = w / (_pairwise_sum(w, BLOCK_T, BLOCK_KS)[:, None] + 1e-20)
        w = w * scaling
    return w


@triton.jit
def _store_route(
    w, top_i, used, weights_ptr, ids_ptr, groups_ptr, t, num_groups,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """weights [T, k], ids [T, k] int64 and groups [G] of a routed step."""
    tok = tl.arange(0, BLOCK_T)
    slot = tl.arange(0, BLOCK_KS)
    out = tok[:, None] * TOP_K + slot[None, :]
    mask = (tok < t)[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, w, mask=mask)
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=mask)
    _store_groups(used, tl.arange(0, BLOCK_E), groups_ptr, num_groups, BLOCK_G)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, groups_ptr, t, e, num_groups, stride_l,
    scaling,
    ROUTER: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_NG: tl.constexpr,
):  # fmt: skip
    x, top_w, top_i, used = _route_choice(
        logits_ptr, bias_ptr, t, e, stride_l, ROUTER, TOP_K, HAS_BIAS, N_GROUP, TOPK_GROUP,
        BLOCK_T, BLOCK_E, BLOCK_KS, BLOCK_NG,
    )  # fmt: skip
    w = _route_weights(x, top_w, scaling, ROUTER, TOP_K, NORMALIZE, BLOCK_T, BLOCK_E, BLOCK_KS)
    _store_route(w, top_i, used, weights_ptr, ids_ptr, groups_ptr, t, num_groups,
                 TOP_K, BLOCK_T, BLOCK_E, BLOCK_KS, BLOCK_G)  # fmt: skip


@triton.jit
def route_in_program(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, groups_ptr, t, e, num_groups, stride_l,
    scaling,
    ROUTER: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_NG: tl.constexpr,
):  # fmt: skip
    """The step's routing inside an expert kernel's program of group g = program_id(0)
    (triton_moe_decode's gate_up with a DeferredRoute): (its expert, the g-th distinct one
    ascending as groups[g] would be, or -1 past the last; ids [BLOCK_T, BLOCK_KS] int32, -1
    where no pair is). Program (0, 0, 0) also stores what _route_kernel stores, for the
    launches after this one; every program routes alike, so each has the same answer."""
    x, top_w, top_i, used = _route_choice(
        logits_ptr, bias_ptr, t, e, stride_l, ROUTER, TOP_K, HAS_BIAS, N_GROUP, TOPK_GROUP,
        BLOCK_T, BLOCK_E, BLOCK_KS, BLOCK_NG,
    )  # fmt: skip
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    if first:  # the weights only here: no other program needs them
        w = _route_weights(x, top_w, scaling, ROUTER, TOP_K, NORMALIZE, BLOCK_T, BLOCK_E,
                           BLOCK_KS)  # fmt: skip
        _store_route(w, top_i, used, weights_ptr, ids_ptr, groups_ptr, t, num_groups,
                     TOP_K, BLOCK_T, BLOCK_E, BLOCK_KS, BLOCK_G)  # fmt: skip
    g = tl.program_id(0)
    col = tl.arange(0, BLOCK_E)
    rank = tl.cumsum(used, axis=0) - 1  # of each chosen expert among the chosen
    expert = tl.sum(tl.where((used > 0) & (rank == g), col, 0), axis=0)
    expert = tl.where(tl.sum(used, axis=0) > g, expert, -1)
    tok = tl.arange(0, BLOCK_T)
    slot = tl.arange(0, BLOCK_KS)
    pairs = (tok < t)[:, None] & (slot < TOP_K)[None, :]
    return expert, tl.where(pairs, top_i, -1)


@triton.jit
def _groups_kernel(
    ids_ptr, groups_ptr, r, num_groups,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    col = tl.arange(0, BLOCK_E)
    used = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for r0 in range(0, r, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + rows, mask=rows < r, other=-1).to(tl.int32)
        used = tl.maximum(used, tl.max((col[:, None] == ids[None, :]).to(tl.int32), axis=1))
    _store_groups(used, col, groups_ptr, num_groups, BLOCK_G)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def num_groups(tokens: int, top_k: int, experts: int) -> int:
    """G: the most distinct experts a step of `tokens` tokens can choose."""
    return max(1, min(experts, tokens * top_k))


@dataclass(frozen=True)
class DeferredRoute:
    """A step's routing left to the decode path's gate_up launch (triton_moe_decode.py,
    decode_experts(route=...)) instead of a launch of its own: the router's inputs, and the
    outputs that launch fills for the down and the combine (launched after it, so stream
    order makes them visible), the same bits as route_fused's."""

    moe: MoEConfig
    logits: torch.Tensor  # [T, E], rows contiguous
    correction_bias: torch.Tensor | None  # [E], DeepSeek-V3's
    weights: torch.Tensor  # [T, k] float32, written by the gate_up launch
    ids: torch.Tensor  # [T, k] int64, written by the gate_up launch
    groups: torch.Tensor  # [G] int32, written by the gate_up launch


def route_outputs(
    moe: MoEConfig, tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (weights [T, k] float32, ids [T, k] int64, groups [G] int32)."""
    k = moe.top_k
    weights = torch.empty((tokens, k), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, k), dtype=torch.int64, device=device)
    groups = torch.empty(num_groups(tokens, k, moe.num_experts), dtype=torch.int32, device=device)
    return weights, ids, groups


def _check_logits(moe: MoEConfig, logits: torch.Tensor) -> None:
    e = logits.shape[1]
    assert logits.stride(1) == 1 and e == moe.num_experts, (logits.shape, moe.num_experts)
    assert pow2(e) <= 1024, "_pairwise_sum takes rows of up to 1024 experts"


def route_deferred(
    moe: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> DeferredRoute:
    """The routing of route_fused, launched by no one yet: decode_experts(route=...) does it
    in its gate_up launch."""
    _check_logits(moe, logits)
    weights, ids, groups = route_outputs(moe, logits.shape[0], logits.device)
    return DeferredRoute(moe, logits, correction_bias, weights, ids, groups)


def route_args(route: DeferredRoute) -> tuple[list[object], dict[str, object]]:
    """(logits, bias, weights, e, num_groups, stride_l, scaling) and the constexprs
    (ROUTER .. BLOCK_NG, the router's BLOCK_T as ROUTE_T) of a kernel that routes."""
    moe, logits, bias = route.moe, route.logits, route.correction_bias
    t, e = logits.shape
    g = route.groups.numel()
    args = [
        logits, bias if bias is not None else route.weights,  # unread when absent
        route.weights, e, g, logits.stride(0), float(moe.routed_scaling_factor),
    ]  # fmt: skip
    consts = dict(
        ROUTER=ROUTER_IDS[moe.router], NORMALIZE=moe.norm_topk_prob, HAS_BIAS=bias is not None,
        N_GROUP=moe.n_group, TOPK_GROUP=moe.topk_group, ROUTE_T=pow2(t), BLOCK_E=pow2(e),
        BLOCK_G=pow2(g), BLOCK_NG=pow2(moe.n_group),
    )  # fmt: skip
    return args, consts


def route_fused(
    moe: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """routers.route(moe, logits, correction_bias) plus the step's groups, in one launch."""
    route = route_deferred(moe, logits, correction_bias)
    (logits, bias, weights, e, g, stride_l, scaling), consts = route_args(route)
    consts["BLOCK_T"] = consts.pop("ROUTE_T")
    _route_kernel[(1,)](
        logits, bias, weights, route.ids, route.groups, logits.shape[0], e, g, stride_l, scaling,
        TOP_K=moe.top_k, BLOCK_KS=pow2(moe.top_k), **consts, num_warps=4,
    )  # fmt: skip
    return weights, route.ids, route.groups


def expert_groups(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, k] → groups [G] int32 (the distinct experts ascending, then -1), one launch:
    for ids routed elsewhere."""
    t, k = ids.shape
    ids = ids.contiguous()
    g = num_groups(t, k, num_experts)
    groups = torch.empty(g, dtype=torch.int32, device=ids.device)
    _groups_kernel[(1,)](
        ids, groups, t * k, g,
        BLOCK_R=16, BLOCK_E=pow2(num_experts), BLOCK_G=pow2(g), num_warps=4,
    )  # fmt: skip
    return groups
