"""A dependency-free progress bar on stderr, for long loads and benchmarks."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws one stderr line at most every 0.1 s; silent when disabled."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._last = 0.0
        self._start = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            elapsed = now - self._start
            self.stream.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {elapsed:5.1f}s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
