"""The waiting queue: integer priorities, weighted fair share between tenants, aging.

Pick order — the smallest key wins:

    (aged class, tenant virtual time, arrival)
    aged class = max(floor(priority - waited / aging_s), p_min)

where p_min is the best priority among the waiting requests.

- Priority: lower runs first (vLLM's convention).
- Aging: every `aging_s` seconds of waiting lowers a request's class by one, down to the
  best class present (the clamp keeps aging from overriding fair share among equals).
  Bound: a request of priority p reaches the top class after at most
  (p - p_min) * aging_s of waiting; from then on it competes like a top-priority request
  of its tenant (fair share between tenants, FIFO within one), so it is delayed, never
  starved.
- Fair share: each tenant has a virtual time, advanced by `charge()` with the tokens the
  worker computed for it divided by its weight (token-weighted fair queuing). Within a
  class, the tenant that has received the least weighted service goes first. A tenant that
  becomes backlogged starts at the smallest virtual time of the backlogged tenants, so idle
  time is not banked as credit.
- FIFO within a tenant (and so within a session) by arrival.

Admission: a total and a per-tenant limit on waiting requests; beyond them `push` raises
QueueFullError with a retry hint, never queues without bound.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ds4pool.sched.request import QueueFullError


class Queued(Protocol):
    tenant: str
    priority: int
    arrival: float


@dataclass(frozen=True)
class QueueConfig:
    max_waiting: int = 1024
    max_waiting_per_tenant: int = 256
    aging_s: float = 10.0
    retry_after_s: float = 1.0
    weights: dict[str, float] = field(default_factory=dict)  # tenant → weight (default 1)


class FairQueue:
    def __init__(self, cfg: QueueConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._items: list[Queued] = []
        self._per_tenant: Counter[str] = Counter()
        self._vtime: dict[str, float] = {}
        # tenants served since the last pick round: running, so not idle even when none
        # of their requests is waiting
        self._recently_served: set[str] = set()

    def __len__(self) -> int:
        return len(self._items)

    def num_waiting(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def weight(self, tenant: str) -> float:
        return self.cfg.weights.get(tenant, 1.0)

    def push(self, item: Queued, *, force: bool = False) -> None:
        """Queue an item; QueueFullError beyond the limits (unless force, for requeues)."""
        if not force:
            if len(self._items) >= self.cfg.max_waiting:
                raise QueueFullError(
                    f"server queue is full ({self.cfg.max_waiting} waiting requests)",
                    self.cfg.retry_after_s,
                    "queue_full",
                )
            if self._per_tenant[item.tenant] >= self.cfg.max_waiting_per_tenant:
                raise QueueFullError(
                    f"too many waiting requests for this tenant "
                    f"({self.cfg.max_waiting_per_tenant})",
                    self.cfg.retry_after_s,
                    "tenant_queue_full",
                )
        if self._per_tenant[item.tenant] == 0 and item.tenant not in self._recently_served:
            # an idle tenant comes back: start at the backlogged tenants' virtual time
            active = [self._vtime[t] for t in self._per_tenant if self._per_tenant[t]]
            active += [self._vtime[t] for t in self._recently_served]
            floor = min(active, default=0.0)
            self._vtime[item.tenant] = max(self._vtime.get(item.tenant, 0.0), floor)
        self._items.append(item)
        self._per_tenant[item.tenant] += 1

    def remove(self, item: Queued) -> None:
        self._items.remove(item)
        self._per_tenant[item.tenant] -= 1

    def charge(self, tenant: str, tokens: int) -> None:
        """Record service: `tokens` computed for `tenant`."""
        self._vtime[tenant] = self._vtime.get(tenant, 0.0) + tokens / self.weight(tenant)
        self._recently_served.add(tenant)

    def charge_rows(self, rows: list[tuple[str, int]]) -> None:
        """`charge` for each (tenant, tokens) in order: the same additions, one call."""
        vtime, weights = self._vtime, self.cfg.weights
        for tenant, tokens in rows:
            vtime[tenant] = vtime.get(tenant, 0.0) + tokens / weights.get(tenant, 1.0)
        self._recently_served.update(tenant for tenant, _ in rows)

    def _key(self, item: Queued, now: float, best: int) -> tuple[float, float, float]:
        waited = max(0.0, now - item.arrival)
        aged = max(math.floor(item.priority - waited / self.cfg.aging_s), best)
        return (aged, self._vtime.get(item.tenant, 0.0), item.arrival)

    def ordered(self) -> Iterator[Queued]:
        """Waiting items in pick order (the caller may skip some, e.g. busy sessions)."""
        self._recently_served.clear()
        if not self._items:
            return
        now = self.clock()
        best = min(item.priority for item in self._items)
        yield from sorted(self._items, key=lambda item: self._key(item, now, best))

    def depth_by_priority(self) -> dict[int, int]:
        return dict(Counter(item.priority for item in self._items))

    def expired(self, now: float, max_wait_s: float) -> list[Queued]:
        return [item for item in self._items if now - item.arrival > max_wait_s]
