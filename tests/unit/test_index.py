"""BlockIndex: chain keys, sharing, cached blocks and eviction, with an integrity check
after every operation (holders counted independently of the index)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.kv.index import BlockIndex

BS = 4


class Checked:
    """A BlockIndex and the holders' references as the test counts them."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.index = BlockIndex(BlockPool(num_blocks), BS, secret=b"test")
        self.held: Counter[int] = Counter()

    def check(self) -> None:
        self.index.check_integrity(dict(self.held))

    def allocate(self, n: int) -> list[int]:
        blocks = self.index.allocate(n)
        self.held.update(blocks)
        self.check()
        return blocks

    def acquire(self, tenant: str, ids: list[int], priority: int = 0) -> list[int]:
        blocks = self.index.acquire(self.index.keys(tenant, ids), priority)
        self.held.update(blocks)
        self.check()
        return blocks

    def insert(self, tenant: str, ids: list[int], blocks: list[int], priority: int = 0) -> int:
        n = self.index.insert(self.index.keys(tenant, ids), blocks, priority)
        self.check()
        return n

    def free(self, blocks: list[int]) -> None:
        self.index.free(blocks)
        self.held.subtract(blocks)
        self.held = +self.held
        self.check()


def test_keys_are_a_chain_salted_by_tenant() -> None:
    idx = BlockIndex(BlockPool(4), BS, secret=b"s")
    ids = list(range(10))
    keys = idx.keys("a", ids)
    assert len(keys) == 2  # full blocks only
    assert idx.keys("a", ids[:8]) == keys
    assert idx.keys("a", ids, start=keys[:1]) == keys  # extended, same result
    assert idx.keys("b", ids)[0] != keys[0] and idx.keys("b", ids)[1] != keys[1]
    # same second block after a different first block: a different key (whole prefix)
    assert idx.keys("a", [9, 9, 9, 9, *ids[4:8]])[1] != keys[1]
    # another secret (another process) names the same prefix differently
    assert BlockIndex(BlockPool(4), BS, secret=b"t").keys("a", ids) != keys


def test_second_holder_shares_the_indexed_prefix() -> None:
    c = Checked()
    ids = list(range(12))
    own = c.allocate(3)
    assert c.insert("t", ids, own) == 3
    assert c.acquire("t", [*ids, 99]) == own  # longest chain: all three
    assert c.acquire("t", [*ids[:5], 7, 7, 7, 7]) == own[:1]  # diverges in block 2
    assert c.index.num_used == 3  # shared blocks counted once


def test_released_blocks_stay_cached_until_the_device_needs_them() -> None:
    c = Checked(num_blocks=4)
    ids = list(range(12))
    own = c.allocate(3)
    c.insert("t", ids, own)
    c.free(own)
    assert c.index.num_cached == 3 and c.index.num_free == 4
    assert c.acquire("t", ids) == own  # a later prompt finds them
    c.free(own)
    fresh = c.allocate(2)  # 1 free + 1 evicted: the chain's tail goes first
    assert c.index.evictions == 1
    assert c.index.lookup(c.index.keys("t", ids)) == own[:2]
    c.free(fresh)
    with pytest.raises(OutOfBlocksError):
        c.allocate(5)
    c.check()


def test_lowest_priority_is_evicted_first() -> None:
    c = Checked(num_blocks=2)
    a, b = c.allocate(2)
    c.insert("t", [1] * BS, [a], priority=-5)
    c.insert("t", [2] * BS, [b], priority=0)
    c.free([a])  # released first but more important
    c.free([b])
    c.acquire("t", [2] * BS, priority=5)  # last used by a low-priority request
    c.free([b])
    c.allocate(1)
    assert c.index.lookup(c.index.keys("t", [1] * BS)) == [a]
    assert c.index.lookup(c.index.keys("t", [2] * BS)) == []


