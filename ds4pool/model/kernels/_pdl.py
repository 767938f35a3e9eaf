"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's chains of small
Triton kernels.

At batch 1 a sparse layer is a chain of launches of a few µs each (attention prologue → paged
decode; the gate → route → expert gate_up → down → combine), and inside a CUDA graph each
one still waits for the previous one to end before its programs are even placed: ~1.5 µs a
boundary on the H200. With PDL a kernel launched with `launch_pdl=True` is placed as soon as
every program of the kernel before it has called `gdc_launch_dependents()`; it then runs until
its own `gdc_wait()`, which returns once that kernel has finished and its writes are visible.
Measured on the H200 (`.peer/pdl_probe.py`, session 22: 240 dependent kernels of 16-192
programs in one graph): 3.45 µs a kernel without PDL, 2.53 with PDL triggered at the end of
each kernel, 1.96 triggered at its start.

The contract every kernel of a chain keeps (`USE_GDC` constexpr, set by `enabled(device)`):
- it may call `gdc_launch_dependents()` first thing (the next kernel only gets placed; it
  waits before it reads anything this one writes);
- before its `gdc_wait()` it reads only what no kernel of the forward writes (weights, and
  the step's inputs, staged before the chain's first kernel, which is launched without PDL)
  and writes nothing;
- it is launched with `launch_pdl=USE_GDC` and calls `gdc_wait()` before its first read of
  another kernel's output and its first write. A kernel launched without PDL starts after the
  previous one ends, as always, so a chain may start or stop at any kernel.
Turned off with DS4POOL_PDL=0 (read at each launch, so a test can compare both), under the
Triton interpreter and before sm_90.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "DS4POOL_PDL"


@functools.lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether the decode path's kernels on `device` launch as a PDL chain."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())
