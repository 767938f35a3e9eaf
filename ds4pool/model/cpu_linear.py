"""CPU projections through oneDNN prepacked weights.

On CPU the projections (qkv, o, gate_up, down, the LM head, MLA's projections, shared
experts) are most of a decode step, and torch's F.linear runs them through MKL, which takes
its slow generic code path on non-Intel CPUs (a vendor check, not a feature check). oneDNN
has no such check: a weight reordered once into its blocked layout
(`mkldnn._reorder_linear_weight`) and run by `mkldnn._linear_pointwise` measured 1.3-1.6x
the GFLOP/s of F.linear on a 2-core AMD EPYC (docs/BENCHMARKS.md). With one packed weight a
row's output is also the same bits alone or inside any batch (MKL's is not).

`pack_cpu_linears` replaces the model's nn.Linear modules in place by `PackedLinear`s that
hold only the packed weight (the dense one is freed: RAM stays flat). It is called once,
after loading, by whoever builds the runner (engine.py, bench/decode.py): the choice lives
in the model's modules, no process-wide switch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ds4pool.errors import DeviceError

CPU_LINEAR_MODES = ("auto", "onednn", "torch")

# Linears whose dense weight other code reads (MLA absorbs kv_b_proj's weight into its
# attention): packing them would break that reader.
DENSE_READERS = ("kv_b_proj",)

# oneDNN picks its blocking for this many rows; decode batches are of this order, and one
# packing serves every batch size (measured: prompt chunks of 256 rows gain as well).
BATCH_HINT = 16


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's layout (an opaque tensor of W's size and dtype:
    byte counts over parameters() stay true, dense reads of `.weight` do not work)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def onednn_usable(dtype: torch.dtype) -> str | None:
    """None if the packed path works here for `dtype`, else why not (one line)."""
    if dtype != torch.float32:
        # bf16 needs AVX512-BF16/AVX-NE-CONVERT; fp16 has no packed path: fp32 only
        return f"oneDNN packed linears are float32 only (the dtype is {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    # the one-time check: the ops exist and agree with F.linear on a small random problem
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen))
        lin.bias.copy_(torch.randn(48, generator=gen))
    try:
        with torch.no_grad():
            got = PackedLinear(lin)(x)
    except (AttributeError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"oneDNN linear failed: {first}"
    want = F.linear(x, lin.weight, lin.bias)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return "oneDNN linear does not match F.linear"
    return None


def select_cpu_linear(
    mode: str, device: torch.device, dtype: torch.dtype
) -> str:  # "onednn" | "torch"
    """Resolve --cpu-linear: auto is onednn where it works (CPU, fp32), else torch; an
    explicit onednn that cannot work is a DeviceError in one line."""
    if mode not in CPU_LINEAR_MODES:
        raise DeviceError(f"unknown --cpu-linear {mode!r}; use {', '.join(CPU_LINEAR_MODES)}")
    if mode == "torch":
        return "torch"
    if device.type != "cpu":
        if mode == "onednn":
            raise DeviceError(
                f"--cpu-linear onednn needs the CPU device (the device is {device.type})"
            )
        return "torch"
    why = onednn_usable(dtype)
    if why is None:
        return "onednn"
    if mode == "onednn":
        raise DeviceError(f"--cpu-linear onednn: {why}")
    return "torch"


def pack_cpu_linears(model: nn.Module, mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """Pack `model`'s projections if `mode` resolves to onednn; returns what runs them.
    Linears sharing their weight with another module (a tied LM head) and the DENSE_READERS
    keep F.linear: packing them would need a second copy or break a dense read."""
    impl = select_cpu_linear(mode, device, dtype)
    if impl != "onednn":
        return impl
    shared = _shared_weights(model)
    # parents only: a list holding the Linears themselves would keep every dense weight
    # alive until the end, doubling the peak
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for parent in parents:
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or name in DENSE_READERS:
                continue
            w = child.weight
            if w.device.type != "cpu" or w.dtype != torch.float32 or id(w) in shared:
                continue
            setattr(parent, name, PackedLinear(child))  # the dense weight goes with child
    return impl


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters reachable under more than one name (tied embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}
