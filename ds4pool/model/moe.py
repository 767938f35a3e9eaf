"""Mixture-of-experts: the expert compute as plain functions, and the sparse block.

Shapes: T = tokens in the step (the whole ragged batch), H = hidden size, E = experts,
k = experts per token, I = one expert's intermediate size, R = T * k routed rows.

A router (model/routers.py) maps expert logits [T, E] to (weights [T, k] float32, ids [T, k]
int64), exactly as the reference implementation of its family computes them. The experts'
weights are stacked:
`gate_up [E, 2I, H]` (gate rows first, then up, as transformers 5 holds them) and
`down [E, H, I]`.

`grouped_experts` is the CUDA path: the R (token, expert) rows are sorted by expert and each
projection is one grouped GEMM over all experts (torch's `grouped_mm`, or the Triton kernel
of model/kernels/triton_moe.py where torch's would sync), so every expert's weights are read
once per step however many tokens chose it, and an expert no token chose is not read at all.
It has no host sync (counts, offsets and the permutation stay on the device), so a decode
step through it can be captured in a CUDA graph. `looped_experts` is the reference and the CPU
path: one matmul pair per expert that some token chose (it reads which ones on the host).
For small decode steps (T·k ≤ `DECODE_MAX_PAIRS`) "auto" on CUDA takes the decode path
instead: the router fused into one launch (model/kernels/triton_moe_route.py), then gate_up,
down and combine kernels that read each chosen expert once (triton_moe_decode.py), five
launches per layer with the router's linear instead of ~15; four where the gate_up launch
does the routing itself (`ROUTE_IN_GATE_UP`). All combine a token's k outputs
in its top-k order, in float32, so they agree to rounding.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ds4pool.model.config import MoEConfig
from ds4pool.model.layers import GatedMLP, RMSNorm
from ds4pool.model.routers import route

if TYPE_CHECKING:  # kernels/ stays unimported at module level (triton is CUDA-only)
    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig
    from ds4pool.model.kernels.triton_moe_route import DeferredRoute

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
# Where the decode path routes inside its gate_up launch (every program computes the step's
# routing from the [T, E] logits, one stores it: triton_moe_route.DeferredRoute) instead of
# in a route launch of its own: a launch and a dependent gap fewer a layer (the route
# launch was 4.5 µs of 48 sparse layers' 3.88 ms batch-1 step on the H200), for routing
# work in every gate_up program before its first weight load, which grows with T·E·k, and
# registers: compiled for sm_90 at the table's configs, the 1-, 2- and 4-token gate_up keep
# their main loop's spills (none, none, as many), the 8-token one (2 warps) spills in it
# where it did not. Larger steps keep the launch until the H200 says otherwise
# (bench/moe_layer.py --route). DeepSeek-V3's group-limited router (N_GROUP more argmax
# rounds a program) keeps it too; the kernels take it either way (the same code).
ROUTE_IN_GATE_UP = ("softmax_topk", "topk_softmax")
ROUTE_IN_GATE_UP_MAX_TOKENS = 4
# The most tokens the routing gate_up may take even when asked to (decode_route_in_gate_up =
# True): on the H200 it stored the route launch's bits at 1 to 16 tokens (session 22, ties
# included) and at 32 and 64 with random logits (session 23; session 22's 64-token failure
# was its test's tile config running out of shared memory), but 64 with ties never ran, so
# larger steps keep the route launch whatever the setting.
ROUTE_IN_GATE_UP_VERIFIED_TOKENS = 16
# SparseMoeBlock.decode_route_in_gate_up by name (the benchmarks' --route flags)
DECODE_ROUTES: dict[str, bool | None] = {"auto": None, "gate_up": True, "separate": False}


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


# ---- the layer ----


class Router(nn.Module):
    """`weight` [E, H] is Hugging Face's `mlp.gate.weight`; DeepSeek-V3 adds the
    `e_score_correction_bias` [E] buffer (a checkpoint tensor, used for choosing only)."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        # register_buffer refuses a name that is already a plain attribute: set one or other
        self.e_score_correction_bias: torch.Tensor | None
        if moe.router == "sigmoid_group_topk":
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] → [T, E]
        if self.moe.router == "sigmoid_group_topk":  # DeepSeek scores in float32
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] → [T, k]
        return route(self.moe, self.logits(x), self.e_score_correction_bias)

    def route_decode(
        self, x: torch.Tensor, logits: torch.Tensor | None = None, defer: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DeferredRoute | None]:
        """(weights, ids, groups, None) for the decode path: the router's linear (unless
        `logits` come made, SparseMoeBlock.decode_layer), then the routing and the step's
        expert groups in one Triton launch. With `defer`, no launch: the three are empty,
        and the DeferredRoute that decode_experts' gate_up launch routes by (it fills them)."""
        from ds4pool.model.kernels.triton_moe_route import route_deferred, route_fused

        if logits is None:
            logits = self.logits(x)
        if defer:
            route = route_deferred(self.moe, logits, self.e_score_correction_bias)
            return route.weights, route.ids, route.groups, route
        return (*route_fused(self.moe, logits, self.e_score_correction_bias), None)