def test_pinned_blocks_are_never_evicted() -> None:
    c = Checked(num_blocks=2)
    ids = list(range(2 * BS))
    keys = c.index.keys("t", ids)
    c.index.pin(keys[:1])  # pinned before it exists: applies once indexed
    own = c.allocate(2)
    c.insert("t", ids, own)
    c.free(own)
    assert c.index.num_cached == 1 and c.index.usage().num_pinned == 1
    c.allocate(1)
    with pytest.raises(OutOfBlocksError):
        c.allocate(1)
    c.index.unpin(keys[:1])
    c.check()
    assert c.index.num_cached == 1
    c.allocate(1)


def test_duplicate_content_keeps_the_first_block() -> None:
    c = Checked()
    ids = list(range(BS))
    first, second = c.allocate(1), c.allocate(1)
    assert c.insert("t", ids, first) == 1
    assert c.insert("t", ids, second) == 0  # computed twice: the second stays private
    c.free(second)
    assert c.index.pool.refcount(second[0]) == 0


def test_tenants_never_share() -> None:
    c = Checked()
    ids = list(range(8))
    own = c.allocate(2)
    c.insert("a", ids, own)
    assert c.acquire("b", ids) == []
    assert c.index.lookup(c.index.keys("b", ids)) == []


def test_block_table_allocates_through_the_index() -> None:
    c = Checked(num_blocks=3)
    ids = list(range(8))
    t = BlockTable(BS)
    t.ensure(c.index, 8)
    c.held.update(t.blocks)
    c.insert("t", ids, t.blocks)
    t2 = BlockTable(BS)
    shared = c.acquire("t", ids)
    t2.adopt(c.index, shared)
    assert t2.epoch and t2.epoch != t.epoch
    t.release(c.index)
    c.held.subtract(shared)
    c.check()
    assert c.index.num_cached == 0  # still held by t2
    t2.release(c.index)
    c.held.subtract(shared)
    c.held = +c.held
    c.check()
    assert c.index.num_cached == 2


def test_random_operations_keep_integrity() -> None:
    rng = random.Random(0)
    c = Checked(num_blocks=24)
    prefixes = [[rng.randrange(50) for _ in range(6 * BS)] for _ in range(4)]
    holdings: list[list[int]] = []
    for _ in range(600):
        op = rng.random()
        tenant = rng.choice("ab")
        ids = rng.choice(prefixes)[: rng.randrange(1, 6 * BS)]
        if op < 0.35:
            shared = c.acquire(tenant, ids, priority=rng.randrange(3))
            need = len(ids) // BS - len(shared)
            try:
                own = c.allocate(need)
            except OutOfBlocksError:
                c.free(shared)
                continue
            c.insert(tenant, ids, shared + own, priority=rng.randrange(3))
            holdings.append(shared + own)
        elif op < 0.7 and holdings:
            c.free(holdings.pop(rng.randrange(len(holdings))))
        elif op < 0.8:
            keys = c.index.keys(tenant, ids)
            (c.index.pin if rng.random() < 0.5 else c.index.unpin)(keys)
            c.check()
        elif op < 0.85:
            c.index.evict_all()
            c.check()
        else:
            try:
                c.free(c.allocate(rng.randrange(1, 4)))
            except OutOfBlocksError:
                c.check()
    for h in holdings:
        c.free(h)
    assert c.index.num_used == c.index.usage().num_pinned  # nobody holds anything else
    c.index.unpin([k for p in prefixes for t in "ab" for k in c.index.keys(t, p)])
    c.index.evict_all()
    c.check()
    assert c.index.num_free == 24


def test_take_back_unindexes_only_a_block_its_one_holder_alone_needs() -> None:
    c = Checked(8)
    ids = list(range(8))
    blocks = c.allocate(2)
    c.insert("a", ids, blocks)
    keys = c.index.keys("a", ids)
    other = c.acquire("a", ids)  # a second holder of both blocks
    assert not c.index.take_back(blocks[1])  # another holder reads it: nothing changes
    c.free(other)
    c.index.pin(keys[:1])
    assert not c.index.take_back(blocks[0])  # a pin keeps the indexed content
    assert c.index.take_back(blocks[1])
    c.check()
    assert c.index.lookup(keys) == blocks[:1] and not c.index.is_shared(blocks[1])
    c.free(blocks)  # the taken-back block goes to the free list, not the cache
    assert c.index.num_cached == 0 and c.index.pool.num_free == 7
