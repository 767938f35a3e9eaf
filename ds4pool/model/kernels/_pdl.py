"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A decode step at small batch is a chain of a few hundred short kernels, each waiting for the
one before it. Between two of them the GPU drains the first (its last wave leaves SMs idle)
and ramps up the second (its first loads are a full memory latency away). With PDL a kernel
launched with `launch_pdl=True` may start while the kernel before it still runs:

- every kernel of the chain calls `pdl_trigger` at its first instruction: the next kernel's
  programs may then be scheduled as soon as all of this kernel's programs have started;
- a kernel launched with PDL issues the loads of what no earlier kernel writes (its weights)
  first, then `pdl_wait` (griddepcontrol.wait: until the kernel before it has finished and
  its stores are visible), and only then loads its inputs and stores anything.

So a projection's first weight tiles are in flight while the projection before it finishes.
Nothing is stored before the wait, so the early programs cannot overwrite what a running
kernel still reads; the wait is transitive (the kernel before waited for its own), so an
input made two kernels back is complete too.

Both instructions are no-ops where the kernel was not launched with PDL, and the Triton
interpreter has neither: callers pass PDL=False there (`supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched with PDL (CUDA, compute capability 9+)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict[str, bool]:
    """The Triton launch keyword for a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel's programs start once every program of this one has started."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its stores are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
