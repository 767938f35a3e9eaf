"""One KV layer as stored in a file: its raw bytes (optionally byte-plane shuffled) as one lz4
frame, and back. Dtypes move as raw bytes, never converted, so a decoded layer is bitwise
equal to the encoded one."""

from __future__ import annotations

import math
import sys

import lz4.frame
import numpy as np
import torch

from ds4pool.kv.framing import Buffer, SnapshotError

COMPRESSION = "lz4-frame"
# Byte-plane shuffling shrinks real bf16 KV by ~25% (ratio ~1.37 vs ~1.05) but costs ~3x the
# encode and ~2x the decode CPU (bench/snapshot_lz4.py, docs/BENCHMARKS.md): it only saves
# time on disks slower than a few hundred MB/s. GPU boxes have NVMe, so plain is the default.
DEFAULT_SHUFFLE = False


if sys.byteorder != "little":  # KV bytes are stored in native order, which must be little
    raise ImportError("ds4pool snapshots need a little-endian host")


# Byte-plane shuffling uses numpy: single-threaded (it runs on the pool's writer thread and
# must not fight the model for torch's intra-op threads) and ~2.5-3 GB/s per core both ways,
# where a torch uint8 transpose copy runs at ~0.2 GB/s.


def _shuffle(t: torch.Tensor) -> np.ndarray:
    """[N] elements of k bytes -> [k, N] uint8: plane j holds byte j of every element."""
    k = t.element_size()
    elems = t.contiguous().view(torch.uint8).numpy().reshape(-1, k)  # [N, k], no copy
    return np.ascontiguousarray(elems.T)  # [k, N]


def _unshuffle(planes: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Inverse of _shuffle: write [k * N] uint8 planes into `out` (contiguous, N elements)."""
    k = out.element_size()
    elems = out.view(torch.uint8).numpy().reshape(-1, k)  # [N, k], shares out's memory
    for j, plane in enumerate(planes.reshape(k, -1)):
        elems[:, j] = plane  # one strided pass per plane beats one transpose of [k, N]
    return out


def layer_frame(t: torch.Tensor, shuffle: bool) -> bytes:
    """Raw bytes of one layer (optionally byte-plane shuffled), as one lz4 frame."""
    if shuffle and t.element_size() > 1 and t.numel():
        data = _shuffle(t)
    else:
        data = t.contiguous().view(torch.uint8).numpy()  # memory order, little-endian
    return lz4.frame.compress(data, compression_level=0, store_size=True)


def decode_frame(
    frame: Buffer, shape: tuple[int, ...], dtype: torch.dtype, shuffle: bool, what: str
) -> torch.Tensor:
    """One lz4 frame (its CRC already checked) back into a tensor of `shape`."""
    k = dtype.itemsize
    expected = k * math.prod(shape)
    try:
        raw = lz4.frame.decompress(frame, return_bytearray=True)
    except RuntimeError as e:  # only reachable if the encoder wrote a bad frame: CRC passed
        raise SnapshotError("format", f"{what}: lz4: {e}") from e
    if len(raw) != expected:
        raise SnapshotError("format", f"{what}: {len(raw)} bytes, expected {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if shuffle and k > 1:
        return _unshuffle(np.frombuffer(raw, dtype=np.uint8), torch.empty(shape, dtype=dtype))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)  # no copy
