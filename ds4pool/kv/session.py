"""A session: one conversation's exact tokens, the text they stand for, and where its KV is."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ds4pool.errors import Ds4poolError
from ds4pool.kv.blocks import BlockTable
from ds4pool.kv.index import BlockKey

SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

SessionKey = tuple[str, str]  # (tenant, session_id)


class InvalidSessionIdError(Ds4poolError):
    """A session id outside 1-128 chars of [A-Za-z0-9._:-]."""


class SessionBusyError(Ds4poolError):
    """The session already has a request in flight and it did not finish in time."""


class SessionNotFoundError(Ds4poolError):
    """No session with this key in any tier."""


def validate_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        shown = repr(session_id)[:40]
        raise InvalidSessionIdError(
            f"invalid session id {shown}: use 1-128 characters of A-Z a-z 0-9 . _ : -"
        )
    return session_id


class Tier(str, Enum):
    """Where a session's KV lives now. NONE: no KV (new, dropped, or lost to an I/O error)."""

    DEVICE = "device"
    RAM = "ram"
    DISK = "disk"
    NONE = "none"


@dataclass
class Session:
    """Invariants (checked by SessionPool.check_integrity):

    # token_ids[0, num_computed)   have KV in the session's tier
    # token_ids[num_computed, :)   known but without KV (at most the last sampled token
    #                               after a turn; recomputed as part of the next prompt)

    - tier DEVICE ⇔ block_table is set and holds >= num_computed tokens of capacity;
      tier RAM ⇔ host_kv is set with T == num_computed; tier DISK ⇔ neither, and the
      disk tier has a snapshot with num_kv_tokens == num_computed.
    - `text` is the exact text token_ids stand for ('' when unknown).
    - block_keys[i] is the block index's chain key of token_ids' block i, for the first
      blocks whose KV has been computed (a prefix of them; it may lag behind).
    """

    tenant: str
    session_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # (n, c) with token_ids[:n] standing for text[:c]: where a diverging prompt can resume
    text_marks: list[tuple[int, int]] = field(default_factory=list)
    num_computed: int = 0
    tier: Tier = Tier.NONE
    block_table: BlockTable | None = None
    block_keys: list[BlockKey] = field(default_factory=list)
    priority: int = 0  # of the last request: the eviction class of its cached blocks
    host_kv: torch.Tensor | None = None  # [L, 2, T, H_kv, D] on the host (RAM tier)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0  # requests that reused cached tokens
    pinned: bool = False
    in_flight: bool = False
    copying: bool = False  # in_flight for a copy of its device KV off the pool lock (tiers)
    ephemeral: bool = False  # discarded when its request ends (no X-Session-Id)
    num_persisted: int = 0  # num_computed covered by the newest snapshot on disk (0 = none)
    version: int = 0  # bumped (pool-wide counter) whenever tokens or KV change
    persisted_version: int = -1  # version of the newest snapshot on disk (-1 = none)
    loaded: bool = True  # False: only the disk index knows it; tokens/text not read yet
    disk_read_s: float | None = None  # set while KV read from disk awaits restore()

    @property
    def key(self) -> SessionKey:
        return (self.tenant, self.session_id)

    @property
    def dirty(self) -> bool:
        """True when the newest snapshot (if any) is not this exact state."""
        return self.persisted_version != self.version

    @property
    def dirty_tokens(self) -> int:
        """Computed tokens not yet in a snapshot."""
        return max(0, self.num_computed - self.num_persisted) if self.dirty else 0

    def info(self, kv_bytes_per_token: int) -> SessionInfo:
        return SessionInfo(
            tenant=self.tenant,
            session_id=self.session_id,
            tier=self.tier.value,
            num_tokens=max(len(self.token_ids), self.num_computed),
            num_computed=self.num_computed,
            kv_bytes=self.num_computed * kv_bytes_per_token,
            created=self.created,
            last_used=self.last_used,
            hits=self.hits,
            pinned=self.pinned,
            in_flight=self.in_flight,
            persisted_tokens=self.num_persisted,
        )


@dataclass(frozen=True)
class SessionInfo:
    """A read-only view for listings and the admin API."""

    tenant: str
    session_id: str
    tier: str
    num_tokens: int
    num_computed: int
    kv_bytes: int
    created: float
    last_used: float
    hits: int
    pinned: bool
    in_flight: bool
    persisted_tokens: int
