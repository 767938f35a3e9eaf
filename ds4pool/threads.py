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
from collections.abc import MutableMapping

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
