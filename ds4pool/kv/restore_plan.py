"""The pool's use of kv/cost.py: where a returning session's restore asks "read or
recompute?", applies the answer, and times the moves the rates are measured on.

    DISK session, on its bring-up (prefetch thread), before the read:
        read       → the snapshot's KV is read as before
        recompute  → only its tokens and text (Tiers.read_ahead(kv=False)): tier NONE
    RAM session, at restore() / restore_ahead, for [shared, num_computed) — the part the
    block index does not hold on the device:
        read       → the host copy is copied in (timed: the ram rate)
        recompute  → the host copy past `shared` is dropped

Either way the session keeps its tokens; the scheduler prefills what it lacks. One decision
per returning session: a copy read from disk for this restore was decided before the read.
Every method runs with the pool lock held by the caller, except `copy_in` (as Tiers.copy_in).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ds4pool.kv.blocks import BlockTable
from ds4pool.kv.config import PoolObserver
from ds4pool.kv.cost import Choice, RestoreCost
from ds4pool.kv.session import Session, Tier
from ds4pool.kv.tier_restore import RestoreMove
from ds4pool.kv.tiers import Tiers
from ds4pool.kv.transfer import DeviceKV, synchronize


class RestorePlanner:
    def __init__(
        self,
        cost: RestoreCost,
        tiers: Tiers,
        kv: DeviceKV,
        observer: PoolObserver,
        block_size: int,
        next_version: Callable[[], int],
    ) -> None:
        self.cost = cost
        self.tiers = tiers
        self.kv = kv
        self.observer = observer
        self.block_size = block_size
        self.bytes_per_token = kv.layout.bytes_per_token
        self._next_version = next_version

    def reads_disk(self, s: Session | None) -> bool:
        """Read a DISK session's KV on its bring-up (True), or only its tokens? All its
        tokens count as missing: which of them the block index holds is known only once
        its tokens are read."""
        if s is None or s.tier is not Tier.DISK or s.in_flight:
            return True
        d = self.cost.decide("disk", s.num_computed, s.num_computed * self.bytes_per_token)
        self.observer.restore_decided("disk", d.choice.value)
        return d.choice is Choice.READ

    def reads_ahead(self, s: Session) -> bool:
        """May restore_ahead copy this RAM session in? A recompute is left to restore()."""
        if s.disk_read_s is not None:
            return True  # read from disk for this restore: decided before the read
        n = s.num_computed
        if self.cost.decide("ram", n, n * self.bytes_per_token).choice is Choice.RECOMPUTE:
            return False  # the step thread's restore decides it (and counts it)
        self.observer.restore_decided("ram", Choice.READ.value)
        return True

    def plan_copy(self, s: Session, move: RestoreMove, shared: int) -> RestoreMove:
        """restore(): copy [shared, num_computed) from the host copy, or drop it (the
        returned move then copies nothing and counts no restore)."""
        if move.src is not Tier.RAM or move.came_from is Tier.DISK:
            return move
        n = s.num_computed - shared
        d = self.cost.decide("ram", n, n * self.bytes_per_token)
        self.observer.restore_decided("ram", d.choice.value)
        if d.choice is Choice.READ:
            return move
        s.num_computed = shared
        s.num_persisted = min(s.num_persisted, shared)
        del s.block_keys[shared // self.block_size :]
        s.version = self._next_version()
        return RestoreMove(Tier.NONE, Tier.NONE, move.started, move.cached)

    def copy_in(self, s: Session, move: RestoreMove, table: BlockTable, start: int) -> None:
        """Tiers.copy_in, timed: the ram rate, and the disk rate of a copy read from disk
        for this restore (its read time is s.disk_read_s)."""
        t0 = time.perf_counter()
        self.tiers.copy_in(s, move, table, start=start)
        if move.src is not Tier.RAM:
            return
        synchronize(self.kv)  # the copy is asynchronous on CUDA: time its end
        num_bytes = (s.num_computed - start) * self.bytes_per_token
        self.cost.observe_read("ram", num_bytes, time.perf_counter() - t0)
        if move.came_from is Tier.DISK and s.disk_read_s is not None and s.host_kv is not None:
            self.cost.observe_read("disk", s.host_kv.nbytes, s.disk_read_s)
