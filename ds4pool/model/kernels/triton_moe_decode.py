"""The small-batch decode path of the MoE layers in Triton: few launches, each expert's
weights read once per step, no host sync (CUDA-graph capturable).

For a decode step of T tokens with k experts each (R = T·k pairs, a few dozen) the grouped
GEMM path spends most of its time in ~15 small launches and in 16-row tiles that are mostly
padding. Here a MoE layer is four launches after the router's linear:

    route    logits [T, E] → weights [T, k] f32, ids [T, k] i64, groups [G]   (triton_moe_route)
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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4pool.model.kernels.triton_moe_route import pow2


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


# Steps of up to this many tokens multiply by broadcasting (a GEMV per row); above, tl.dot
# tiles of >= 16 rows (padding rows cost tensor-core time only, which decode has to spare,
# and Triton pipelines a dot loop's loads, which it does not for the GEMV's). Where the
# switch should be on a GPU: bench/moe.py --decode-gemv-tokens. On the H200 (bench/moe_layer.py,
# 2026-12-01) the GEMV read one token's 8 experts in 60.8 µs a layer (30% of the copy
# bandwidth) while the tiles read two tokens' 15.2 experts in 58.0 µs: tiles from one token.
GEMV_MAX_TOKENS = 0


def _tiles(
    tokens: int, block_n: int, itemsize: int, gemv_max_tokens: int
) -> tuple[int, int, int, bool]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, tl.dot?) for a projection over `tokens` rows: GEMV tiles
    of ~4K products (wide K strips for one row, narrower as rows grow), else dot tiles."""
    block_t = pow2(tokens)
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
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, num_warps=4,
    )  # fmt: skip
    bt, bn, bk, dot = _tiles(t, 32, x.element_size(), gemv_max_tokens)
    _down_kernel[(g, triton.cdiv(hidden, bn))](
        h, down, ids, groups, y, t, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        TOP_K=k, BLOCK_T=bt, BLOCK_KS=pow2(k), BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        PRECISION=precision, num_warps=4,
    )  # fmt: skip
    block_c = 256
    _combine_kernel[(t, triton.cdiv(hidden, block_c))](
        y, weights, out, hidden, y.stride(0), out.stride(0), TOP_K=k, BLOCK_N=block_c,
        num_warps=4,
    )  # fmt: skip
    return out
