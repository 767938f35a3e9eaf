"""The session pool's configuration, its usage report and its observer hooks.

Apart from `pool.py` so that the pool's parts (`tiers.py`, `admin.py`) and its callers share
them without importing the facade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PoolConfig:
    num_device_blocks: int
    block_size: int = 16
    ram_bytes: int = 4 << 30
    disk_dir: Path | None = None  # None: no disk tier, no persistence
    disk_bytes: int = 32 << 30
    persist_idle_s: float = 30.0  # persist a dirty session idle this long (0 disables)
    persist_every_tokens: int = 4096  # persist when this many new tokens piled up (0 disables)
    acquire_timeout_s: float = 60.0
    # Host copies waiting for their snapshot write (RAM overflow, demotions to disk) may hold
    # this much memory on top of ram_bytes; a spill past it loses that KV (re-prefilled).
    spill_bytes: int = 1 << 30
    # read a returning session's KV back, or recompute it: "auto" (the cheaper, from measured
    # rates), "always" (read), "never" (recompute); see kv/cost.py
    restore_policy: str = "auto"
    # Shared snapshot store (kv/store.py): several replicas on one disk_dir, each with its
    # own id; None: a private disk tier (flock on the directory).
    replica_id: str | None = None
    lease_ttl_s: float = 30.0  # a replica's session lease runs out this long after its use


@dataclass(frozen=True)
class PoolUsage:
    device_blocks_used: int
    device_blocks_total: int
    device_sessions: int
    device_bytes: int
    ram_sessions: int
    ram_bytes: int
    ram_budget_bytes: int
    disk_sessions: int
    disk_bytes: int
    disk_budget_bytes: int
    device_blocks_indexed: int = 0  # full blocks in the block index (held or cached)
    device_blocks_cached: int = 0  # indexed blocks no session holds (evicted when needed)
    device_blocks_pinned: int = 0  # indexed blocks of pinned prefixes


class PoolObserver:
    """Hooks for metrics and logs; the default does nothing."""

    def session_moved(self, src: str, dst: str, reason: str) -> None: ...

    def restored(self, tier: str, seconds: float) -> None: ...

    def snapshot_error(self, kind: str) -> None: ...

    def prefix_shared(self, num_tokens: int) -> None:
        """A prompt or a restore took num_tokens of KV from the block index."""

    def blocks_evicted(self, num_blocks: int) -> None:
        """Cached blocks left the block index to make room."""

    def restore_decided(self, tier: str, choice: str) -> None:
        """A returning session's KV in `tier` (ram, disk) is read back or recomputed
        (`choice`: read, recompute), kv/cost.py's decision."""

    # shared snapshot store (replicas): kv/store.py calls the first two
    def lease_claimed(self, claim: str) -> None:
        """A session lease claim ended as renewed, acquired, taken_over or foreign."""

    def store_error(self, kind: str) -> None:
        """A lease file could not be read or written."""

    def store_io(self, op: str, num_bytes: int) -> None:
        """A snapshot of num_bytes was read from or written to the disk tier/store."""

    def foreign_restored(self) -> None:
        """A session was restored from a snapshot another replica wrote."""
