"""The small-batch decode path of the MoE layers in Triton: few launches, each expert's
weights read once per step, no host sync (CUDA-graph capturable).

For a decode step of T tokens with k experts each (R = T·k pairs, a few dozen) the grouped
GEMM path spends most of its time in ~15 small launches and in 16-row tiles that are mostly
padding. Here a MoE layer is four launches after the router's linear:

    route    logits [T, E] → weights [T, k] f32, ids [T, k] i64, groups [G]   one program
    gate_up  h[pair] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)   grid (G, I / BLOCK_N)
    down     y[pair] = h[pair] @ down[e].T                          grid (G, H / BLOCK_N)
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

The route kernel covers the softmax routers (Qwen3-MoE, Mixtral); DeepSeek-V3's
group-limited sigmoid router stays in torch (routers.route) and `expert_groups` builds the
groups from its ids in one more launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, groups_ptr, t, e, num_groups, stride_l,
    TOP_K: tl.constexpr, SOFTMAX_ALL: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_G: tl.constexpr,
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
    top_w = tl.zeros((BLOCK_T, BLOCK_KS), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_KS), dtype=tl.int32)
    used = tl.zeros((BLOCK_E,), dtype=tl.int32)
    vals = x
    for j in tl.static_range(TOP_K):  # descending, the lowest index first on ties (torch.topk)
        best = tl.max(vals, axis=1)
        idx = tl.argmax(vals, axis=1, tie_break_left=True)
        top_w = tl.where(slot[None, :] == j, best[:, None], top_w)
        top_i = tl.where(slot[None, :] == j, idx[:, None], top_i)
        hit = col[None, :] == idx[:, None]
        used = tl.maximum(used, tl.max((hit & t_ok[:, None]).to(tl.int32), axis=0))
        vals = tl.where(hit, float("-inf"), vals)
    s_ok = slot[None, :] < TOP_K
    if SOFTMAX_ALL:  # Qwen3-MoE: softmax over all E, then the top k (renormalised if asked)
        denom = tl.sum(tl.exp(x - top[:, None]), axis=1)
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]) / denom[:, None], 0.0)
        if NORMALIZE:
            w = w / tl.sum(w, axis=1)[:, None]
    else:  # Mixtral: softmax over the k chosen logits
        w = tl.where(s_ok, tl.exp(top_w - top[:, None]), 0.0)
        w = w / tl.sum(w, axis=1)[:, None]
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
    match = ids == expert
    mine = tl.max(match.to(tl.int32), axis=1) > 0
    pair = tok * TOP_K + tl.sum(tl.where(match, slot[None, :], 0), axis=1)
    return tok, mine, pair


@triton.jit
def _rows_times_w(a, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [BLOCK_T, BLOCK_K] x w [BLOCK_N, BLOCK_K] → [BLOCK_T, BLOCK_N] float32."""
    if USE_DOT:
        return tl.dot(a, tl.trans(w), input_precision=PRECISION)
    return tl.sum(a[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, groups_ptr, h_ptr, t, hidden, inter,
    stride_x, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    expert = tl.load(groups_ptr + tl.program_id(0))
    if expert < 0:  # past the last distinct expert
        return
    tok, mine, pair = _rows_of_group(ids_ptr, expert, t, TOP_K, BLOCK_T, BLOCK_KS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of I: gate row c, up row I + c
    col_ok = cols < inter
    gate = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wn
    up = gate + inter * stride_wn
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + tok[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=mine[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_K], only the rows of tokens that chose this expert
        w_mask = col_ok[:, None] & k_ok[None, :]
        acc_g += _rows_times_w(a, tl.load(gate + ks[None, :], mask=w_mask, other=0.0), USE_DOT,
                               PRECISION)  # fmt: skip
        acc_u += _rows_times_w(a, tl.load(up + ks[None, :], mask=w_mask, other=0.0), USE_DOT,
                               PRECISION)  # fmt: skip
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)  # the reference rounds the gate_up matmul's output
    u = acc_u.to(dt).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    out = h_ptr + pair[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(out, h.to(dt), mask=mine[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, ids_ptr, groups_ptr, y_ptr, t, hidden, inter,
    stride_h, stride_we, stride_wn, stride_y,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    expert = tl.load(groups_ptr + tl.program_id(0))
    if expert < 0:
        return
    tok, mine, pair = _rows_of_group(ids_ptr, expert, t, TOP_K, BLOCK_T, BLOCK_KS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of H
    col_ok = cols < hidden
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wn
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            h_ptr + pair[:, None].to(tl.int64) * stride_h + ks[None, :],
            mask=mine[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _rows_times_w(a, w, USE_DOT, PRECISION)
    out = y_ptr + pair[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, weights_ptr, out_ptr, hidden, stride_y, stride_o,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < hidden
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, as moe._combine
        w = tl.load(weights_ptr + tok * TOP_K + j)
        row = y_ptr + (tok * TOP_K + j).to(tl.int64) * stride_y
        acc += w * tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + tok.to(tl.int64) * stride_o + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def num_groups(tokens: int, top_k: int, experts: int) -> int:
    """G: the most distinct experts a step of `tokens` tokens can choose."""
    return max(1, min(experts, tokens * top_k))


def route_topk(
    logits: torch.Tensor, top_k: int, softmax_all: bool, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights [T, k] float32, ids [T, k] int64, groups [G] int32), one
    launch: Qwen3-MoE's router (softmax_all, normalize = norm_topk_prob) or Mixtral's (top-k
    logits, softmax over them)."""
    t, e = logits.shape
    assert logits.stride(1) == 1 and top_k <= e, (logits.shape, top_k)
    dev = logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    g = num_groups(t, top_k, e)
    groups = torch.empty(g, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](
        logits, weights, ids, groups, t, e, g, logits.stride(0),
        TOP_K=top_k, SOFTMAX_ALL=softmax_all, NORMALIZE=normalize,
        BLOCK_T=_pow2(t), BLOCK_E=_pow2(e), BLOCK_KS=_pow2(top_k), BLOCK_G=_pow2(g),
        num_warps=4,
    )  # fmt: skip
    return weights, ids, groups


def expert_groups(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, k] → groups [G] int32 (the distinct experts ascending, then -1), one launch:
    for routers computed elsewhere (DeepSeek-V3's, in torch)."""
    t, k = ids.shape
    ids = ids.contiguous()
    g = num_groups(t, k, num_experts)
    groups = torch.empty(g, dtype=torch.int32, device=ids.device)
    _groups_kernel[(1,)](
        ids, groups, t * k, g,
        BLOCK_R=16, BLOCK_E=_pow2(num_experts), BLOCK_G=_pow2(g), num_warps=4,
    )  # fmt: skip
    return groups


# Steps of up to this many tokens multiply by broadcasting (a GEMV per row); above, tl.dot
# tiles of >= 16 rows (padding rows cost tensor-core time only, which decode has to spare,
# and Triton pipelines a dot loop's loads, which it does not for the GEMV's). Where the
# switch should be on a GPU: bench/moe.py --decode-gemv-tokens.
GEMV_MAX_TOKENS = 1


def _tiles(
    tokens: int, block_n: int, itemsize: int, gemv_max_tokens: int
) -> tuple[int, int, int, bool]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, tl.dot?) for a projection over `tokens` rows: GEMV tiles
    of ~4K products (wide K strips for one row, narrower as rows grow), else dot tiles."""
    block_t = _pow2(tokens)
    if tokens > gemv_max_tokens:
        block_t = max(16, block_t)
        return block_t, block_n, 128 if itemsize <= 2 and block_t <= 32 else 64, True
    return block_t, block_n, max(16, min(256, 4096 // (block_t * block_n))), False


def decode_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    groups: torch.Tensor,  # [G] from route_topk / expert_groups
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    gemv_max_tokens: int | None = None,  # None: GEMV_MAX_TOKENS
) -> torch.Tensor:
    """Σ_j weights[t, j] · down[e](silu·mul(gate_up[e] x[t])) for each token's k experts
    e = ids[t, j]: three launches (gate_up, down, combine)."""
    t, hidden = x.shape
    experts, two_i, hidden_w = gate_up.shape
    k = ids.shape[1]
    inter = two_i // 2
    assert hidden == hidden_w and down.shape == (experts, hidden, inter), (x.shape, down.shape)
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    ids = ids.contiguous()
    weights = weights.contiguous()
    g = groups.numel()
    out = torch.empty_like(x)
    if t == 0:
        return out
    h = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((t * k, hidden), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gemv_max_tokens = GEMV_MAX_TOKENS if gemv_max_tokens is None else gemv_max_tokens
    bt, bn, bk, dot = _tiles(t, 16, x.element_size(), gemv_max_tokens)
    _gate_up_kernel[(g, triton.cdiv(inter, bn))](
        x, gate_up, ids, groups, h, t, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=_pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, num_warps=4,
    )  # fmt: skip
    bt, bn, bk, dot = _tiles(t, 32, x.element_size(), gemv_max_tokens)
    _down_kernel[(g, triton.cdiv(hidden, bn))](
        h, down, ids, groups, y, t, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=_pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, num_warps=4,
    )  # fmt: skip
    block_c = 256
    _combine_kernel[(t, triton.cdiv(hidden, block_c))](
        y, weights, out, hidden, y.stride(0), out.stride(0), TOP_K=k, BLOCK_N=block_c,
        num_warps=4,
    )  # fmt: skip
    return out
