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
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, groups_ptr, t, e, num_groups, stride_l,
    scaling,
    ROUTER: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_NG: tl.constexpr,
):  # fmt: skip
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
    top = tl.max(x, axis=1)  # [BLOCK_T]
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
        picked = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # scores[t, idx[t]]
        top_w = tl.where(slot[None, :] == j, picked[:, None], top_w)
        top_i = tl.where(slot[None, :] == j, idx[:, None], top_i)
        used = tl.maximum(used, tl.max((hit & t_ok[:, None]).to(tl.int32), axis=0))
        vals = tl.where(hit, float("-inf"), vals)
    s_ok = slot[None, :] < TOP_K
    if ROUTER == 0:  # softmax over all E, then the top k
        denom = tl.sum(tl.exp(x - top[:, None]), axis=1)
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]) / denom[:, None], 0.0)
        if NORMALIZE:
            w = w / tl.sum(w, axis=1)[:, None]
    elif ROUTER == 1:  # softmax over the k chosen logits
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]), 0.0)
        w = w / tl.sum(w, axis=1)[:, None]
    else:
        w = tl.where(s_ok, top_w, 0.0)
        if NORMALIZE:
            w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
        w = w * scaling
    out = tok[:, None] * TOP_K + slot[None, :]
    mask = t_ok[:, None] & s_ok
    tl.store(weights_ptr + out, w, mask=mask)
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=mask)
    _store_groups(used, col, groups_ptr, num_groups, BLOCK_G)


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


def route_fused(
    moe: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """routers.route(moe, logits, correction_bias) plus the step's groups, in one launch."""
    t, e = logits.shape
    assert logits.stride(1) == 1 and e == moe.num_experts, (logits.shape, moe.num_experts)
    dev = logits.device
    k = moe.top_k
    weights = torch.empty((t, k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, k), dtype=torch.int64, device=dev)
    g = num_groups(t, k, e)
    groups = torch.empty(g, dtype=torch.int32, device=dev)
    router = ROUTER_IDS[moe.router]
    bias = correction_bias if correction_bias is not None else weights  # unread when absent
    _route_kernel[(1,)](
        logits, bias, weights, ids, groups, t, e, g, logits.stride(0),
        float(moe.routed_scaling_factor),
        ROUTER=router, TOP_K=k, NORMALIZE=moe.norm_topk_prob,
        HAS_BIAS=correction_bias is not None, N_GROUP=moe.n_group, TOPK_GROUP=moe.topk_group,
        BLOCK_T=pow2(t), BLOCK_E=pow2(e), BLOCK_KS=pow2(k), BLOCK_G=pow2(g),
        BLOCK_NG=pow2(moe.n_group), num_warps=4,
    )  # fmt: skip
    return weights, ids, groups


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
