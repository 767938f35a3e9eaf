"""What a lease uses of its pool, and the two edits of a session's KV that the lease and the
pool share (`truncate_kv`, `drop_kv`). Built by SessionPool; this module imports nothing of
pool.py or lease.py. Every function here runs under the pool lock (its caller holds it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ds4pool.kv.config import PoolConfig
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.restore_plan import RestorePlanner
from ds4pool.kv.session import Session, Tier
from ds4pool.kv.sharing import PrefixSharing
from ds4pool.kv.tiers import Tiers


@dataclass(frozen=True)
class PoolParts:
    """What a lease uses of its pool."""

    cfg: PoolConfig
    cond: threading.Condition  # the pool lock
    blocks: BlockIndex
    sharing: PrefixSharing
    tiers: Tiers
    planner: RestorePlanner  # read a returning session's KV back, or recompute it
    next_version: Callable[[], int]
    make_room: Callable[[int, Session], None]  # demote idle sessions until n blocks are free
    discard: Callable[[Session], None]


def truncate_kv(p: PoolParts, s: Session, n: int) -> int:
    """Keep KV for s's first n tokens; returns how many are kept (see sharing.truncate)."""
    if n >= s.num_computed:
        return n
    if s.tier is Tier.DEVICE:
        # a copy-on-write block is had as any other: idle sessions are demoted for it
        n = p.sharing.truncate(s, n, lambda k: p.make_room(k, s))
    elif s.tier is Tier.RAM:
        p.tiers.truncate_host(s, n)
    # DISK: the snapshot keeps more tokens than needed; restore copies only n.
    s.num_computed = n
    s.num_persisted = min(s.num_persisted, n)
    del s.block_keys[n // p.cfg.block_size :]
    s.version = p.next_version()
    return n


def drop_kv(p: PoolParts, s: Session) -> None:
    """Let go of s's device blocks and host copy (its tokens and snapshot stay)."""
    if s.block_table is not None:
        s.block_table.release(p.blocks)
        s.block_table = None
    p.tiers.ram.pop(s.key)
    s.host_kv, s.tier, s.disk_read_s = None, Tier.NONE, None
    s.num_computed, s.block_keys = 0, []
