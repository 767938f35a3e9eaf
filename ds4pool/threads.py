"""OpenMP settings the command line applies before torch loads, and the model's thread count
(`ds4pool serve --cpu-threads`, with its start-up probe).

torch's CPU kernels run on OpenMP threads that, by default, spin between parallel regions
waiting for the next one. On a box whose cores are shared (the agents that ds4pool serves,
their tools, other servers), a spinning thread burns the time slice that the thread it
waits for needs: measured on a loaded 2-core VM (bench/prefill_cap.py, docs/BENCHMARKS.md),
a batch-16 decode step took 3.3x longer and 3.4x more CPU time with spinning than with
OMP_WAIT_POLICY=PASSIVE. A value the user exported wins (ACTIVE for a dedicated box).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class CpuThreads:
    """The model's intra-op threads as `ds4pool serve` asks for them: `count` (None: torch's
    own), and `up_to` (None, or more than count): at start-up, time a scratch step with each
    and keep the faster (ThreadProbe)."""

    count: int | None
    up_to: int | None = None


def server_cpu_threads(setting: str, torch_default: int, environ: Mapping[str, str]) -> CpuThreads:
    """Intra-op threads for torch's CPU kernels in `ds4pool serve`.

    `auto` leaves one core to the server's other threads (the HTTP event loop streaming every
    token, tokenization, persistence) unless the start-up probe finds one thread per core
    faster by PROBE_FASTER (choose_threads): with one OpenMP thread per core they can preempt
    a team member in the middle of a parallel region and the whole team waits, and on some
    VMs waking a sleeping thread costs more than it brings (session 28's Xeon: one thread gave
    a lower ITL and more tokens per second than two); on others the second thread makes every
    step ~1.5x faster and the server's ITL 1.2x lower (docs/BENCHMARKS.md "a start-up thread
    probe"). Where the probe keeps one per core, cpu_share.ThreadGovernor gives one back
    while other processes keep a core busy. An exported OMP_NUM_THREADS wins over `auto`; a
    number wins over both. Bad values raise ValueError (one line)."""
    if setting == "auto":
        if environ.get("OMP_NUM_THREADS"):
            return CpuThreads(None)
        fewer = max(1, torch_default - 1)
        return CpuThreads(fewer, torch_default if torch_default > fewer else None)
    if not setting.isdecimal() or int(setting) < 1:
        raise ValueError(f"cpu_threads must be 'auto' or a number >= 1, not {setting!r}")
    return CpuThreads(int(setting))


# more threads are kept when their step takes at most this share of the fewer's time
PROBE_FASTER = 0.85


@dataclass(frozen=True)
class ThreadProbe:
    """What the start-up probe measured: the median seconds of one scratch step with each
    thread count, and the count kept."""

    fewer: int
    more: int
    fewer_s: float
    more_s: float
    chosen: int

    def describe(self) -> str:
        return (
            f"{self.chosen} of {self.fewer}-{self.more} by a start-up probe: a step "
            f"{self.fewer_s * 1e3:.0f} ms with {self.fewer}, {self.more_s * 1e3:.0f} ms with "
            f"{self.more}"
        )


def choose_threads(
    step: Callable[[], object],
    fewer: int,
    more: int,
    set_threads: Callable[[int], object],
    clock: Callable[[], float] = time.perf_counter,
    rounds: int = 3,
    max_s: float = 3.0,
) -> ThreadProbe:
    """Times `step` with `fewer` and with `more` threads, alternating (a busy moment slows
    both alike), after one untimed step of each (oneDNN primitives, the thread team); keeps
    `more` where its median is at most PROBE_FASTER x the fewer's. Stops after `rounds`, or
    once `max_s` have passed and each count has a timed step (a large model on few cores).
    Leaves `set_threads` at the count it keeps."""
    times: dict[int, list[float]] = {fewer: [], more: []}
    start = clock()
    for n in (fewer, more):
        set_threads(n)
        step()
    for _ in range(rounds):
        for n in (fewer, more):
            set_threads(n)
            t0 = clock()
            step()
            times[n].append(clock() - t0)
        if clock() - start > max_s:
            break
    fewer_s, more_s = statistics.median(times[fewer]), statistics.median(times[more])
    chosen = more if more_s <= PROBE_FASTER * fewer_s else fewer
    set_threads(chosen)
    return ThreadProbe(fewer, more, fewer_s, more_s, chosen)
