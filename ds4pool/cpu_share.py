"""The model's CPU threads on a shared machine: a core goes back while others keep one busy.

`ds4pool serve --cpu-threads auto` runs one model thread per core where its start-up probe
found that faster (threads.choose_threads), measured on a machine that was idle then. Coding
agents run their tools (builds, tests) on the same box, and a team of one OpenMP thread per
core then waits, at every parallel region, for the member whose core it shares: on the 2-core
VM, next to one spinning process, a step with a 64-token prompt chunk took 404 ms with two
threads against 308 ms with one (docs/BENCHMARKS.md "a start-up thread probe").

ThreadGovernor, called by the worker before each step, reads every `interval_s` how much
CPU time the rest of the machine took since the last reading (all CPUs' busy time in
/proc/stat less this process's own) and runs the fewer count as soon as that is above
`busy_cores`, the more count again once it has stayed below `idle_cores` for `calm_s`: a
neighbour that works in bursts gets less CPU while the model runs one thread per core, and
so looks idle for a second (seen: a client writing its report flipped the count every
second with a one-reading rule). Where /proc/stat cannot be read (not Linux), it keeps the
count it started with.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def read_cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine since boot, this process's CPU seconds), or
    None where /proc/stat cannot be read. Busy is user + nice + system + irq + softirq +
    steal (time a hypervisor gave to other guests counts as taken by others)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    own = os.times()
    busy = user + nice + system + irq + softirq + steal
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


class ThreadGovernor:
    """Runs `more` threads while the rest of the machine leaves the cores free, `fewer` while
    it keeps more than `busy_cores` of a core busy (see the module's docstring)."""

    def __init__(
        self,
        fewer: int,
        more: int,
        set_threads: Callable[[int], object],
        read: Callable[[], tuple[float, float] | None] = read_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 1.0,
        busy_cores: float = 0.5,
        idle_cores: float = 0.25,
        calm_s: float = 5.0,
    ) -> None:
        assert fewer < more and idle_cores <= busy_cores
        self.fewer, self.more = fewer, more
        self._set, self._read, self._clock = set_threads, read, clock
        self.interval_s, self.busy_cores, self.idle_cores = interval_s, busy_cores, idle_cores
        self.calm_s = calm_s
        self._calm_since: float | None = None  # since when every reading was under idle_cores
        self.threads = more  # the count the engine set (the probe's choice)
        self.others: float | None = None  # cores the rest of the machine used, last reading
        self.switches = 0
        self._t = clock()
        self._last = read()

    def tick(self) -> int:
        """Before a step (on the thread that runs it): the thread count for it."""
        now = self._clock()
        if now - self._t < self.interval_s:
            return self.threads
        cur = self._read()
        last, elapsed = self._last, now - self._t
        self._last, self._t = cur, now
        if cur is None or last is None or elapsed <= 0:
            return self.threads
        self.others = max(0.0, (cur[0] - last[0]) - (cur[1] - last[1])) / elapsed
        want = self.threads
        if self.others < self.idle_cores:
            self._calm_since = now - elapsed if self._calm_since is None else self._calm_since
            if now - self._calm_since >= self.calm_s:
                want = self.more
        else:
            self._calm_since = None
            if self.others > self.busy_cores:
                want = self.fewer
        if want != self.threads:
            self._set(want)
            self.threads = want
            self.switches += 1
            log.info(
                "cpu threads: %d (the rest of the machine used %.2f cores over %.1f s)",
                want,
                self.others,
                elapsed,
            )
        return self.threads