class Experts(nn.Module):
    """The stacked expert weights (transformers 5's in-memory names); checkpoints keep one
    tensor per expert and projection, which model/registry.py stacks at load."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))  # [E, H, I]


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: route each token to k experts, sum their outputs (plus the
    shared experts' where the family has them). A drop-in for GatedMLP in a decoder layer."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.gate = Router(moe, hidden)
        self.experts = Experts(moe, hidden)
        self.shared_experts: GatedMLP | None = None
        if moe.num_shared_experts:
            size = moe.intermediate_size * moe.num_shared_experts
            self.shared_experts = GatedMLP(hidden, size, bias=False)
        # Called with each forward's expert ids [T, k] when set (benchmarks count the experts
        # a step reads); Python-side, so it sees eager forwards only, not graph replays.
        self.observer: Callable[[torch.Tensor], None] | None = None
        self.impl = "auto"  # one of EXPERT_IMPLS (benchmarks compare them)
        self.decode_max_pairs = DECODE_MAX_PAIRS  # where "auto" switches to grouped GEMMs
        self.decode_gemv_tokens: int | None = None  # None: the decode kernels' own default
        # the decode kernels' launch configuration (triton_moe_configs.DecodeConfig); None:
        # their table by token count (bench/moe_layer.py --sweep sets candidates here)
        self.decode_config: DecodeConfig | None = None
        # decode_layer runs the add + norm before the block and the router's linear in one
        # launch (kernels/triton_moe_gate.py); False: two (benchmarks compare them)
        self.fuse_gate = True
        # the routing inside the gate_up launch (True), in a launch of its own (False), or
        # None: by ROUTE_IN_GATE_UP and ROUTE_IN_GATE_UP_MAX_TOKENS (benchmarks A/B them)
        self.decode_route_in_gate_up: bool | None = None

    def fuse(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual', norm(residual')) with residual' = residual + self(x), the combine,
        the add and the norm in one launch (updating `residual` in place, as TritonOps'
        add_rms_norm does), where the step takes the decode kernels on the Triton path and
        there are no shared experts; None elsewhere: the caller runs forward and the norm."""
        if not self._fuses_norms(x, ops):
            return None
        return residual, self._decode(x, residual, norm)

    def _fuses_norms(self, x: torch.Tensor, ops: Any) -> bool:
        """Whether this step's norms around the block run inside its decode kernels: the
        Triton path's decode kernels, and no shared experts to add after them."""
        triton_ops = getattr(ops, "name", None) == "triton"
        return triton_ops and self.shared_experts is None and self._takes_decode(x)

    def decode_layer(
        self,
        a: torch.Tensor,  # [T, H] the attention's output
        residual: torch.Tensor,
        pre_norm: RMSNorm,  # the layer's post-attention norm, this block's input
        next_norm: RMSNorm,
        ops: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's MLP half, (residual'', next_norm(residual'')), in four launches where
        add_norm applies and the router is a softmax one: the add, this block's input norm and
        the router's linear in one (kernels/triton_moe_gate.py), then route, experts and
        the combine with the next add + norm; three where the gate_up launch routes
        (routes_in_gate_up). None elsewhere: the caller runs the add + norm
        and add_norm."""
        if not self.fuse_gate or self.gate.moe.router == "sigmoid_group_topk":
            return None  # DeepSeek-V3's scores are float32 logits of float32 inputs
        if not self._fuses_norms(a, ops):
            return None
        from ds4pool.model.kernels.triton_moe_gate import add_norm_logits

        residual, h, logits = add_norm_logits(
            a, residual, pre_norm.weight, pre_norm.eps, self.gate.weight
        )
        return residual, self._decode(h, residual, next_norm, logits)

    def _takes_decode(self, x: torch.Tensor) -> bool:
        pairs = x.shape[0] * self.gate.moe.top_k
        chosen = expert_impl(x.device, x.dtype, self.impl, pairs, self.decode_max_pairs)
        return chosen == "decode"

    def _decode(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decode kernels' output; with `residual` and `norm`, norm(residual += it)."""
        from ds4pool.model.kernels.triton_moe_decode import decode_experts

        defer = self.routes_in_gate_up(len(x))
        weights, ids, groups, route = self.gate.route_decode(x, logits, defer)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        out = decode_experts(
            x, weights, ids, groups, gate_up, down, self.decode_gemv_tokens, self.decode_config,
            residual=residual, norm_weight=None if norm is None else norm.weight,
            eps=0.0 if norm is None else norm.eps, route=route,
        )  # fmt: skip
        if self.observer is not None:  # after: the gate_up launch may be what fills the ids
            self.observer(ids)
        return out

    def routes_in_gate_up(self, tokens: int) -> bool:
        """Whether a decode step of `tokens` routes inside the gate_up launch."""
        if tokens > ROUTE_IN_GATE_UP_VERIFIED_TOKENS:
            return False
        if self.decode_route_in_gate_up is not None:
            return self.decode_route_in_gate_up
        fits = tokens <= ROUTE_IN_GATE_UP_MAX_TOKENS
        return fits and self.gate.moe.router in ROUTE_IN_GATE_UP

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:  # [T, H] → [T, H]
        if self._takes_decode(x):
            out = self._decode(x)
        else:
            weights, ids = self.gate(x)
            if self.observer is not None:
                self.observer(ids)
            act = silu_mul if ops is None else ops.silu_mul
            gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
            out = experts_forward(x, weights, ids, gate_up, down, act, self.impl)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ops)
        return out
