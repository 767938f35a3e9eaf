"""The block index: full KV blocks by content, so that sessions share a prefix's blocks.

A full block is named by a hash chain over token ids, salted by tenant:

    key[0] = H(salt(tenant) || tokens[0, bs))
    key[i] = H(key[i-1]    || tokens[i*bs, (i+1)*bs))

so a key names the whole prefix up to its block, not the block's tokens alone, and one
tenant's keys never equal another's: a lookup by tenant B can never find (or, by timing,
probe) tenant A's blocks. The salt mixes a per-index secret in, so keys cannot be guessed
from outside either.

Ownership: `BlockIndex` wraps the `BlockPool` and is what block tables allocate from and
free to. Every indexed block carries one reference held by the index itself, so

    refcount(b) == holders(b) + (1 if b is indexed else 0)

and an indexed block that no session holds (refcount 1) is *cached*: it stays indexed, in
an LRU, until the device needs blocks; then cached blocks are evicted lowest priority first
(the largest priority number of the last request that used them: lower runs first, as in
the scheduler), least recently released first within a priority. Blocks of pinned prefixes
are never evicted.

A holder never writes into an indexed block (see `is_shared`): only full blocks are indexed,
and a holder writes past its computed tokens, so only a truncation into an indexed block
(a fork) needs a copy first.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.blocks import BlockPool

BlockKey = bytes  # 16-byte chain hash of a full block (and everything before it)


@dataclass
class _Entry:
    key: BlockKey
    priority: int  # of the last request that indexed or acquired it (lower runs first)


@dataclass(frozen=True)
class IndexUsage:
    num_indexed: int  # blocks in the index (held or cached)
    num_cached: int  # indexed blocks no session holds (evictable unless pinned)
    num_pinned: int  # indexed blocks of pinned prefixes
    hits: int  # blocks handed out by acquire() since start
    evictions: int  # cached blocks evicted to make room since start


class BlockIndex:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        secret: bytes | None = None,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self._on_evict = on_evict
        self.block_size = block_size
        self._secret = secret if secret is not None else os.urandom(16)
        self._by_key: dict[BlockKey, int] = {}
        self._by_block: dict[int, _Entry] = {}
        # priority -> cached blocks, least recently released first (an OrderedDict per
        # priority: O(1) to touch, to remove from the middle, and to pop the oldest)
        self._cached: dict[int, OrderedDict[int, None]] = {}
        self._pinned: set[BlockKey] = set()
        self.hits = 0
        self.evictions = 0

    # ------------------------------------------------------------ keys

    def keys(
        self, tenant: str, token_ids: Sequence[int], start: Sequence[BlockKey] = ()
    ) -> list[BlockKey]:
        """Chain keys of every full block of token_ids; `start` (keys already known for
        its first blocks) is extended, not recomputed."""
        bs = self.block_size
        out = list(start)
        prev = out[-1] if out else self._salt(tenant)
        for i in range(len(out), len(token_ids) // bs):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(array("q", token_ids[i * bs : (i + 1) * bs]).tobytes())
            prev = h.digest()
            out.append(prev)
        return out

    def _salt(self, tenant: str) -> bytes:
        return hashlib.blake2b(tenant.encode(), key=self._secret, digest_size=16).digest()

    # ------------------------------------------------------------ lookup and insert

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks of the longest indexed prefix of `keys` (changes nothing)."""
        out: list[int] = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, keys: Sequence[BlockKey], priority: int = 0) -> list[int]:
        """Take a reference on the blocks of the longest indexed prefix of `keys` for a
        request of `priority` (the blocks' eviction class once nobody holds them)."""
        blocks = self.lookup(keys)
        self.incref(blocks)
        for b in blocks:
            self._by_block[b].priority = priority
        self.hits += len(blocks)
        return blocks

    def insert(self, keys: Sequence[BlockKey], blocks: Sequence[int], priority: int = 0) -> int:
        """Index a holder's full blocks under their chain keys; returns how many were new.
        A key already indexed keeps its block (the holder's copy stays private)."""
        assert len(keys) <= len(blocks)
        added = 0
        for k, b in zip(keys, blocks):
            if k in self._by_key:
                continue
            assert b not in self._by_block, f"block {b} is indexed under another key"
            assert self.pool.refcount(b) > 0, f"block {b} is free"
            self.pool.incref([b])
            self._by_key[k] = b
            self._by_block[b] = _Entry(k, priority)
            added += 1
        return added

    def is_indexed(self, block: int) -> bool:
        return block in self._by_block

    def key_of(self, block: int) -> BlockKey | None:
        e = self._by_block.get(block)
        return None if e is None else e.key

    def is_shared(self, block: int) -> bool:
        """True when a holder must not write into the block (copy it first)."""
        return block in self._by_block or self.pool.refcount(block) > 1

    def holders(self, block: int) -> int:
        return self.pool.refcount(block) - (1 if block in self._by_block else 0)

    def take_back(self, block: int) -> bool:
        """Unindex a block whose one holder must write into it and can have no copy: its
        cached content goes (as an eviction would take it), the holder keeps the block.
        False (nothing changes) where another holder or a pin needs the indexed content."""
        e = self._by_block.get(block)
        if e is None or self.holders(block) != 1 or e.key in self._pinned:
            return False
        del self._by_block[block]
        del self._by_key[e.key]
        self.pool.free([block])  # the index's own reference
        return True

    # ------------------------------------------------------------ the holders' pool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached(self) -> int:
        return sum(len(d) for d in self._cached.values())

    @property
    def num_free(self) -> int:
        """Blocks an allocate() can hand out now: free ones plus evictable cached ones."""
        return self.pool.num_free + self.num_cached

    @property
    def num_used(self) -> int:
        """Blocks some holder needs (cached blocks are not counted)."""
        return self.num_blocks - self.num_free

    def next_epoch(self) -> int:
        return self.pool.next_epoch()

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting cached ones if the free list is short (all or nothing)."""
        short = n - self.pool.num_free
        if short > self.num_cached:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free} free")
        for _ in range(max(0, short)):
            self._evict_one()
        if short > 0 and self._on_evict is not None:
            self._on_evict(short)
        return self.pool.allocate(n)

    def incref(self, blocks: Sequence[int]) -> None:
        self.pool.incref(list(blocks))
        for b in blocks:
            self._uncache(b)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one holder's reference to each block. Indexed blocks left without holders
        become cached, the last ones first (so a chain's tail is evicted before its head)."""
        self.pool.free(list(blocks))
        for b in reversed(blocks):
            e = self._by_block.get(b)
            if e is not None and self.pool.refcount(b) == 1 and e.key not in self._pinned:
                self._cached.setdefault(e.priority, OrderedDict())[b] = None

    def _uncache(self, b: int) -> None:
        e = self._by_block.get(b)
        if e is not None:
            bucket = self._cached.get(e.priority)
            if bucket is not None:
                bucket.pop(b, None)

    def _evict_one(self) -> None:
        worst = max(p for p, d in self._cached.items() if d)
        b, _ = self._cached[worst].popitem(last=False)
        e = self._by_block.pop(b)
        del self._by_key[e.key]
        self.pool.free([b])
        self.evictions += 1

    def evict_all(self) -> int:
        """Drop every cached block (admin, tests); returns how many."""
        n = self.num_cached
        for _ in range(n):
            self._evict_one()
        if n and self._on_evict is not None:
            self._on_evict(n)
        return n

    # ------------------------------------------------------------ pinned prefixes

    def pin(self, keys: Sequence[BlockKey]) -> None:
        """Never evict these blocks (now or once they are indexed)."""
        self._pinned.update(keys)
        for k in keys:
            b = self._by_key.get(k)
            if b is not None:
                self._uncache(b)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        for k in keys:
            if k not in self._pinned:
                continue
            self._pinned.discard(k)
            b = self._by_key.get(k)
            if b is not None and self.pool.refcount(b) == 1:
                e = self._by_block[b]
                self._cached.setdefault(e.priority, OrderedDict())[b] = None

    def num_pinned_present(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of a pinned prefix are on the device."""
        return len(self.lookup(keys))

    # ------------------------------------------------------------ views and checks

    def usage(self) -> IndexUsage:
        return IndexUsage(
            num_indexed=len(self._by_block),
            num_cached=self.num_cached,
            num_pinned=sum(1 for k in self._pinned if k in self._by_key),
            hits=self.hits,
            evictions=self.evictions,
        )

    def check_integrity(self, holders: dict[int, int] | None = None) -> None:
        """Raise AssertionError if keys, blocks, cached lists and refcounts disagree.
        `holders`: block → number of holders known to the caller (checked exactly)."""
        self.pool.check_integrity()
        assert len(self._by_key) == len(self._by_block)
        for k, b in self._by_key.items():
            assert self._by_block[b].key == k, f"block {b} indexed under two keys"
            assert self.pool.refcount(b) >= 1, f"indexed block {b} is free"
        seen: set[int] = set()
        for p, bucket in self._cached.items():
            for b in bucket:
                assert b not in seen, f"block {b} cached twice"
                seen.add(b)
                e = self._by_block.get(b)
                assert e is not None, f"cached block {b} is not indexed"
                assert e.priority == p, f"cached block {b} in the wrong priority list"
        evictable = {
            b
            for b, e in self._by_block.items()
            if self.pool.refcount(b) == 1 and e.key not in self._pinned
        }
        assert seen == evictable, f"cached {sorted(seen)} != evictable {sorted(evictable)}"
        if holders is not None:
            for b in range(self.pool.num_blocks):
                want = holders.get(b, 0)
                assert self.holders(b) == want, f"block {b}: {self.holders(b)} holders, {want}"
