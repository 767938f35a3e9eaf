"""The glibc malloc setting the command line applies at start: large buffers always mapped.

glibc serves a request above its mmap threshold (128 KiB at start) with a fresh mapping that
`free` hands back to the kernel, but the first time such a chunk is freed it raises the
threshold to that chunk's size (up to 32 MiB), so from then on buffers of that size come from
the heap arenas and stay resident after `free` whenever anything younger sits above them. A
server whose sessions move between tiers allocates exactly those: a session's KV gathered to
the host, its lz4 frames, the tensors rebuilt on restore, one to a few MB each, on the
worker and the persistence threads. Measured on `tests/reliability/test_load.py` (48
sessions through 8 MB device and RAM budgets, 2-core VM): the server's RSS grew 70-119 MiB
over its baseline run to run with glibc's default, 44-68 MiB with the threshold fixed at
1 MiB. Fixing it also stops the raising. A MALLOC_MMAP_THRESHOLD_ the user exported wins
(glibc read it at start).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

MMAP_THRESHOLD = 1 << 20  # bytes: a request at least this large gets its own mapping
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold(environ: Mapping[str, str]) -> bool:
    """mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) where the C library is glibc and the user has
    not chosen one; True when it took effect."""
    if "MALLOC_MMAP_THRESHOLD_" in environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
