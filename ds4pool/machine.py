"""What machine a benchmark ran on, for the header line of its table."""

from __future__ import annotations

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
