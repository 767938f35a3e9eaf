"""SessionPool: (tenant, session id) → Session, with KV across device, RAM and disk tiers.

The facade the scheduler and the API call: the registry of sessions, which hands out
leases. Its roles live in their own modules:

    pool.py    the registry, leases handed out (acquire), the choice of which session moves
               (pressure, serialized mode), read-ahead restores, integrity
    lease.py   one request's hold on its session: prepare (prefix matching), restore,
               reserve (block growth), block ids, commit / rollback, release
    sharing.py which blocks a session shares through the block index (index.py)
    tiers.py   the moves themselves (demote, to disk, load, restore copies) and snapshots
    persist.py the writer thread and the ordering of snapshot writes
    admin.py   list / show / evict / drop / pin / usage for the API and metrics

- Device blocks are needed → the least recently used idle, unpinned device session is
  demoted to RAM (in-flight sessions never are).
The KV tensors and their layout come in as a `DeviceKV` (kv/ never imports the model).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.admin import SessionAdmin
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.kv.blockstore import index_secret
from ds4pool.kv.config import PoolConfig, PoolObserver, PoolUsage
from ds4pool.kv.cost import RestoreCost, RestorePolicy
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.lease import SessionLease
from ds4pool.kv.lease_parts import PoolParts, drop_kv
from ds4pool.kv.prefetch import Prefetcher
from ds4pool.kv.prefix import plan_text
from ds4pool.kv.restore_plan import RestorePlanner
from ds4pool.kv.session import (
    Session,
    SessionBusyError,
    SessionInfo,
    SessionKey,
    Tier,
    validate_session_id,
)
from ds4pool.kv.sharing import PrefixInfo, PrefixSharing
from ds4pool.kv.store_lease import ClaimResult
from ds4pool.kv.tiers import Tiers
from ds4pool.kv.transfer import DeviceKV

__all__ = ["DeviceKV", "PoolConfig", "PoolObserver", "PoolUsage", "SessionLease", "SessionPool"]


class SessionPool:
    def __init__(
        self,
        cfg: PoolConfig,
        kv: DeviceKV,
        fingerprint: ModelFingerprint,
        observer: PoolObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv_caches = kv.caches
        self.fingerprint = fingerprint
        self.observer = observer or PoolObserver()
        # block tables allocate through the index: it keeps full blocks nobody holds cached
        # (kv/index.py) and evicts them when the device needs room. With a disk tier its salt
        # secret lives there: block files are named by chain key, stable across restarts.
        self.blocks = BlockIndex(
            BlockPool(cfg.num_device_blocks),
            cfg.block_size,
            secret=index_secret(cfg.disk_dir) if cfg.disk_dir is not None else None,
            on_evict=self.observer.blocks_evicted,
        )
        self.sharing = PrefixSharing(self.blocks, kv, cfg.block_size, self.observer)
        self.kv_bytes_per_token = kv.layout.bytes_per_token
        # read a returning session's KV back or recompute it (kv/cost.py); the worker feeds
        # it the steps' prefill rate, the planner's restores the tiers' read rates
        self.cost = RestoreCost(RestorePolicy(cfg.restore_policy))
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sessions: dict[SessionKey, Session] = {}
        self._versions = itertools.count(1)
        self.prefetcher = Prefetcher(self._bring_up)  # and the reaper of host tensors
        self.tiers = Tiers(
            cfg,
            kv,
            self.blocks,
            fingerprint,
            self.observer,
            self._sessions,
            self._cond,
            lambda: next(self._versions),
            self.prefetcher.reap,
        )
        self.admin = SessionAdmin(
            self._sessions, self._cond, self.tiers, self.blocks, self._discard
        )
        self.planner = RestorePlanner(
            self.cost, self.tiers, kv, self.observer, cfg.block_size, lambda: next(self._versions)
        )
        self._parts = PoolParts(
            cfg,
            self._cond,
            self.blocks,
            self.sharing,
            self.tiers,
            self.planner,
            lambda: next(self._versions),
            self._make_room,
            self._discard,
        )
        # the tiers' parts, as callers and tests know them
        self.ram, self.disk, self.writer = self.tiers.ram, self.tiers.disk, self.tiers.writer

    # ------------------------------------------------------------ leases

    def acquire(
        self, tenant: str, session_id: str | None, timeout: float | None = None
    ) -> SessionLease:
        """Lease a session for one request (created if new; None → an ephemeral one).
        Waits while another request holds it; SessionBusyError after `timeout`."""
        if session_id is None:
            s = Session(tenant, f"~{uuid.uuid4().hex}", ephemeral=True, in_flight=True)
            with self._lock:
                self._sessions[s.key] = s
            return SessionLease(self._parts, s)
        validate_session_id(session_id)
        key = (tenant, session_id)
        wait = self.cfg.acquire_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                s = self._sessions.get(key)
                if s is None:
                    s = self._sessions[key] = Session(tenant, session_id)
                if not s.in_flight:
                    s.in_flight = True
                    return SessionLease(self._parts, s)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionBusyError(
                        f"session {session_id!r} is busy with another request (waited {wait:.0f}s)"
                    )
                self._cond.wait(left)

    def text_resume(self, tenant: str, session_id: str | None, prompt_text: str) -> int | None:
        """Where a prompt given as text would start its new tokens if its request were
        prepared now (the text before stands for tokens the session keeps, kv/prefix.py);
        None while that is unknown: a session on disk not read yet, or one in flight (its
        tokens may change first). Compares text only: the caller tokenizes, off this lock."""
        if session_id is None:
            return 0
        with self._lock:
            s = self._sessions.get((tenant, session_id))
            if s is None:
                return 0
            if s.in_flight or not s.loaded or s.tier is Tier.DISK:
                return None
            return plan_text(s.text_marks, s.token_ids, s.text, prompt_text).from_char

    def prefetch(self, tenant: str, session_id: str | None) -> bool:
        """Start bringing an idle disk or RAM session up ahead of its request, on the
        prefetch thread (kv/prefetch.py); True if one is queued or running now. Admit the
        request once `prefetching` is False: its restore then has nothing (or only the host
        → device copy) left."""
        if session_id is None:
            return False
        key = (tenant, session_id)
        with self._lock:
            s = self._sessions.get(key)
            if s is not None and s.tier in (Tier.DISK, Tier.RAM) and not s.in_flight:
                self.prefetcher.request(key)
        return self.prefetcher.pending(key)

    def prefetching(self, tenant: str, session_id: str | None) -> bool:
        """True while a bring-up of the session is queued or running."""
        return session_id is not None and self.prefetcher.pending((tenant, session_id))

    def _bring_up(self, key: SessionKey) -> None:
        with self._lock:
            read_kv = self.planner.reads_disk(self._sessions.get(key))  # or recompute it
        self.tiers.read_ahead(key, kv=read_kv)
        self.restore_ahead(key)

    def open_from_store(self, tenant: str, session_id: str | None) -> ClaimResult | None:
        """Shared store only (--replica-id), before a request of the session is submitted:
        claim its store lease, and bring what the store holds into view: on a miss, the
        snapshot another replica wrote; when the lease moved here from another replica,
        that replica's newer snapshot instead of our idle local copy. Disk and lease I/O:
        call from a worker thread, never with the pool lock or on the event loop."""
        store = self.tiers.store
        if store is None or session_id is None:
            return None
        key = (tenant, session_id)
        result = store.claim(key)
        with self._lock:
            s = self._sessions.get(key)
            if s is not None and result is not None and result.moved_here and not s.in_flight:
                drop_kv(self._parts, s)  # stale: the replica that held the lease may have written
                self.tiers.forget_local(s)
                del self._sessions[key]
                s = None
        if s is None:
            self.tiers.adopt(key)
        return result

    def restore_ahead(self, key: SessionKey) -> None:
        """Put an idle RAM session's KV on the device now, on the calling (prefetch) thread,
        if free blocks allow it without demoting anyone; its request's restore() then finds
        it there. The copy runs without the pool lock, the session leased meanwhile."""
        with self._cond:
            s = self._sessions.get(key)
            if s is None or s.in_flight or s.tier is not Tier.RAM or s.host_kv is None:
                return
            table = BlockTable(self.cfg.block_size)
            if table.blocks_needed(s.num_computed) > self.blocks.num_free:
                return  # no room without demotions: the step thread's restore decides
            if not self.planner.reads_ahead(s):
                return  # to be recomputed: the step thread's restore decides it
            move = self.tiers.begin_restore(s)
            shared = self.sharing.share_for_restore(s, table)  # only the rest is copied
            table.ensure(self.blocks, s.num_computed)
            s.block_table = table  # held by the session while copying (check_integrity)
            s.in_flight = s.copying = True
        try:
            self.planner.copy_in(s, move, table, shared)
        except BaseException:
            with self._cond:
                table.release(self.blocks)
                s.block_table = None
                self.tiers.abort_restore(s, move)
                s.in_flight = s.copying = False
                self._cond.notify_all()
            raise
        with self._cond:
            self.tiers.finish_restore(s, move, table, start=shared, copied=True)
            self.sharing.restored_into(s, table)
            s.in_flight = s.copying = False
            self._cond.notify_all()

    def num_free_blocks(self) -> int:
        """Free and cached (evictable) device blocks: an allocation gets them demoting nobody."""
        with self._lock:
            return self.blocks.num_free

    def num_idle_blocks(self) -> int:
        """Blocks that only idle unpinned device sessions hold: an allocation gets them by
        demoting those (a walk of their block tables; `num_free_blocks` first)."""
        with self._lock:
            n = 0
            for s in self._sessions.values():
                if s.tier is Tier.DEVICE and not s.in_flight and not s.pinned:
                    assert s.block_table is not None
                    n += sum(1 for b in s.block_table.blocks if self.blocks.holders(b) == 1)
            return n

    @property
    def num_device_blocks(self) -> int:
        return self.blocks.num_blocks

    # ------------------------------------------------------------ tier moves

    def demote_all_but(self, keep: SessionLease, reason: str) -> None:
        """Demote every idle device session except `keep`'s to RAM (serialized mode)."""
        with self._lock:
            for s in list(self._sessions.values()):
                if s.key != keep.key and s.tier is Tier.DEVICE and not s.in_flight:
                    self.tiers.demote(s, Tier.RAM, reason)

    def _make_room(self, num_blocks: int, exclude: Session) -> None:
        """Demote LRU idle unpinned device sessions until num_blocks are free."""
        if self.blocks.num_free >= num_blocks:
            return
        victims = sorted(
            (
                s
                for s in self._sessions.values()
                if s.tier is Tier.DEVICE and not s.in_flight and not s.pinned and s is not exclude
            ),
            key=lambda s: s.last_used,
        )
        for victim in victims:
            if self.blocks.num_free >= num_blocks:
                return
            self.tiers.demote(victim, Tier.RAM, "pressure")
        if self.blocks.num_free < num_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {self.blocks.num_free} free and every other "
                "device session is in flight or pinned"
            )

    def _discard(self, s: Session) -> None:
        drop_kv(self._parts, s)
        self.tiers.forget(s)
        self._sessions.pop(s.key, None)

    # ------------------------------------------------------------ persistence

    def persist(self, key: SessionKey) -> bool:
        return self.tiers.persist(key)

    def idle_dirty_keys(self, idle_s: float) -> list[SessionKey]:
        return self.tiers.idle_dirty_keys(idle_s)

    def flush(self) -> int:
        return self.tiers.flush()

    def close(self) -> None:
        """Stop bringing sessions up, flush to disk, stop the writer (clean shutdown)."""
        self.prefetcher.stop()
        self.tiers.close()

    # ------------------------------------------------------------ introspection / admin

    def list_sessions(
        self, tenant: str | None = None, tier: str | None = None
    ) -> list[SessionInfo]:
        return self.admin.list_sessions(tenant, tier)

    def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        return self.admin.get(tenant, session_id)

    def evict(self, tenant: str, session_id: str, to: str) -> SessionInfo:
        return self.admin.evict(tenant, session_id, to)

    def drop(self, tenant: str, session_id: str) -> None:
        self.admin.drop(tenant, session_id)

    def set_pinned(self, tenant: str, session_id: str, pinned: bool) -> SessionInfo:
        return self.admin.set_pinned(tenant, session_id, pinned)

    def usage(self) -> PoolUsage:
        return self.admin.usage()

    def pin_prefix(self, tenant: str, token_ids: Sequence[int]) -> PrefixInfo:
        """Pin a prefix's blocks (kv/sharing.py); the engine computes it if it is not there."""
        with self._lock:
            return self.sharing.pin(tenant, token_ids)

    def unpin_prefix(self, prefix_id: str) -> PrefixInfo:
        with self._lock:
            return self.sharing.unpin(prefix_id)

    def prefix(self, prefix_id: str) -> PrefixInfo:
        with self._lock:
            return self.sharing.info(prefix_id)

    def drop_cached_blocks(self) -> int:
        """Evict every cached block (indexed, held by no session); returns how many."""
        with self._lock:
            return self.blocks.evict_all()

    def pinned_prefixes(self) -> list[PrefixInfo]:
        with self._lock:
            return self.sharing.pins()

    def check_integrity(self) -> None:
        """Raise AssertionError if tiers, blocks, the block index and budgets disagree."""
        with self._lock:
            holders: Counter[int] = Counter()
            for s in self._sessions.values():
                assert s.num_computed <= max(len(s.token_ids), s.num_computed)
                if s.tier is Tier.DEVICE:
                    assert s.block_table is not None and s.host_kv is None
                    assert s.block_table.capacity >= s.num_computed
                    holders.update(s.block_table.blocks)
                    self.sharing.check(s)
                elif s.copying and s.block_table is not None:  # restore_ahead under way
                    assert s.tier is Tier.RAM and s.in_flight
                    holders.update(s.block_table.blocks)
                else:
                    assert s.block_table is None, s.key
                if s.tier is Tier.RAM:
                    assert s.host_kv is not None and s.host_kv.shape[2] == s.num_computed
                if s.loaded:
                    assert s.num_computed <= len(s.token_ids), s.key
            self.blocks.check_integrity(dict(holders))  # refcounts == holders (+ the index)
            for key in self.tiers.ram.lru_keys():
                assert self._sessions[key].tier is Tier.RAM, key
            assert self.tiers.ram.used_bytes <= max(self.tiers.ram.budget_bytes, 1)
            if self.tiers.disk:
                assert self.tiers.disk.used_bytes <= self.tiers.disk.budget_bytes
                self.tiers.disk.check_integrity()  # block files' reference counts
