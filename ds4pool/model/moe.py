"""Mixture-of-experts: the sparse block (router, stacked experts, the decode path's launches).

A router (model/routers.py) maps expert logits [T, E] to (weights [T, k] float32, ids [T, k]
int64), exactly as the reference implementation of its family computes them; the experts'
compute is model/experts.py (`experts_forward`, by `expert_impl`). For small decode steps on
CUDA the block drives the decode path itself: the router fused into one launch
(model/kernels/triton_moe_route.py), then gate_up, down and combine kernels that read each
chosen expert once (triton_moe_decode.py), five launches per layer with the router's linear
instead of ~15; four where the gate_up launch does the routing itself (`ROUTE_IN_GATE_UP`),
fewer still where the add + norm before the block joins the router's linear
(`decode_layer`) and the combine the add + norm after it (`add_norm`).
Shapes as in model/experts.py: T tokens, H hidden, E experts, k a token's experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ds4pool.model.config import MoEConfig
from ds4pool.model.experts import DECODE_MAX_PAIRS, expert_impl, experts_forward, silu_mul
from ds4pool.model.layers import GatedMLP, RMSNorm
from ds4pool.model.routers import route

if TYPE_CHECKING:  # kernels/ stays unimported at module level (triton is CUDA-only)
    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig
    from ds4pool.model.kernels.triton_moe_route import DeferredRoute

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
        return residual, self._decode(x, residual, norm, pdl=ops.pdl_on(x.device, "moe"))

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

        pdl = ops.pdl_on(a.device, "moe")
        residual, h, logits = add_norm_logits(
            a, residual, pre_norm.weight, pre_norm.eps, self.gate.weight, pdl=pdl
        )
        return residual, self._decode(h, residual, next_norm, logits, pdl)

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
        pdl: bool = False,  # the kernels launched with programmatic dependent launch
    ) -> torch.Tensor:
        """The decode kernels' output; with `residual` and `norm`, norm(residual += it)."""
        from ds4pool.model.kernels.triton_moe_decode import decode_experts

        defer = self.routes_in_gate_up(len(x))
        weights, ids, groups, route = self.gate.route_decode(x, logits, defer)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        out = decode_experts(
            x, weights, ids, groups, gate_up, down, self.decode_gemv_tokens, self.decode_config,
            residual=residual, norm_weight=None if norm is None else norm.weight,
            eps=0.0 if norm is None else norm.eps, route=route, pdl=pdl,
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
            out = self._decode(x, pdl=ops is not None and ops.pdl_on(x.device, "moe"))
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
