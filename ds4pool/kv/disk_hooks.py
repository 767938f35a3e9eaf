"""The disk tier's callbacks to its owner (the pool): every failure by kind, every snapshot
it deleted to stay within budget, and the bytes of each successful read and write. A hook
that raises is logged and ignored: it must never leave the tier half-updated."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ds4pool.kv.disk_files import DiskEntry
from ds4pool.kv.framing import SnapshotError

log = logging.getLogger(__name__)

# Every kind on_error() may receive: SnapshotError kinds (the file was quarantined), plus
# "write" (a write failed, the old snapshot is intact), "too_large" (a snapshot alone exceeds
# the budget and was dropped), "io" (a read hit an OSError; the file is kept, if it exists).
ERROR_KINDS = (*SnapshotError.KINDS, "write", "too_large", "io")


@dataclass(frozen=True)
class DiskHooks:
    on_error: Callable[[str], None] | None = None
    on_evict: Callable[[DiskEntry], None] | None = None
    on_io: Callable[[str, int], None] | None = None  # ("read" | "write", bytes) on success

    def error(self, kind: str) -> None:
        assert kind in ERROR_KINDS, kind
        _call(self.on_error, kind)

    def evicted(self, entry: DiskEntry) -> None:
        _call(self.on_evict, entry)

    def io(self, op: str, num_bytes: int) -> None:
        if self.on_io is not None:
            try:
                self.on_io(op, num_bytes)
            except Exception:
                log.exception("disk tier: io hook raised")


def _call(hook: Callable[[Any], None] | None, arg: object) -> None:
    if hook is not None:
        try:
            hook(arg)
        except Exception:  # a caller's hook must never leave the tier half-updated
            log.exception("disk tier: hook %r(%r) raised", hook, arg)
