"""The pool's use of the block index (kv/index.py): which blocks a session shares.

    prompt ──match──► own KV reused? ──► the index's chain longer? ──► adopt the chain
                                                                     (own KV dropped)
    step   ──────────► full blocks computed ──► offered to the index (shared from now on)
    restore ─────────► the prefix still on the device is shared, only the rest is copied
    fork   ──────────► truncation into a block others share ──► copy it first (COW)

A session's blocks are a chain: block i of its table holds tokens [i*bs, (i+1)*bs) of its
tokens, and `block_keys[i]` is their chain key, for the blocks offered to the index so far.
Blocks past `len(block_keys)` are the session's own and never indexed, so a holder only ever
writes into its own blocks (see `truncate`). Every method runs under the pool lock, held by
its caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds4pool.errors import Ds4poolError, OutOfBlocksError
from ds4pool.kv.blocks import BlockTable
from ds4pool.kv.config import PoolObserver
from ds4pool.kv.index import BlockIndex, BlockKey
from ds4pool.kv.session import Session, Tier
from ds4pool.kv.transfer import DeviceKV, copy_block


class PrefixNotFoundError(Ds4poolError):
    """No pinned prefix with this id."""


@dataclass(frozen=True)
class PrefixInfo:
    """A pinned prefix, as the admin API shows it."""

    id: str
    tenant: str
    num_tokens: int  # tokens given; only full blocks are pinned
    num_blocks: int  # its full blocks
    blocks_on_device: int  # of those, leading blocks in the index now


@dataclass(frozen=True)
class _Pin:
    tenant: str
    num_tokens: int
    keys: tuple[BlockKey, ...]


class PrefixSharing:
    def __init__(
        self, index: BlockIndex, kv: DeviceKV, block_size: int, observer: PoolObserver
    ) -> None:
        self.index = index
        self.kv = kv
        self.block_size = block_size
        self.observer = observer
        self._pins: dict[str, _Pin] = {}

    def chain_for(self, s: Session, ids: Sequence[int], reuse: int) -> list[BlockKey]:
        """Keys of the indexed chain of ids' full blocks, when it reaches past the session's
        own `reuse` tokens (else []). At least one token of ids is left to compute."""
        bs = self.block_size
        keys = self.index.keys(s.tenant, ids[: len(ids) - 1], s.block_keys[: reuse // bs])
        chain = self.index.lookup(keys)
        return keys[: len(chain)] if len(chain) * bs > reuse else []

    def adopt(self, s: Session, ids: Sequence[int], keys: list[BlockKey]) -> int:
        """The session, with no KV left, takes the chain `keys` of ids; returns its tokens."""
        assert s.tier is Tier.NONE and s.block_table is None
        n = len(keys) * self.block_size
        table = BlockTable(self.block_size)
        table.adopt(self.index, self.index.acquire(keys, s.priority))
        s.block_table, s.tier = table, Tier.DEVICE
        s.block_keys = list(keys)
        s.token_ids, s.text = list(ids[:n]), ""
        s.num_computed = n
        self.observer.prefix_shared(n)
        return n

    def offer(
        self, s: Session, prompt_ids: Sequence[int], output_ids: Sequence[int], num_computed: int
    ) -> None:
        """Index the full blocks of a running request's KV not offered yet (its tokens are
        prompt_ids + output_ids, the first num_computed computed)."""
        table = s.block_table
        if s.tier is not Tier.DEVICE or table is None:
            return
        bs = self.block_size
        done, full = len(s.block_keys), min(num_computed, table.capacity) // bs
        if full <= done:
            return
        ids = [*prompt_ids[: full * bs], *output_ids[: max(0, full * bs - len(prompt_ids))]]
        keys = self.index.keys(s.tenant, ids, s.block_keys)
        self.index.insert(keys[done:], table.blocks[done:full], s.priority)
        s.block_keys = keys

    def share_for_restore(self, s: Session, table: BlockTable) -> int:
        """Put the blocks of s's computed prefix that the index holds into the (empty) table
        it restores into; returns the tokens they cover (the rest is copied)."""
        n = s.num_computed
        keys = self.index.keys(s.tenant, s.token_ids[:n], s.block_keys) if n else []
        shared = self.index.acquire(keys, s.priority)
        table.adopt(self.index, shared)
        s.block_keys = keys  # offered right after the copy (restored_into)
        if shared:
            self.observer.prefix_shared(len(shared) * self.block_size)
        return len(shared) * self.block_size

    def restored_into(self, s: Session, table: BlockTable) -> None:
        """The copied blocks of a restore hold their tokens now: index them."""
        self.index.insert(s.block_keys, table.blocks, s.priority)

    def truncate(self, s: Session, n: int, make_room: Callable[[int], None] | None = None) -> int:
        """Keep a device session's first n tokens of KV; returns how many are kept: n, or n
        rounded down to a block when its last, partial block is shared, no block can be had
        for the copy (copy-on-write) and other sessions hold it too. `make_room(k)` frees k
        blocks if it can (the pool demotes idle sessions, as for any other allocation) or
        raises OutOfBlocksError. With no block to be had, a block only the index shares is
        taken out of it and written in place (its old content was a cache entry alone)."""
        table = s.block_table
        assert table is not None
        bs = self.block_size
        table.truncate(self.index, n)
        del s.block_keys[n // bs :]
        if not n % bs or not self.index.is_shared(table.blocks[-1]):
            return n
        fresh = self._one_block(make_room)
        if fresh is None and self.index.take_back(table.blocks[-1]):
            return n
        if fresh is None:
            n -= n % bs
            table.truncate(self.index, n)
            return n
        copy_block(self.kv, table.blocks[-1], fresh, bs)
        table.truncate(self.index, n - n % bs)  # lets go of the shared one; a new epoch
        table.blocks.append(fresh)
        return n

    def _one_block(self, make_room: Callable[[int], None] | None) -> int | None:
        """A free or cached block; else one freed by make_room; None if neither can."""
        try:
            return self.index.allocate(1)[0]
        except OutOfBlocksError:
            if make_room is None:
                return None
        try:
            make_room(1)
            return self.index.allocate(1)[0]
        except OutOfBlocksError:
            return None

    # ------------------------------------------------------------ pinned prefixes

    def pin(self, tenant: str, token_ids: Sequence[int]) -> PrefixInfo:
        """Keep the full blocks of this prefix on the device once computed, whatever the
        pressure (as a pinned session's are). Pinning the same prefix twice is one pin."""
        keys = tuple(self.index.keys(tenant, token_ids))
        if not keys:
            raise ValueError(
                f"a prefix of {len(token_ids)} tokens has no full KV block "
                f"({self.block_size} tokens) to pin"
            )
        pin_id = keys[-1].hex()[:16]
        self._pins[pin_id] = _Pin(tenant, len(token_ids), keys)
        self.index.pin(keys)
        return self.info(pin_id)

    def unpin(self, pin_id: str) -> PrefixInfo:
        info = self.info(pin_id)
        pin = self._pins.pop(pin_id)
        still = {k for p in self._pins.values() for k in p.keys}  # shared with another pin
        self.index.unpin([k for k in pin.keys if k not in still])
        return info

    def info(self, pin_id: str) -> PrefixInfo:
        pin = self._pins.get(pin_id)
        if pin is None:
            raise PrefixNotFoundError(f"no pinned prefix {pin_id!r}")
        on_device = len(self.index.lookup(pin.keys))
        return PrefixInfo(pin_id, pin.tenant, pin.num_tokens, len(pin.keys), on_device)

    def pins(self) -> list[PrefixInfo]:
        return [self.info(i) for i in sorted(self._pins)]

    # ------------------------------------------------------------ checks

    def check(self, s: Session) -> None:
        """A device session's chain keys name its tokens, and a block it holds that the index
        knows is indexed under the key of the session's block at that place."""
        assert s.block_table is not None
        bs = self.block_size
        k = min(len(s.block_keys), len(s.token_ids) // bs) if s.loaded else 0
        assert s.block_keys[:k] == self.index.keys(s.tenant, s.token_ids[: k * bs]), s.key
        if not s.in_flight:  # a running request's keys may run ahead of the session's state
            assert len(s.block_keys) <= s.num_computed // bs, s.key
        for key, b in zip(s.block_keys, s.block_table.blocks):
            indexed = self.index.key_of(b)
            assert indexed is None or indexed == key, f"{s.key}: block {b} holds other tokens"
