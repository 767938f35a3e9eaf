"""The pool's introspection and admin API: what `/v1/sessions`, `/admin` and `/metrics` read
and do (list, show, evict, drop, pin, usage). Read-only views are `SessionInfo` /
`PoolUsage` values, never live sessions.

Every method takes the pool lock, briefly; none may be called with a session's request in
flight (evict and drop refuse with SessionBusyError). An evict to disk writes the snapshot
on the calling thread without the pool lock. The HTTP layer runs all of them in a worker
thread, off the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ds4pool.kv.config import PoolUsage
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.session import (
    Session,
    SessionBusyError,
    SessionInfo,
    SessionKey,
    SessionNotFoundError,
    Tier,
)
from ds4pool.kv.tiers import Tiers

COPY_WAIT_S = 30.0  # the longest an admin call waits for a snapshot's copy of a session


class SessionAdmin:
    def __init__(
        self,
        sessions: dict[SessionKey, Session],
        lock: threading.Condition,
        tiers: Tiers,
        blocks: BlockIndex,
        discard: Callable[[Session], None],
    ) -> None:
        self._sessions = sessions
        self._lock = lock
        self._tiers = tiers
        self._blocks = blocks
        self._discard = discard
        self.kv_bytes_per_token = tiers.kv.layout.bytes_per_token

    def list_sessions(
        self, tenant: str | None = None, tier: str | None = None
    ) -> list[SessionInfo]:
        """Sessions (not ephemeral ones), most recently used first."""
        with self._lock:
            infos = [
                s.info(self.kv_bytes_per_token)
                for s in self._sessions.values()
                if not s.ephemeral
                and (tenant is None or s.tenant == tenant)
                and (tier is None or s.tier.value == tier)
            ]
        return sorted(infos, key=lambda i: i.last_used, reverse=True)

    def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        with self._lock:
            s = self._sessions.get((tenant, session_id))
            return None if s is None or s.ephemeral else s.info(self.kv_bytes_per_token)

    def _idle(self, tenant: str, session_id: str) -> Session:
        s = self._sessions.get((tenant, session_id))
        # a copy of its KV for a snapshot (tiers.copy_out) holds it briefly: not a request
        self._lock.wait_for(lambda: not s or not s.copying, COPY_WAIT_S)
        if s is None or s.ephemeral or self._sessions.get(s.key) is not s:
            raise SessionNotFoundError(f"no session {session_id!r}")
        if s.in_flight:
            raise SessionBusyError(f"session {session_id!r} has a request in flight")
        return s

    def evict(self, tenant: str, session_id: str, to: str) -> SessionInfo:
        """Demote an idle session to 'ram' or 'disk' (pinned ones too: this is explicit)."""
        target = Tier(to)
        if target not in (Tier.RAM, Tier.DISK):
            raise ValueError(f"evict target must be 'ram' or 'disk', got {to!r}")
        if target is Tier.DISK and self._tiers.disk is None:
            raise ValueError("no disk tier is configured (--kv-disk-dir)")
        with self._lock:
            s = self._idle(tenant, session_id)
            version = s.version
        host = self._tiers.copy_out(s, version)  # device → host without the pool lock
        with self._lock:
            s = self._idle(tenant, session_id)
            current = host is not None and s.tier is Tier.DEVICE and s.version == version
            self._tiers.demote(s, target, "admin", host if current else None)
        if target is Tier.DISK:
            self._tiers.persist(s.key)  # the write of its spill, here, off the pool lock
        with self._lock:
            return s.info(self.kv_bytes_per_token)

    def drop(self, tenant: str, session_id: str) -> None:
        """Forget an idle session in every tier, its snapshot file included."""
        with self._lock:
            self._discard(self._idle(tenant, session_id))

    def set_pinned(self, tenant: str, session_id: str, pinned: bool) -> SessionInfo:
        """Pinned sessions are never demoted by memory pressure."""
        with self._lock:
            s = self._sessions.get((tenant, session_id))
            if s is None or s.ephemeral:
                raise SessionNotFoundError(f"no session {session_id!r}")
            s.pinned = pinned
            return s.info(self.kv_bytes_per_token)

    def usage(self) -> PoolUsage:
        ram, disk = self._tiers.ram, self._tiers.disk
        with self._lock:
            counts = {t: 0 for t in Tier}
            device_tokens = 0
            for s in self._sessions.values():
                counts[s.tier] += 1
                if s.tier is Tier.DEVICE:
                    device_tokens += s.num_computed
            index = self._blocks.usage()
            return PoolUsage(
                device_blocks_used=self._blocks.num_used,
                device_blocks_total=self._blocks.num_blocks,
                device_sessions=counts[Tier.DEVICE],
                device_bytes=device_tokens * self.kv_bytes_per_token,
                ram_sessions=counts[Tier.RAM],
                ram_bytes=ram.used_bytes,
                ram_budget_bytes=ram.budget_bytes,
                disk_sessions=counts[Tier.DISK],
                disk_bytes=disk.used_bytes if disk else 0,
                disk_budget_bytes=disk.budget_bytes if disk else 0,
                device_blocks_indexed=index.num_indexed,
                device_blocks_cached=index.num_cached,
                device_blocks_pinned=index.num_pinned,
            )
