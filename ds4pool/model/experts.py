"""The experts of a mixture-of-experts layer as plain functions: x [T, H] and a router's
(weights, ids) [T, k] → [T, H], by one of several implementations (`expert_impl`).

Shapes: T = tokens in the step (the whole ragged batch), H = hidden size, E = experts,
k = experts per token, I = one expert's intermediate size, R = T * k routed rows. The
experts' weights are stacked: `gate_up [E, 2I, H]` (gate rows first, then up, as
transformers 5 holds them) and `down [E, H, I]`.

`grouped_experts` is the CUDA path: the R (token, expert) rows are sorted by expert and each
projection is one grouped GEMM over all experts (torch's `grouped_mm`, or the Triton kernel
of model/kernels/triton_moe.py where torch's would sync), so every expert's weights are read
once per step however many tokens chose it, and an expert no token chose is not read at all.
It has no host sync (counts, offsets and the permutation stay on the device), so a decode
step through it can be captured in a CUDA graph. `looped_experts` is the reference and the CPU
path: one matmul pair per expert that some token chose (it reads which ones on the host).
For small decode steps (T·k ≤ `DECODE_MAX_PAIRS`) "auto" on CUDA takes the decode path
(model/kernels/triton_moe_decode.py: kernels that read each chosen expert once; the sparse
block drives it, model/moe.py). All combine a token's k outputs in its top-k order, in
float32, so they agree to rounding.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch.nn import functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]  # [R, 2I] gate|up → [R, I]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- expert compute: x [T, H], (weights, ids) [T, k] → [T, H] ----


def _combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [T, k, H] (slot j of token t = its j-th expert's output) → Σ_j w[t, j] rows[t, j]."""
    return (rows.float() * weights[:, :, None]).sum(dim=1).to(dtype)


def looped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    act: Activation = silu_mul,
) -> torch.Tensor:
    """Reference and CPU path: one gate_up and one down matmul per expert that was chosen
    (reads the chosen experts on the host: not for CUDA graphs)."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [R], row r = (token r // k, slot r % k)
    rows = x.new_empty((t * k, x.shape[1]))
    for e in torch.unique(flat).tolist():
        where = (flat == e).nonzero().squeeze(1)  # [n_e] rows routed to expert e
        h = act(F.linear(x.index_select(0, where // k), gate_up[e]))
        rows.index_copy_(0, where, F.linear(h, down[e]))
    return _combine(rows.view(t, k, -1), weights, x.dtype)


def grouped_mm_op() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM (F.grouped_mm in torch >= 2.10, torch._grouped_mm before)."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch runs grouped_mm on the device without a host sync: its CUTLASS kernels
    take bf16 on sm90 / sm100; elsewhere it falls back to a loop that copies the offsets to the
    host (correct, but not capturable in a CUDA graph)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or grouped_mm_op() is None:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


# How a SparseMoeBlock computes its experts: "grouped_mm" (torch's, CUTLASS), "triton"
# (model/kernels/triton_moe.py), "decode" (model/kernels/triton_moe_decode.py), "loop"
# (looped_experts), or "auto": on CUDA with triton the decode path for steps of at most
# `max_pairs` (token, expert) pairs, else the first grouped GEMM that is sync-free on the
# device and dtype, else the loop.
EXPERT_IMPLS = ("auto", "grouped_mm", "triton", "decode", "loop")
SYNC_FREE = ("grouped_mm", "triton", "decode")
# T·k up to which "auto" takes the decode path (batch 64 at top-8): its programs serve one
# expert each and multiply every token row of the step, so with enough pairs the tiled
# grouped GEMMs win. Measured on the H200 (bench/moe_layer.py, Qwen3-30B-A3B layer,
# 2026-12-01): the decode path is faster at every T from 1 to 64 (422 vs 517 µs a layer at
# 64 tokens); past 64 tokens it was not measured, so prefill chunks keep the grouped GEMMs.
DECODE_MAX_PAIRS = 512


def expert_impl(
    device: torch.device,
    dtype: torch.dtype,
    requested: str = "auto",
    pairs: int | None = None,  # T·k of the step; None: the choice for large steps
    max_pairs: int = DECODE_MAX_PAIRS,
) -> str:
    assert requested in EXPERT_IMPLS, requested
    if requested != "auto":
        return requested
    triton_ok = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if triton_ok and pairs is not None and pairs <= max_pairs:
        return "decode"
    if grouped_mm_supported(device, dtype):
        return "grouped_mm"
    return "triton" if triton_ok else "loop"


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    act: Activation = silu_mul,
    gemm: str = "grouped_mm",  # or "triton"
) -> torch.Tensor:
    """Sorted by expert, one grouped GEMM per projection; no host sync."""
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)  # [R]
    order = torch.argsort(flat, stable=True)  # [R] rows grouped by expert, in token order
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    xs = x.index_select(0, order // k)  # [R, H]
    if gemm == "triton":
        from ds4pool.model.kernels.triton_moe import grouped_gemm

        h = act(grouped_gemm(xs, gate_up, counts))  # [R, I]
        ys = grouped_gemm(h, down, counts)  # [R, H]
    else:
        assert gemm == "grouped_mm", gemm
        mm = grouped_mm_op()
        assert mm is not None, "torch has no grouped_mm"
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each group
        # weights are [E, N, K] (out, in): their transpose is the column-major [E, K, N] operand
        h = act(mm(xs, gate_up.transpose(1, 2), offs=offsets))  # [R, I]
        ys = mm(h, down.transpose(1, 2), offs=offsets)  # [R, H]
    rows = torch.empty_like(ys).index_copy_(0, order, ys)  # back to (token, slot) order
    return _combine(rows.view(t, k, -1), weights, x.dtype)


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_mul,
    impl: str = "auto",
    max_pairs: int = DECODE_MAX_PAIRS,
) -> torch.Tensor:
    """The experts of every token, by `expert_impl(impl)`. The decode path fuses silu·mul
    (every supported family's expert activation) and ignores `act`."""
    chosen = expert_impl(x.device, x.dtype, impl, ids.numel(), max_pairs)
    if chosen == "loop":
        return looped_experts(x, weights, ids, gate_up, down, act)
    if chosen == "decode":
        from ds4pool.model.kernels.triton_moe_decode import decode_experts
        from ds4pool.model.kernels.triton_moe_route import expert_groups

        groups = expert_groups(ids, gate_up.shape[0])
        return decode_experts(x, weights, ids, groups, gate_up, down)
    return grouped_experts(x, weights, ids, gate_up, down, act, gemm=chosen)
