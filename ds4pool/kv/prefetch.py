"""Read-ahead of snapshots: one thread reads the disk sessions of queued requests.

A request whose session lives on disk would otherwise read its snapshot (file read,
checksum, decode: ~0.5 s for 200 MB) on the step thread at admission, stalling every
decoding session. `Tiers.prefetch` queues the key here when the request is submitted;
the scheduler leaves the request queued while `pending(key)` holds, and admits it once the
KV sits in the RAM tier, so the step thread only copies host → device.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ds4pool.kv.session import SessionKey

log = logging.getLogger(__name__)


class Prefetcher:
    """Also the pool's reaper: host tensors the tiers let go of (`reap`) are freed on this
    thread, not under the pool lock nor on the step thread (unmapping 200 MB takes ~0.1 s
    on a busy VM)."""

    def __init__(self, read: Callable[[SessionKey], None]) -> None:
        self._read = read
        self._cond = threading.Condition()
        self._queue: deque[SessionKey] = deque()
        self._trash: list[object] = []
        self._pending: set[SessionKey] = set()  # queued or being read
        self._stopping = False
        self._thread: threading.Thread | None = None  # started by the first request

    def request(self, key: SessionKey) -> None:
        with self._cond:
            if key in self._pending or self._stopping:
                return
            self._start()
            self._pending.add(key)
            self._queue.append(key)
            self._cond.notify_all()

    def reap(self, obj: object) -> None:
        """Drop the last reference to `obj` on this thread (after a stop: here and now)."""
        with self._cond:
            if self._stopping:
                return  # `obj` dies with the caller's reference
            self._start()
            self._trash.append(obj)
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds4pool-prefetch", daemon=True)
            self._thread.start()

    def pending(self, key: SessionKey) -> bool:
        with self._cond:
            return key in self._pending

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every requested read is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._trash or self._stopping)
                trash, self._trash = self._trash, []
                if self._stopping:
                    self._pending.clear()
                    self._cond.notify_all()
                    return
                key = self._queue.popleft() if self._queue else None
            del trash  # freed here, outside every lock
            if key is None:
                continue
            try:
                self._read(key)
            except Exception:  # never let the reader die: the request reads it itself
                log.exception("prefetch: reading a snapshot ahead failed")
            finally:
                with self._cond:
                    self._pending.discard(key)
                    self._cond.notify_all()
