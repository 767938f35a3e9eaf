"""Device and dtype selection: auto picks cuda > mps > cpu; unsupported combos fail clearly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ds4pool.errors import DeviceError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


_NUMPY_INTS = {torch.int64: np.int64, torch.int32: np.int32}


def host_ints(
    values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A CPU tensor of Python ints (a list, or equal-length lists) by way of numpy: a step's
    metadata (a few thousand positions and slots, a block table per row) in a third to a
    seventh of torch.tensor()'s host time on the same lists (docs/BENCHMARKS.md)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype]))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` without a host sync. A copy from pageable memory to
    a CUDA device first waits for everything queued on the stream (CUDA's rule for pageable
    transfers): one made after a forward's kernels would hold the step's launch until the
    device has run them (the overlapped loop then streams nothing until then). From pinned
    memory the copy is queued like a kernel (torch keeps the pinned block until it is done)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def select_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use auto, cpu, cuda[:N] or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("device 'cuda' requested but no CUDA GPU is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device 'mps' requested but MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"unsupported device type {device.type!r}; use cpu, cuda or mps")
    return device


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA (float16 before Ampere), float16 on MPS, float32 on CPU."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"bfloat16 is not supported on {torch.cuda.get_device_name(device)}")
    try:  # a tiny matmul is the honest test of "this device can compute in this dtype"
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().cpu()
    except (RuntimeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DeviceError(f"dtype {name} is not supported on {device}: {first}") from None
    return dtype


# torch's preferred BLAS library for the CUDA matmuls (the projections): "default" leaves
# torch's choice alone; "auto" (the default) is cuBLASLt on CUDA and torch's choice elsewhere.
# On the H200 cuBLASLt made 8B decode 1.03-1.04x faster at batch 1 / 32 / 64 and the whole GPU
# test suite passed under it (docs/BENCHMARKS.md, session 21).
BLAS_LIBRARIES = ("auto", "default", "cublas", "cublaslt")


def blas_library(name: str, device: torch.device) -> str | None:
    """The library `--blas name` asks torch for on `device`; None: leave torch's choice."""
    if name not in BLAS_LIBRARIES:
        raise DeviceError(f"unknown BLAS library {name!r}; use {', '.join(BLAS_LIBRARIES)}")
    if name == "auto":
        name = "cublaslt" if device.type == "cuda" else "default"
    if name == "default":
        return None
    if device.type != "cuda":
        raise DeviceError(f"--blas {name} needs a CUDA device (the device is {device.type})")
    return name


def select_blas(name: str, device: torch.device) -> None:
    """Set torch's preferred BLAS library (a process-wide setting: one engine per process)."""
    library = blas_library(name, device)
    if library is not None:
        torch.backends.cuda.preferred_blas_library(library)
