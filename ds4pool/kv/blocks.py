"""Block bookkeeping for the paged KV cache: integer ids and reference counts only.

The tensors live in the model runner's KV cache; this module never touches them.
A block is free iff its reference count is 0. Reference counts > 1 let sequences
share a prefix (copy-on-write is the owner's business: it must not write into a
block whose count is > 1).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ds4pool.errors import OutOfBlocksError

# Unique ids, not state: block-table epochs must never repeat within the process, even
# across pools, because a model runner's input batch may outlive a pool (benchmarks,
# tests) and compares epochs to decide what to re-upload.
_EPOCHS = itertools.count(1)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # FIFO of free ids: a freed block is reused last, which keeps recently freed
        # contents around longest (useful when debugging a stale read).
        self._free: deque[int] = deque(range(num_blocks))

    @staticmethod
    def next_epoch() -> int:
        """A number no block table in this process had before (see BlockTable.epoch)."""
        return next(_EPOCHS)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1, or OutOfBlocksError and nothing allocated."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Share already-allocated blocks (e.g. a common prefix)."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
        for b in blocks:
            self._refcount[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free list."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and the reference counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate ids in the free list"
        for b, count in enumerate(self._refcount):
            assert count >= 0, f"block {b} has refcount {count}"
            assert (count == 0) == (b in free), f"block {b}: refcount {count}, free={b in free}"


class BlockSource(Protocol):
    """What a block table allocates from: a BlockPool, or the BlockIndex over one."""

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: Sequence[int]) -> None: ...

    def next_epoch(self) -> int: ...


@dataclass
class BlockTable:
    """The blocks holding one sequence's KV, in token order.

    Token p lives in blocks[p // block_size] at offset p % block_size.

    `epoch` changes whenever the list changes other than by appending (a truncation, or the
    first allocation), and is unique within the pool: a reader that copied the first n ids
    under epoch e may copy only the ids past n while the epoch is still e (the model
    runner keeps its device copy of block tables up to date this way).
    """

    block_size: int
    blocks: list[int] = field(default_factory=list)
    epoch: int = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self.blocks))

    def ensure(self, pool: BlockSource, num_tokens: int) -> None:
        """Grow to hold num_tokens (all-or-nothing: OutOfBlocksError leaves it unchanged)."""
        new = pool.allocate(self.blocks_needed(num_tokens))
        if not self.epoch:
            self.epoch = pool.next_epoch()
        self.blocks.extend(new)

    def adopt(self, pool: BlockSource, blocks: Sequence[int]) -> None:
        """Start an empty table with blocks the caller already holds references to."""
        assert not self.blocks
        self.blocks.extend(blocks)
        self.epoch = pool.next_epoch()

    def truncate(self, pool: BlockSource, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens tokens."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(self.blocks):
            pool.free(self.blocks[keep:])
            del self.blocks[keep:]
            self.epoch = pool.next_epoch()

    def release(self, pool: BlockSource) -> None:
        self.truncate(pool, 0)
