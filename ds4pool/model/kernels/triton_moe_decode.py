"""The small-batch decode path of the MoE layers in Triton: few launches, each expert's
weights read once per step, no host sync (CUDA-graph capturable).

For a decode step of T tokens with k experts each (R = T·k pairs, a few dozen) the grouped
GEMM path spends most of its time in ~15 small launches and in 16-row tiles that are mostly
padding. Here a MoE layer is four launches after the router's linear:

    route    logits [T, E] → weights [T, k] f32, ids [T, k] i64, groups [G]   (triton_moe_route;
             or inside the gate_up launch: every program routes, program (0,0,0) stores)
    gate_up  h[pair] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)   grid (G, I / BLOCK_N, S_gu)
    down     y[pair] = h[pair] @ down[e].T                          grid (G, H / BLOCK_N, S_dn)
    combine  out[t] = Σ_j weights[t, j] · y[t·k + j]  (float32, slot order)   grid (T, H / BLOCK_N)

G = min(E, R) is fixed by the shapes; `groups[g]` is the g-th distinct expert the step
chose, in ascending order, and -1 past the last one (those programs return at once). A
program of group g serves every token that chose expert g, so the expert's rows are read
once per step however many tokens share it; it finds those tokens (and their slot) by
comparing the [T, k] ids with its expert, a few dozen integers, instead of a device sort.
Pair p = t·k + j is token t's j-th expert; h [R, I] and y [R, H] are in the input dtype,
rounded where the reference rounds its matmul outputs. The combine is a pass of its own
(not atomics) so that a token's sum has a fixed order: same result run to run and batch to
batch. A step of one token multiplies by broadcasting (a GEMV), larger ones by tl.dot
tiles padded to 16 rows (`GEMV_MAX_TOKENS`).

Tiles, warps, stages and split-K come from a table by token count (triton_moe_configs.py).
With split-K (S > 1) a projection's programs each reduce one strip of K and store float32
partial sums; the next launch adds them in split order before it rounds as the reference
does: the down kernel activates the gate_up partials as it loads them (h is not made), the
combine adds the down partials. Still three launches, still deterministic.

A config's projection may read its weights by Hopper TMA (`ProjTiles.tma`, USE_TMA): a
tensor descriptor over the [E·N, K] weight, built per launch on the host
(triton_moe_tiles.weight_boxes: pointer loads where the layout or the GPU cannot take it),
whose [BLOCK_N, BLOCK_K] boxes the pipeliner fetches num_stages ahead into shared memory.
Same products, same order: the choice changes how many bytes a program keeps in flight, not
the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels._pdl import launch_options, pdl_trigger, pdl_wait
from ds4pool.model.kernels._proj_tiles import acc_add, acc_sum, acc_zeros
from ds4pool.model.kernels.triton_moe_combine import combine
from ds4pool.model.kernels.triton_moe_configs import DecodeConfig, config_for
from ds4pool.model.kernels.triton_moe_route import (
    DeferredRoute,
    pow2,
    route_args,
    route_in_program,
)
from ds4pool.model.kernels.triton_moe_tiles import GEMV_MAX_TOKENS, strips, tile_shape, weight_boxes


@triton.jit
def _rows_of_ids(ids, expert, TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_KS: tl.constexpr):
    """ids [ROWS, BLOCK_KS] (-1: no pair) → (whether each token chose `expert`, its pair
    t·k + j), both [ROWS]."""
    slot = tl.arange(0, BLOCK_KS)
    match = ids == expert
    mine = tl.max(match.to(tl.int32), axis=1) > 0
    pair = tl.arange(0, ROWS) * TOP_K + tl.sum(tl.where(match, slot[None, :], 0), axis=1)
    return mine, pair


@triton.jit
def _rows_of_group(ids_ptr, expert, t, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_KS: tl.constexpr):  # fmt: skip
    """(tokens [BLOCK_T], whether each chose `expert`, its pair t·k + j) from the ids [T, k]."""
    tok = tl.arange(0, BLOCK_T)
    slot = tl.arange(0, BLOCK_KS)
    ids = tl.load(
        ids_ptr + tok[:, None] * TOP_K + slot[None, :],
        mask=(tok < t)[:, None] & (slot < TOP_K)[None, :],
        other=-1,
    )
    mine, pair = _rows_of_ids(ids, expert, TOP_K, BLOCK_T, BLOCK_KS)
    return tok, mine, pair


@triton.jit
def _widen(v, ROWS: tl.constexpr, BLOCK_T: tl.constexpr):
    """v [ROWS] int32 → [BLOCK_T] (ROWS <= BLOCK_T), 0 past ROWS: the router's rows (a
    power of two over T) as the tile's (at least 16 rows for tl.dot)."""
    if ROWS == BLOCK_T:
        out = v
    else:
        hit = tl.arange(0, BLOCK_T)[:, None] == tl.arange(0, ROWS)[None, :]
        out = tl.sum(tl.where(hit, v[None, :], 0), axis=1)
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, w_desc, ids_ptr, groups_ptr, h_ptr, part_ptr, t, hidden, inter, k_chunk,
    stride_x, stride_we, stride_wn, stride_h, stride_ps, stride_pr,
    logits_ptr, bias_ptr, weights_ptr, e, num_groups, stride_l, scaling,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
    ROUTE: tl.constexpr, ROUTER: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROUTE_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_NG: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)  # (kernels/_pdl.py) which expert's weights to read is the router's output
    if ROUTE:  # the step's routing from its logits, here instead of in a launch of its own
        expert, ids = route_in_program(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, groups_ptr, t, e, num_groups,
            stride_l, scaling, ROUTER, TOP_K, NORMALIZE, HAS_BIAS, N_GROUP, TOPK_GROUP,
            ROUTE_T, BLOCK_E, BLOCK_KS, BLOCK_G, BLOCK_NG,
        )  # fmt: skip
        if expert < 0:  # past the last distinct expert
            return
        mine, pair = _rows_of_ids(ids, expert, TOP_K, ROUTE_T, BLOCK_KS)
        tok = tl.arange(0, BLOCK_T)
        mine = _widen(mine.to(tl.int32), ROUTE_T, BLOCK_T) > 0
        pair = _widen(pair, ROUTE_T, BLOCK_T)
    else:
        expert = tl.load(groups_ptr + tl.program_id(0))
        if expert < 0:  # past the last distinct expert
            return
        tok, mine, pair = _rows_of_group(ids_ptr, expert, t, TOP_K, BLOCK_T, BLOCK_KS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of I: gate row c, up row I + c
    col_ok = cols < inter
    gate = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wn
    up = gate + inter * stride_wn
    acc_g = acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    acc_u = acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    split = tl.program_id(2)  # this program's strip [split·k_chunk, (split + 1)·k_chunk) of H
    k_lo = split * k_chunk
    for k0 in range(k_lo, k_lo + k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + tok[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=mine[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_K], only the rows of tokens that chose this expert
        if USE_TMA:  # [E·2I, H] boxes: K past H reads as zeros; rows past I are not stored
            row = (expert * 2 * inter + tl.program_id(1) * BLOCK_N).to(tl.int32)
            w_g = w_desc.load([row, k0])
            w_u = w_desc.load([row + inter, k0])
        else:
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_g = tl.load(gate + ks[None, :], mask=w_mask, other=0.0)
            w_u = tl.load(up + ks[None, :], mask=w_mask, other=0.0)
        acc_g = acc_add(acc_g, a, w_g, BLOCK_T, USE_DOT, PRECISION)
        acc_u = acc_add(acc_u, a, w_u, BLOCK_T, USE_DOT, PRECISION)
    acc_g = acc_sum(acc_g, BLOCK_T, USE_DOT)
    acc_u = acc_sum(acc_u, BLOCK_T, USE_DOT)
    keep = mine[:, None] & col_ok[None, :]
    if SPLIT > 1:  # float32 partial sums [S, R, 2I]: the down kernel adds them and activates
        part = part_ptr + split * stride_ps + pair[:, None].to(tl.int64) * stride_pr + cols[None, :]
        tl.store(part, acc_g, mask=keep)
        tl.store(part + inter, acc_u, mask=keep)
    else:
        dt = h_ptr.dtype.element_ty
        out = h_ptr + pair[:, None].to(tl.int64) * stride_h + cols[None, :]
        tl.store(out, _silu_mul_rounded(acc_g, acc_u, dt), mask=keep)


@triton.jit
def _silu_mul_rounded(acc_g, acc_u, dt: tl.constexpr):
    """silu(g) * u in the activation dtype, g and u rounded to it first as the reference
    rounds the gate_up matmul's output."""
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(dt)


@triton.jit
def _down_kernel(
    h_ptr, part_ptr, w_ptr, w_desc, ids_ptr, groups_ptr, y_ptr, ypart_ptr, t, hidden, inter,
    k_chunk,
    stride_h, stride_ps, stride_pr, stride_we, stride_wn, stride_y, stride_ys, stride_yr,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    GU_SPLIT: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    expert = tl.load(groups_ptr + tl.program_id(0))
    if expert < 0:
        return
    tok, mine, pair = _rows_of_group(ids_ptr, expert, t, TOP_K, BLOCK_T, BLOCK_KS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of H
    col_ok = cols < hidden
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wn
    acc = acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    split = tl.program_id(2)
    k_lo = split * k_chunk
    for k0 in range(k_lo, k_lo + k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a_mask = mine[:, None] & k_ok[None, :]
        if GU_SPLIT > 1:  # the gate_up's partial sums, added in split order, then activated
            acc_g = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            rows = part_ptr + pair[:, None].to(tl.int64) * stride_pr + ks[None, :]
            for s in tl.static_range(GU_SPLIT):
                acc_g += tl.load(rows + s * stride_ps, mask=a_mask, other=0.0)
                acc_u += tl.load(rows + s * stride_ps + inter, mask=a_mask, other=0.0)
            # in the activation dtype: the weights' (y is float32 partials under a split)
            a = _silu_mul_rounded(acc_g, acc_u, w_ptr.dtype.element_ty)
        else:
            a = tl.load(
                h_ptr + pair[:, None].to(tl.int64) * stride_h + ks[None, :],
                mask=a_mask,
                other=0.0,
            )
        if USE_TMA:  # [E·H, I] boxes: K past I reads as zeros; rows past H are not stored
            w = w_desc.load([(expert * hidden + tl.program_id(1) * BLOCK_N).to(tl.int32), k0])
        else:
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = acc_add(acc, a, w, BLOCK_T, USE_DOT, PRECISION)
    acc = acc_sum(acc, BLOCK_T, USE_DOT)
    keep = mine[:, None] & col_ok[None, :]
    if SPLIT > 1:  # float32 partials [S, R, H], summed by the combine
        out = ypart_ptr + split * stride_ys + pair[:, None].to(tl.int64) * stride_yr + cols[None, :]
        tl.store(out, acc, mask=keep)
    else:
        out = y_ptr + pair[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=keep)


def _no_route(unread: torch.Tensor) -> tuple[list[object], dict[str, object]]:
    """route_args' place in a gate_up launch that does not route (the groups are given)."""
    consts = dict(ROUTER=0, NORMALIZE=False, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1,
                  ROUTE_T=1, BLOCK_E=1, BLOCK_G=1, BLOCK_NG=1)  # fmt: skip
    return [unread, unread, unread, 0, 0, 0, 0.0], consts


def decode_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    groups: torch.Tensor,  # [G] from route_topk / expert_groups
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    gemv_max_tokens: int | None = None,  # None: GEMV_MAX_TOKENS (a config's gemv wins)
    config: DecodeConfig | None = None,  # None: triton_moe_configs.config_for(T)
    residual: torch.Tensor | None = None,  # [T, H]: fuse the layer's residual add + norm
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    route: DeferredRoute | None = None,  # the gate_up routes: weights, ids, groups are its
    pdl: bool = False,  # the three launched with programmatic dependent launch (kernels/_pdl.py)
) -> torch.Tensor:
    """Σ_j weights[t, j] · down[e](silu·mul(gate_up[e] x[t])) for each token's k experts
    e = ids[t, j]: three launches (gate_up, down, combine), whatever the splits. With
    `residual`, the combine also adds the sum into it (in place) and returns the RMSNorm of
    the result by `norm_weight` (triton_moe_combine.py). With `route`
    (triton_moe_route.route_deferred), the gate_up launch routes the step itself and fills
    route's weights, ids and groups (passed as those three) for the launches after it."""
    if route is not None:
        assert weights is route.weights and ids is route.ids and groups is route.groups
    t, hidden = x.shape
    experts, two_i, hidden_w = gate_up.shape
    k = ids.shape[1]
    inter = two_i // 2
    assert hidden == hidden_w and down.shape == (experts, hidden, inter), (x.shape, down.shape)
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    assert gate_up.dtype == down.dtype == x.dtype, (x.dtype, gate_up.dtype, down.dtype)
    ids = ids.contiguous()
    weights = weights.contiguous()
    g = groups.numel()
    if t == 0:
        return torch.empty_like(x)
    cfg = config or config_for(t)
    gu, dn = cfg.gate_up, cfg.down
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gemv_max_tokens = GEMV_MAX_TOKENS if gemv_max_tokens is None else gemv_max_tokens
    if cfg.gemv is not None:  # the table's row decides GEMV vs dot tiles for its step sizes
        gemv_max_tokens = t if cfg.gemv else 0
    bt, bn, bk, dot = tile_shape(t, gu.block_n, x.element_size(), gemv_max_tokens, gu.block_k)
    gu_split, gu_chunk = strips(hidden, gu.split_k, bk)
    if gu_split > 1:  # [S, R, 2I] float32 partials; h is not made
        part = torch.empty((gu_split, t * k, two_i), dtype=torch.float32, device=x.device)
        h = part  # unread
    else:
        h = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
        part = h  # unread
    gu_w = weight_boxes(gate_up, gu.tma, bn, bk)
    r_args, r_consts = route_args(route) if route is not None else _no_route(ids)
    _gate_up_kernel[(g, triton.cdiv(inter, bn), gu_split)](
        x, gate_up, gu_w, ids, groups, h, part, t, hidden, inter, gu_chunk,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        part.stride(0), part.stride(1) if gu_split > 1 else 0, *r_args,
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, SPLIT=gu_split, USE_TMA=gu_w is not gate_up,
        ROUTE=route is not None, **r_consts, PDL=pdl, num_warps=gu.num_warps,
        num_stages=gu.num_stages, **launch_options(pdl),
    )  # fmt: skip
    bt, bn, bk, dot = tile_shape(t, dn.block_n, x.element_size(), gemv_max_tokens, dn.block_k)
    dn_split, dn_chunk = strips(inter, dn.split_k, bk)
    if dn_split > 1:
        ypart = torch.empty((dn_split, t * k, hidden), dtype=torch.float32, device=x.device)
        y = ypart  # unread
    else:
        y = torch.empty((t * k, hidden), dtype=x.dtype, device=x.device)
        ypart = y  # unread
    dn_w = weight_boxes(down, dn.tma, bn, bk)
    _down_kernel[(g, triton.cdiv(hidden, bn), dn_split)](
        h, part, down, dn_w, ids, groups, y, ypart, t, hidden, inter, dn_chunk,
        h.stride(0), part.stride(0), part.stride(1) if gu_split > 1 else 0,
        down.stride(0), down.stride(1), y.stride(0),
        ypart.stride(0), ypart.stride(1) if dn_split > 1 else 0,
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, GU_SPLIT=gu_split, SPLIT=dn_split, USE_TMA=dn_w is not down,
        PDL=pdl, num_warps=dn.num_warps, num_stages=dn.num_stages, **launch_options(pdl),
    )  # fmt: skip
    y_or_parts = ypart if dn_split > 1 else y
    return combine(y_or_parts, weights, x.dtype, residual, norm_weight, eps, pdl=pdl)
