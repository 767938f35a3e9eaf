"""OpenMP settings the command line applies before torch loads.

torch's CPU kernels run on OpenMP threads that, by default, spin between parallel regions
waiting for the next one. On a box whose cores are shared (the agents that ds4pool serves,
their tools, other servers), a spinning thread burns the time slice that the thread it
waits for needs: measured on a loaded 2-core VM (bench/prefill_cap.py, docs/BENCHMARKS.md),
a batch-16 decode step took 3.3x longer and 3.4x more CPU time with spinning than with
OMP_WAIT_POLICY=PASSIVE. A value the user exported wins (ACTIVE for a dedicated box).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping

THREAD_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_thread_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Sets each default the environment does not already hold; returns those it set.

    OpenMP reads its environment once, when the library loads with torch: after
    `import torch` this changes nothing in this process (only in its children), so it
    does nothing then."""
    if "torch" in sys.modules:
        return {}
    applied = {k: v for k, v in THREAD_ENV_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    return applied


def server_cpu_threads(setting: str, torch_default: int, environ: Mapping[str, str]) -> int | None:
    """Intra-op threads for torch's CPU kernels in `ds4pool serve` (None: leave torch's own).

    `auto` leaves one core to the server's other threads (the HTTP event loop streaming every
    token, tokenization, persistence): with one OpenMP thread per core they preempt a team
    member in the middle of a parallel region and the whole team waits. On the 2-core VM, 16
    agents (docs/BENCHMARKS.md "one core left to the server"): one thread gave a lower ITL
    and more tokens per second than two, for less CPU time. An exported OMP_NUM_THREADS
    wins over `auto`; a number wins over both. Bad values raise ValueError (one line)."""
    if setting == "auto":
        if environ.get("OMP_NUM_THREADS"):
            return None
        return max(1, torch_default - 1)
    if not setting.isdecimal() or int(setting) < 1:
        raise ValueError(f"cpu_threads must be 'auto' or a number >= 1, not {setting!r}")
    return int(setting)
