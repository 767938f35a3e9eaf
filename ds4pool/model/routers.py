"""Mixture-of-experts routers as plain functions (other families reuse them): expert logits
[T, E] → (weights [T, k] float32, ids [T, k] int64), exactly as the reference implementation
of each family computes them. T = tokens, E = experts, k = experts per token.
"""

from __future__ import annotations

import torch

from ds4pool.model.config import MoEConfig


def route_softmax_topk(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: softmax over all experts in float32, top-k, renormalised if asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral: the top-k logits, softmax over those k (= softmax over all, renormalised)."""
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def route_sigmoid_group_topk(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None,  # [E] e_score_correction_bias
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the bias-corrected scores choose, group-limited (each group
    ranked by the sum of its two best experts, a token picks among the best topk_group groups);
    the weights are the uncorrected scores of the chosen experts, renormalised if asked, times
    routed_scaling_factor."""
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)  # [T, G]
        group_ids = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route(
    moe: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router `moe.router` names, with its parameters from the config."""
    if moe.router == "softmax_topk":
        return route_softmax_topk(logits, moe.top_k, moe.norm_topk_prob)
    if moe.router == "topk_softmax":
        return route_topk_softmax(logits, moe.top_k)
    assert moe.router == "sigmoid_group_topk", moe.router
    return route_sigmoid_group_topk(
        logits,
        moe.top_k,
        correction_bias,
        moe.n_group,
        moe.topk_group,
        moe.norm_topk_prob,
        moe.routed_scaling_factor,
    )
