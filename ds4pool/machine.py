"""What machine a benchmark ran on, for the header line of its table."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else whatever `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_topology(
    root: Path = Path("/sys/devices/system/cpu"), allowed: set[int] | None = None
) -> dict[str, int] | None:
    """Physical cores and logical CPUs this process may run on, from Linux's sysfs topology
    (None elsewhere): two logical CPUs may be two cores or one core's two hardware threads,
    which share its execution units, and a thread count that pays on one is a guess on the
    other. `allowed`: CPU numbers to count (default: the process's affinity, so a container
    pinned to some CPUs counts those, not the host's)."""
    if allowed is None and hasattr(os, "sched_getaffinity"):
        allowed = os.sched_getaffinity(0)
    cores: set[tuple[str, str]] = set()
    logical = 0
    for cpu in root.glob("cpu[0-9]*"):
        if allowed is not None and int(cpu.name[3:]) not in allowed:
            continue
        topo = cpu / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            continue
        cores.add((package, core))
        logical += 1
    if not logical:
        return None
    return {"cores": len(cores), "logical_cpus": logical}
