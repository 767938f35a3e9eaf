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

Row buckets: oneDNN caches one primitive per distinct input shape (~0.57 MiB each whatever
the weight's size, up to 1,024 of them), so a server whose steps take every row count from 1
to a few hundred would grow by hundreds of MiB. `PackedLinear` pads the rows up to one of
`ROW_BUCKETS` (28 sizes) and runs longer inputs as `ROW_CAP`-row slabs: at most 28
primitives per weight shape (~16 MiB). Rows are independent in oneDNN's kernel (a row's bits
do not depend on the row count: tests/unit/test_cpu_linear.py), so padding changes no value.
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

# Row counts up to EXACT_ROWS (small decode batches) run as they are; larger ones are rounded
# up to STEPS_PER_OCTAVE sizes per doubling (10, 12, 14, 16, 20, ..., 224, 256). From ~8 rows
# on a GEMM's time grows with its rows, so a padded call costs its bucket's GEMM: at most ~24%
# more rows (measured, docs/BENCHMARKS.md). Past ROW_CAP the time per row is flat, so longer
# inputs run as ROW_CAP-row slabs.
EXACT_ROWS = 8
STEPS_PER_OCTAVE = 4
ROW_CAP = 256


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN sees for `rows` (1 <= rows <= ROW_CAP)."""
    assert 1 <= rows <= ROW_CAP, rows
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows - 1).bit_length()) // (2 * STEPS_PER_OCTAVE)  # rows in (2^k, 2^(k+1)]
    return -(-rows // step) * step


ROW_BUCKETS = tuple(sorted({row_bucket(m) for m in range(1, ROW_CAP + 1)}))


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
        rows = x.reshape(-1, self.in_features)  # [M, K]
        m = rows.shape[0]
        if m <= ROW_CAP:
            out = self._bucketed(rows)
        else:
            # [0, full) as whole slabs (views, no copy); [full, M) as one padded remainder
            out = rows.new_empty(m, self.out_features)
            full = m - m % ROW_CAP
            for start in range(0, full, ROW_CAP):
                out[start : start + ROW_CAP] = self._run(rows[start : start + ROW_CAP])
            if full < m:
                out[full:] = self._bucketed(rows[full:])
        return out.reshape(*x.shape[:-1], self.out_features)

    def _bucketed(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M <= ROW_CAP, K] -> [M, N], oneDNN seeing row_bucket(M) rows. The padded
        copy lives for this call only (at most ROW_CAP x K): memory does not grow with use."""
        m = rows.shape[0]
        if m == 0:
            return rows.new_empty(0, self.out_features)
        bucket = row_bucket(m)
        if bucket == m:
            return self._run(rows)
        padded = rows.new_empty(bucket, self.in_features)
        padded[:m] = rows
        padded[m:].zero_()  # finite filler: the padded rows' outputs are dropped
        return self._run(padded)[:m]

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")

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
