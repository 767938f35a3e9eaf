"""Fair share, priorities and aging of the waiting queue, on a fake clock and step counter."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from ds4pool.sched.queue import FairQueue, QueueConfig
from ds4pool.sched.request import QueueFullError


@dataclass(eq=False)
class Item:
    tenant: str
    priority: int
    arrival: float
    tokens_left: int = 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_slots(queue: FairQueue, clock: Clock, slots: int, steps: int, refill) -> Counter[str]:
    """Each step: admit into free slots in queue order, give every running item one token
    (charged to its tenant), retire finished ones; `refill` may queue more work."""
    running: list[Item] = []
    served: Counter[str] = Counter()
    for _ in range(steps):
        refill(queue, clock.now)
        for item in list(queue.ordered()):
            if len(running) >= slots:
                break
            queue.remove(item)
            running.append(item)
        for item in running:
            item.tokens_left -= 1
            served[item.tenant] += 1
            queue.charge(item.tenant, 1)
        running = [i for i in running if i.tokens_left > 0]
        clock.now += 1.0
    return served


def test_equal_weights_share_tokens_evenly_despite_10_to_1_requests() -> None:
    clock = Clock()
    q = FairQueue(QueueConfig(max_waiting=10_000, max_waiting_per_tenant=10_000), clock)

    rng = random.Random(0)

    def refill(queue: FairQueue, now: float) -> None:
        # tenant a keeps 10x as many requests waiting as tenant b; both stay backlogged
        for tenant, depth in (("a", 40), ("b", 4)):
            while queue.num_waiting(tenant) < depth:
                queue.push(Item(tenant, 0, now, tokens_left=rng.randint(10, 30)))

    served = run_slots(q, clock, slots=4, steps=2000, refill=refill)
    share = served["a"] / (served["a"] + served["b"])
    assert abs(share - 0.5) < 0.05, served


def test_weights_skew_the_share() -> None:
    clock = Clock()
    q = FairQueue(
        QueueConfig(max_waiting=10_000, max_waiting_per_tenant=10_000, weights={"gold": 3.0}), clock
    )

    def refill(queue: FairQueue, now: float) -> None:
        for tenant in ("gold", "free"):
            if queue.num_waiting(tenant) < 3:
                queue.push(Item(tenant, 0, now))

    served = run_slots(q, clock, slots=4, steps=2000, refill=refill)
    assert abs(served["gold"] / (served["gold"] + served["free"]) - 0.75) < 0.05, served


def test_priority_runs_first_but_low_priority_is_not_starved() -> None:
    aging = 2.0
    clock = Clock()
    q = FairQueue(
        QueueConfig(max_waiting=10_000, max_waiting_per_tenant=10_000, aging_s=aging), clock
    )
    low = Item("t", 5, 0.0, tokens_left=1)
    q.push(low)
    admitted_at: dict[int, float] = {}

    def refill(queue: FairQueue, now: float) -> None:
        for _ in range(3):  # a flood of priority-0 work, more than the slot can take
            queue.push(Item("t", 0, now, tokens_left=1))
        if queue.num_waiting("t") and low not in queue._items and id(low) not in admitted_at:
            admitted_at[id(low)] = now

    run_slots(q, clock, slots=1, steps=40, refill=refill)
    bound = (low.priority - 0) * aging  # documented in ds4pool/sched/queue.py
    assert id(low) in admitted_at, "priority-5 work starved"
    # in the top class after `bound` seconds, then FIFO within its tenant: the next pick
    assert admitted_at[id(low)] <= bound + 1
    assert admitted_at[id(low)] >= (low.priority - 1) * aging  # but it was delayed


def test_new_tenant_gets_no_banked_credit() -> None:
    clock = Clock()
    q = FairQueue(QueueConfig(), clock)
    q.push(Item("a", 0, 0.0))
    q.charge("a", 1000)  # a has been served a lot while b was idle
    q.remove(next(q.ordered()))
    q.push(Item("a", 0, 1.0))
    q.push(Item("b", 0, 2.0))  # b arrives: it starts at a's virtual time, not at 0
    order = [i.tenant for i in q.ordered()]
    assert order == ["a", "b"]  # equal virtual time → arrival order


def test_limits_refuse_with_retry_hint() -> None:
    q = FairQueue(QueueConfig(max_waiting=3, max_waiting_per_tenant=2, retry_after_s=2.5))
    q.push(Item("a", 0, 0))
    q.push(Item("a", 0, 0))
    with pytest.raises(QueueFullError) as exc:
        q.push(Item("a", 0, 0))
    assert exc.value.reason == "tenant_queue_full" and exc.value.retry_after == 2.5
    q.push(Item("b", 0, 0))
    with pytest.raises(QueueFullError) as exc:
        q.push(Item("c", 0, 0))
    assert exc.value.reason == "queue_full"
    assert len(q) == 3
    assert q.depth_by_priority() == {0: 3}


def test_charging_a_build_at_once_orders_as_a_charge_per_row() -> None:
    # weights whose reciprocals are inexact: the sums must still match bit for bit
    cfg = QueueConfig(weights={"a": 3.0, "b": 0.7})
    rng = random.Random(3)
    rows = [(rng.choice("abc"), rng.choice([1, 1, 1, 7, 64])) for _ in range(500)]
    one, many = FairQueue(cfg, Clock()), FairQueue(cfg, Clock())
    for tenant, n in rows:
        one.charge(tenant, n)
    many.charge_rows(rows)
    # the order waiting requests are picked in (which reads the virtual times) is the same
    for q in (one, many):
        for i, tenant in enumerate("abcd"):
            q.push(Item(tenant, 0, float(i)))
    assert [i.tenant for i in one.ordered()] == [i.tenant for i in many.ordered()]
    assert one._vtime == many._vtime
