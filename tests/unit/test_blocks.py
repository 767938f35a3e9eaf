"""BlockPool / BlockTable bookkeeping, with an integrity check after every operation."""

from __future__ import annotations

import random

import pytest

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.blocks import BlockPool, BlockTable


def test_allocate_free_roundtrip() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.check_integrity()
    assert len(set(a)) == 3 and pool.num_free == 5 and pool.num_used == 3
    assert all(pool.refcount(b) == 1 for b in a)
    pool.free(a)
    pool.check_integrity()
    assert pool.num_free == 8


def test_exhaustion_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free"):
        pool.allocate(2)
    pool.check_integrity()
    assert pool.num_free == 1  # the failed call took nothing
    pool.free(held)
    assert pool.allocate(4)
    pool.check_integrity()


def test_refcount_sharing() -> None:
    pool = BlockPool(4)
    prefix = pool.allocate(2)
    pool.incref(prefix)  # a second sequence shares the prefix
    pool.check_integrity()
    pool.free(prefix)
    pool.check_integrity()
    assert pool.num_free == 2  # still held by the other owner
    assert all(pool.refcount(b) == 1 for b in prefix)
    pool.free(prefix)
    pool.check_integrity()
    assert pool.num_free == 4


def test_misuse_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(a)
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(0)


def test_block_table_grows_and_truncates() -> None:
    pool = BlockPool(10)
    table = BlockTable(block_size=4)
    table.ensure(pool, 9)  # 3 blocks
    assert len(table.blocks) == 3 and table.capacity == 12
    table.ensure(pool, 12)  # still 3
    assert len(table.blocks) == 3
    table.truncate(pool, 5)  # keeps 2
    assert len(table.blocks) == 2 and pool.num_free == 8
    with pytest.raises(OutOfBlocksError):
        table.ensure(pool, 100)
    assert len(table.blocks) == 2 and pool.num_free == 8  # unchanged on failure
    table.release(pool)
    pool.check_integrity()
    assert pool.num_free == 10


def test_random_operation_sequences_keep_integrity() -> None:
    rng = random.Random(0)
    pool = BlockPool(64)
    owners: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            try:
                owners.append(pool.allocate(rng.randint(0, 6)))
            except OutOfBlocksError:
                pass
        elif op < 0.6 and owners:
            shared = list(rng.choice(owners))
            pool.incref(shared)
            owners.append(shared)
        elif owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        pool.check_integrity()
        held = sum(len(o) for o in owners)
        distinct = len({b for o in owners for b in o})
        assert pool.num_used == distinct and held >= distinct
    for o in owners:
        pool.free(o)
    pool.check_integrity()
    assert pool.num_free == 64
