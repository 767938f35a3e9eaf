"""SessionPool: (tenant, session id) → Session, with KV across device, RAM and disk tiers.

Tier moves (all under the pool lock; the one KV copy of a session moves, never two live):

    device ──demote(pressure/evict)──► RAM ──LRU overflow──► disk ──LRU overflow──► gone
       ▲                                │                      │
       └────────────── restore ─────────┴──────────────────────┘

- Device blocks are needed → the least recently used idle, unpinned device session is
  demoted to RAM (in-flight sessions never are).
- RAM over budget → its LRU entries go to disk (already-persisted ones are just dropped,
  dirty ones are written first); a failed write loses that KV (the session keeps its
  tokens and re-prefills), counted as a snapshot error.
- Disk over budget → the LRU snapshot file is deleted; a session living only there is gone.
Persistence is write-behind (see `persist.py`); a DISK-tier session keeps only its index
entry in memory, its tokens and text are read back with its KV.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.kv.disk import DiskEntry, DiskTier
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.persist import PersistWriter, SnapshotOrder
from ds4pool.kv.prefix import TextMark, resume_point, valid_marks
from ds4pool.kv.ram import RamTier, host_buffer, nbytes
from ds4pool.kv.session import (
    PrefixMatch,
    Session,
    SessionBusyError,
    SessionInfo,
    SessionKey,
    SessionNotFoundError,
    Tier,
    validate_session_id,
)
from ds4pool.kv.snapshot import ModelFingerprint, Snapshot
from ds4pool.kv.transfer import copy_block, gather_to_host, scatter_from_host
from ds4pool.model.kv_layout import KVLayout
from ds4pool.model.loader import LoadedModel


def fingerprint_for(loaded: LoadedModel) -> ModelFingerprint:
    """What a snapshot's KV depends on: architecture, KV shape, dtype and the weights."""
    cfg = loaded.config
    return ModelFingerprint(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=str(loaded.dtype).removeprefix("torch."),
        weights_id=loaded.weights_id,
    )


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


class SessionPool:
    def __init__(
        self,
        cfg: PoolConfig,
        kv_caches: Sequence[torch.Tensor],
        fingerprint: ModelFingerprint,
        observer: PoolObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv_caches = kv_caches
        self.fingerprint = fingerprint
        self.observer = observer or PoolObserver()
        # sessions' block tables allocate through the index: it keeps full blocks nobody
        # holds cached (see kv/index.py) and evicts them when the device needs room
        self.blocks = BlockIndex(
            BlockPool(cfg.num_device_blocks), cfg.block_size, on_evict=self.observer.blocks_evicted
        )
        self.kv_bytes_per_token = KVLayout.of(kv_caches).bytes_per_token
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sessions: dict[SessionKey, Session] = {}
        self._versions = itertools.count(1)
        self.ram = RamTier(cfg.ram_bytes, self._on_ram_evict)
        self.disk: DiskTier | None = None
        self.order: SnapshotOrder | None = None
        if cfg.disk_dir is not None:
            self.disk = DiskTier(
                cfg.disk_dir,
                cfg.disk_bytes,
                fingerprint,
                on_error=self.observer.snapshot_error,
                on_evict=self._on_disk_evict,
            )
            self.order = SnapshotOrder(self.disk)
            for entry in self.disk.entries():
                s = Session(entry.tenant, entry.session_id, tier=Tier.DISK, loaded=False)
                s.num_computed = s.num_persisted = entry.num_kv_tokens
                s.version = s.persisted_version = next(self._versions)
                s.last_used = entry.last_used
                self._sessions[s.key] = s
        self.writer = PersistWriter(self, cfg.persist_idle_s) if self.disk else None

    # ------------------------------------------------------------ request lifecycle

    def acquire(self, tenant: str, session_id: str | None, timeout: float | None = None) -> Session:
        """Lease a session for one request (created if new; None → an ephemeral one).
        Waits while another request holds it; SessionBusyError after `timeout`."""
        if session_id is None:
            s = Session(tenant, f"~{uuid.uuid4().hex}", ephemeral=True, in_flight=True)
            with self._lock:
                self._sessions[s.key] = s
            return s
        validate_session_id(session_id)
        key = (tenant, session_id)
        wait = self.cfg.acquire_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                s = self._sessions.get(key)
                if s is None:
                    s = self._sessions[key] = Session(tenant, session_id)
                if not s.in_flight:
                    s.in_flight = True
                    return s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionBusyError(
                        f"session {session_id!r} is busy with another request (waited {wait:.0f}s)"
                    )
                self._cond.wait(left)

    def release(self, s: Session) -> None:
        """End the request's lease; ephemeral sessions are discarded."""
        with self._cond:
            s.in_flight = False
            s.last_used = time.time()
            if s.tier is Tier.RAM and s.key not in self.ram and not s.ephemeral:
                self._file_in_ram(s)  # read from disk, then the request ended before restore
            if s.ephemeral:
                self._discard(s)
            elif (
                self.writer
                and self.cfg.persist_every_tokens
                and s.dirty_tokens >= self.cfg.persist_every_tokens
            ):
                self.writer.enqueue(s.key)
            self._cond.notify_all()

    def _file_in_ram(self, s: Session) -> None:
        assert s.host_kv is not None
        came_from = "disk" if s.disk_read_s is not None else "ram"
        s.disk_read_s = None
        if self.ram.fits(nbytes(s.host_kv)):
            self.ram.put(s.key, s.host_kv)
            if came_from == "disk":
                self.observer.session_moved("disk", "ram", "restore")
        else:
            self._to_disk(s, "ram_full")

    def match_prefix(
        self,
        s: Session,
        *,
        prompt_ids: Sequence[int] | None = None,
        prompt_text: str | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
        priority: int = 0,
    ) -> PrefixMatch:
        """Decide the new prompt's tokens and how many leading ones reuse cached KV; drop
        the KV past that point. When the rendered text extends the session's text, the
        cached tokens are kept as they are and only the new text is tokenized (BPE merges
        across the old/new boundary would otherwise make a token match miss). When the
        block index holds a longer chain of the prompt's blocks than the session's own KV
        (another session's system prompt, or this session's other branch), the session
        takes those blocks instead."""
        assert s.in_flight
        assert prompt_ids is not None or (prompt_text is not None and tokenize is not None)
        with self._lock:
            self._load(s)
            via_text = bool(
                prompt_text is not None
                and tokenize is not None
                and s.text
                and s.token_ids
                and prompt_text.startswith(s.text)
            )
            marks: list[TextMark] = []
            if via_text:
                assert prompt_text is not None and tokenize is not None
                marks = [*s.text_marks, (len(s.token_ids), len(s.text))]
                ids = s.token_ids + tokenize(prompt_text[len(s.text) :])
            elif prompt_ids is not None:
                ids = list(prompt_ids)
            else:
                assert prompt_text is not None and tokenize is not None
                # The text diverged: keep the tokens up to the last boundary known to match
                # (see kv/prefix.py), tokenize the rest.
                n, c = resume_point(s.text_marks, s.token_ids, s.text, prompt_text)
                marks = [(mn, mc) for mn, mc in s.text_marks if mn <= n and mc <= c]
                if n:
                    marks.append((n, c))
                ids = s.token_ids[:n] + tokenize(prompt_text[c:])
            if prompt_text is not None and prompt_ids is None:
                marks.append((len(ids), len(prompt_text)))  # the prompt's end
            s.text_marks = marks
            common = 0
            for a, b in zip(ids, s.token_ids):
                if a != b:
                    break
                common += 1
            # at least one token must be computed to produce the next token's logits
            reuse = max(0, min(common, s.num_computed, len(ids) - 1))
            if reuse < len(s.token_ids):
                s.text = ""  # the text stood for tokens we no longer keep
            s.priority = priority
            reuse = self._truncate_kv(s, reuse)  # less when a partial block cannot be copied
            s.token_ids = ids[:reuse]
            own = reuse
            reuse = self._share_prefix(s, ids, reuse)
            if reuse:
                s.hits += 1
            return PrefixMatch(
                token_ids=ids, num_reused=reuse, via_text=via_text, num_shared=reuse - own
            )

    def _share_prefix(self, s: Session, ids: list[int], reuse: int) -> int:
        """Adopt the longest indexed chain of ids' blocks when it reaches past the session's
        own `reuse` tokens; returns the tokens reused."""
        bs = self.cfg.block_size
        # at least one token is computed: the chain covers full blocks of ids[:-1]
        keys = self.blocks.keys(s.tenant, ids[: len(ids) - 1], s.block_keys[: reuse // bs])
        chain = self.blocks.lookup(keys)
        n = len(chain) * bs
        if n <= reuse:
            return reuse
        persisted = min(s.num_persisted, reuse)
        self._drop_kv(s)
        table = BlockTable(bs)
        table.adopt(self.blocks, self.blocks.acquire(keys[: len(chain)], s.priority))
        s.block_table, s.tier = table, Tier.DEVICE
        s.block_keys = keys[: len(chain)]
        s.token_ids, s.text = ids[:n], ""
        s.num_computed, s.num_persisted = n, persisted
        s.version = next(self._versions)
        self.observer.prefix_shared(n)
        return n

    def index_blocks(
        self, s: Session, prompt_ids: Sequence[int], output_ids: Sequence[int], num_computed: int
    ) -> None:
        """Offer the block index the full blocks of a running request's KV (tokens
        prompt_ids + output_ids, the first num_computed computed) not offered yet."""
        with self._lock:
            table = s.block_table
            if s.tier is not Tier.DEVICE or table is None:
                return
            bs = self.cfg.block_size
            done, full = len(s.block_keys), min(num_computed, table.capacity) // bs
            if full <= done:
                return
            ids = [*prompt_ids[: full * bs], *output_ids[: max(0, full * bs - len(prompt_ids))]]
            keys = self.blocks.keys(s.tenant, ids, s.block_keys)
            self.blocks.insert(keys[done:], table.blocks[done:full], s.priority)
            s.block_keys = keys

    def restore(self, s: Session) -> None:
        """Bring the session's KV to the device (making room if needed)."""
        with self._lock:
            self._load(s)
            if s.tier is Tier.DEVICE:
                return
            t0 = time.perf_counter()
            src = s.tier
            came_from = Tier.DISK if s.disk_read_s is not None else src
            table = BlockTable(self.cfg.block_size)
            # Out of the RAM LRU first: making room pushes others into RAM, which must not
            # push this session out to disk under our feet.
            cached = self.ram.pop(s.key) is not None if src is Tier.RAM else False
            n, bs = s.num_computed, self.cfg.block_size
            # the blocks of its prefix still on the device (its own, cached, or another
            # session's) are shared; only the rest is copied
            keys = self.blocks.keys(s.tenant, s.token_ids[:n], s.block_keys) if n else []
            shared = self.blocks.acquire(keys, s.priority)
            table.adopt(self.blocks, shared)
            try:
                self._make_room(table.blocks_needed(n), exclude=s)
                table.ensure(self.blocks, n)
            except OutOfBlocksError:
                table.release(self.blocks)
                if cached:
                    assert s.host_kv is not None
                    self.ram.put(s.key, s.host_kv)
                raise
            if src is Tier.RAM:
                assert s.host_kv is not None
                start = len(shared) * bs
                rest = table.blocks[len(shared) :]
                scatter_from_host(self.kv_caches, s.host_kv[:, :, start:], rest, n - start, bs)
            if shared:
                self.observer.prefix_shared(len(shared) * bs)
            self.blocks.insert(keys, table.blocks, s.priority)
            s.block_keys = keys
            s.host_kv = None
            s.block_table, s.tier = table, Tier.DEVICE
            if came_from is not Tier.NONE:
                seconds = time.perf_counter() - t0 + (s.disk_read_s or 0.0)
                self.observer.restored(came_from.value, seconds)
                self.observer.session_moved(came_from.value, Tier.DEVICE.value, "restore")
            s.disk_read_s = None

    def ensure_blocks(self, s: Session, num_tokens: int) -> None:
        """Give a device session room for num_tokens tokens of KV, demoting idle sessions
        if needed; OutOfBlocksError when even that cannot make enough room."""
        with self._lock:
            assert s.tier is Tier.DEVICE and s.block_table is not None
            need = s.block_table.blocks_needed(num_tokens)
            if need > self.blocks.num_blocks:
                raise OutOfBlocksError(
                    f"{num_tokens} tokens need {need + len(s.block_table.blocks)} KV blocks; "
                    f"the device pool has {self.blocks.num_blocks}"
                )
            self._make_room(need, exclude=s)
            s.block_table.ensure(self.blocks, num_tokens)

    def blocks_to_hold(self, s: Session, num_tokens: int) -> int:
        """Device blocks s lacks to hold num_tokens (all of them when it is off the device:
        an estimate, a restore may share some)."""
        with self._lock:
            if s.tier is Tier.DEVICE and s.block_table is not None:
                return s.block_table.blocks_needed(num_tokens)
            return -(-num_tokens // self.cfg.block_size)

    def num_available_blocks(self) -> int:
        """Blocks an allocation could get: free ones, cached ones, and those that only idle
        unpinned device sessions hold (demoted on demand)."""
        with self._lock:
            n = self.blocks.num_free
            for s in self._sessions.values():
                if s.tier is Tier.DEVICE and not s.in_flight and not s.pinned:
                    assert s.block_table is not None
                    n += sum(1 for b in s.block_table.blocks if self.blocks.holders(b) == 1)
            return n

    def commit(self, s: Session, token_ids: Sequence[int], text: str, num_computed: int) -> None:
        """Record the session's state after (part of) a turn: KV exists for the first
        num_computed of token_ids, and `text` is exactly what token_ids stand for."""
        with self._lock:
            assert num_computed <= len(token_ids)
            s.token_ids, s.text = list(token_ids), text
            s.text_marks = valid_marks(s.text_marks, len(s.token_ids), len(text))
            s.num_computed = self._truncate_kv(s, num_computed)
            del s.block_keys[s.num_computed // self.cfg.block_size :]
            s.version = next(self._versions)
            s.last_used = time.time()

    def truncate(self, s: Session, num_tokens: int) -> None:
        """Roll back to the first num_tokens tokens (KV and token ids)."""
        with self._lock:
            del s.token_ids[num_tokens:]
            self._truncate_kv(s, min(num_tokens, s.num_computed))

    # ------------------------------------------------------------ tier moves

    def demote(self, s: Session, to: Tier, reason: str) -> None:
        """Move an idle session's KV down to RAM or disk."""
        assert to in (Tier.RAM, Tier.DISK)
        with self._lock:
            if s.tier is to or s.tier is Tier.NONE:
                return
            if s.tier is Tier.DISK:
                return  # already below `to`
            if s.tier is Tier.DEVICE:
                assert s.block_table is not None
                host = gather_to_host(
                    self.kv_caches, s.block_table.blocks, s.num_computed, self.cfg.block_size
                )
                s.block_table.release(self.blocks)
                s.block_table = None
                if to is Tier.RAM and self.ram.fits(nbytes(host)):
                    s.host_kv, s.tier = host, Tier.RAM
                    self.observer.session_moved("device", "ram", reason)
                    self.ram.put(s.key, host)  # may push LRU entries to disk
                    if self.writer and s.dirty_tokens:
                        self.writer.enqueue(s.key)
                    return
                s.host_kv, s.tier = host, Tier.RAM  # transiently, for _to_disk
                self.observer.session_moved("device", "ram", reason)
            else:
                self.ram.pop(s.key)
            self._to_disk(s, reason)

    def _to_disk(self, s: Session, reason: str) -> None:
        """RAM → disk for a session whose host copy is in s.host_kv (already out of the RAM
        LRU). Writes a snapshot if the newest one is stale; on failure the KV is lost."""
        host = s.host_kv
        assert host is not None
        s.host_kv = None
        written = False
        if self.order is not None:
            written = not s.dirty or self.order.write(self._snapshot(s, host), s.version)
        if written:
            s.num_persisted, s.persisted_version = s.num_computed, s.version
            s.tier, s.loaded = Tier.DISK, False
            s.token_ids, s.text = [], ""  # the snapshot holds them; read back on restore
            s.block_keys = []
            self.observer.session_moved("ram", "disk", reason)
        else:
            s.tier, s.num_computed, s.num_persisted = Tier.NONE, 0, 0
            self.observer.session_moved("ram", "none", reason)

    def _on_ram_evict(self, key: SessionKey, host: torch.Tensor) -> None:
        s = self._sessions.get(key)
        if s is None or s.tier is not Tier.RAM:
            return
        s.host_kv = host
        self._to_disk(s, "ram_full")

    def demote_all_but(self, keep: Session, reason: str) -> None:
        """Demote every idle device session except `keep` to RAM (serialized mode)."""
        with self._lock:
            for s in list(self._sessions.values()):
                if s is not keep and s.tier is Tier.DEVICE and not s.in_flight:
                    self.demote(s, Tier.RAM, reason)

    def _on_disk_evict(self, entry: DiskEntry) -> None:
        # Called by the disk tier (outside its own lock) when it deleted a snapshot to stay
        # within budget.
        key = (entry.tenant, entry.session_id)
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                return
            s.num_persisted, s.persisted_version = 0, -1
            if s.tier is Tier.DISK and not s.in_flight:
                del self._sessions[key]
                self.observer.session_moved("disk", "none", "disk_full")

    def _make_room(self, num_blocks: int, exclude: Session) -> None:
        """Demote LRU idle unpinned device sessions until num_blocks are free."""
        if self.blocks.num_free >= num_blocks:
            return
        victims = sorted(
            (
                s
                for s in self._sessions.values()
                if s.tier is Tier.DEVICE and not s.in_flight and not s.pinned and s is not exclude
            ),
            key=lambda s: s.last_used,
        )
        for victim in victims:
            if self.blocks.num_free >= num_blocks:
                return
            self.demote(victim, Tier.RAM, "pressure")
        if self.blocks.num_free < num_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {self.blocks.num_free} free and every other "
                "device session is in flight or pinned"
            )

    def _truncate_kv(self, s: Session, n: int) -> int:
        """Keep KV for the first n tokens; returns how many are kept (n, or n rounded down
        to a block when a shared partial block cannot be copied for want of room)."""
        if n >= s.num_computed:
            return n
        bs = self.cfg.block_size
        if s.tier is Tier.DEVICE:
            assert s.block_table is not None
            s.block_table.truncate(self.blocks, n)
            if n % bs and self.blocks.is_shared(s.block_table.blocks[-1]):
                n = self._copy_last_block(s, n)
        elif s.tier is Tier.RAM:
            assert s.host_kv is not None
            was_cached = self.ram.pop(s.key) is not None
            s.host_kv = s.host_kv[:, :, :n].clone()  # a clone frees the tail's memory
            if was_cached or self.ram.fits(nbytes(s.host_kv)):
                self.ram.put(s.key, s.host_kv)
        # DISK: the snapshot keeps more tokens than needed; restore copies only n.
        s.num_computed = n
        s.num_persisted = min(s.num_persisted, n)
        del s.block_keys[n // bs :]
        s.version = next(self._versions)
        return n

    def _copy_last_block(self, s: Session, n: int) -> int:
        """Copy-on-write: the session keeps writing into its last, partial block, which
        others share (a fork inside an indexed block). Without a free block, round down."""
        table = s.block_table
        assert table is not None
        try:
            (fresh,) = self.blocks.allocate(1)
        except OutOfBlocksError:
            n -= n % self.cfg.block_size
            table.truncate(self.blocks, n)
            return n
        old = table.blocks[-1]
        copy_block(self.kv_caches, old, fresh)
        table.truncate(self.blocks, n - n % self.cfg.block_size)  # drops `old`, new epoch
        table.blocks.append(fresh)
        return n

    def _load(self, s: Session) -> None:
        """Read a DISK session's snapshot into RAM (tokens, text and KV)."""
        if s.tier is not Tier.DISK:
            return
        assert self.disk is not None
        t0 = time.perf_counter()
        snap = self.disk.read(s.tenant, s.session_id)
        if snap is None:  # absent or quarantined (counted): start fresh
            s.token_ids, s.text, s.num_computed, s.num_persisted = [], "", 0, 0
            s.tier, s.loaded, s.persisted_version = Tier.NONE, True, -1
            s.version = next(self._versions)
            return
        n = min(s.num_computed, snap.header.num_kv_tokens)
        kv = [layer[:, :n] for layer in snap.kv]
        s.block_keys = []
        s.token_ids, s.text, s.loaded = snap.token_ids, snap.text, True
        if n < snap.header.num_kv_tokens:  # truncated while on disk: the text no longer fits
            s.token_ids, s.text = s.token_ids[:n], ""
        s.num_computed = n
        first = kv[0]
        host = host_buffer((len(kv), *first.shape), first.dtype, self.kv_caches[0].device)
        for layer, src in enumerate(kv):
            host[layer].copy_(src)
        # Held by the in-flight session only (not the RAM LRU): restore() moves it to the
        # device next; release() files it in RAM if no restore came.
        s.host_kv, s.tier = host, Tier.RAM
        s.disk_read_s = time.perf_counter() - t0

    def _snapshot(self, s: Session, host: torch.Tensor) -> Snapshot:
        return Snapshot.create(
            s.tenant,
            s.session_id,
            self.fingerprint,
            s.token_ids,
            s.text,
            [host[layer] for layer in range(host.shape[0])],
        )

    # ------------------------------------------------------------ persistence

    def persist(self, key: SessionKey) -> bool:
        """Write a snapshot of an idle session if it changed since the last one.
        Called from the writer thread and by flush(); the disk write runs unlocked."""
        if self.order is None:
            return False
        with self._lock:
            s = self._sessions.get(key)
            if s is None or s.in_flight or not s.dirty or s.tier not in (Tier.DEVICE, Tier.RAM):
                return False
            if s.tier is Tier.DEVICE:
                assert s.block_table is not None
                host = gather_to_host(
                    self.kv_caches, s.block_table.blocks, s.num_computed, self.cfg.block_size
                )
            else:
                assert s.host_kv is not None
                host = s.host_kv  # never modified in place: truncation replaces it
            snap, version, n = self._snapshot(s, host), s.version, s.num_computed
        if not self.order.write(snap, version):
            return False
        with self._lock:
            if self._sessions.get(key) is s and s.version == version:
                s.num_persisted, s.persisted_version = n, version
        return True

    def idle_dirty_keys(self, idle_s: float) -> list[SessionKey]:
        cutoff = time.time() - idle_s
        with self._lock:
            return [
                s.key
                for s in self._sessions.values()
                if not s.in_flight
                and not s.ephemeral
                and s.dirty
                and s.last_used < cutoff
                and s.tier in (Tier.DEVICE, Tier.RAM)
            ]

    def flush(self) -> int:
        """Persist every idle session that changed since its last snapshot; returns the
        number written. In-flight sessions are skipped (they persist when released)."""
        if self.writer:
            self.writer.drain()
        with self._lock:
            keys = [k for k, s in self._sessions.items() if not s.ephemeral and s.dirty]
        return sum(self.persist(k) for k in keys)

    def close(self) -> None:
        """Flush to disk and stop the writer (clean shutdown)."""
        self.flush()
        if self.writer:
            self.writer.stop()
        if self.disk:
            self.disk.close()

    # ------------------------------------------------------------ introspection / admin

    def list_sessions(
        self, tenant: str | None = None, tier: str | None = None
    ) -> list[SessionInfo]:
        """Sessions (not ephemeral ones), most recently used first."""
        with self._lock:
            infos = [
                s.info(self.kv_bytes_per_token)
                for s in self._sessions.values()
                if not s.ephemeral
                and (tenant is None or s.tenant == tenant)
                and (tier is None or s.tier.value == tier)
            ]
        return sorted(infos, key=lambda i: i.last_used, reverse=True)

    def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        with self._lock:
            s = self._sessions.get((tenant, session_id))
            return None if s is None or s.ephemeral else s.info(self.kv_bytes_per_token)

    def _idle(self, tenant: str, session_id: str) -> Session:
        s = self._sessions.get((tenant, session_id))
        if s is None or s.ephemeral:
            raise SessionNotFoundError(f"no session {session_id!r}")
        if s.in_flight:
            raise SessionBusyError(f"session {session_id!r} has a request in flight")
        return s

    def evict(self, tenant: str, session_id: str, to: str) -> SessionInfo:
        """Demote an idle session to 'ram' or 'disk' (pinned ones too: this is explicit)."""
        target = Tier(to)
        if target not in (Tier.RAM, Tier.DISK):
            raise ValueError(f"evict target must be 'ram' or 'disk', got {to!r}")
        if target is Tier.DISK and self.disk is None:
            raise ValueError("no disk tier is configured (--kv-disk-dir)")
        with self._lock:
            s = self._idle(tenant, session_id)
            self.demote(s, target, "admin")
            return s.info(self.kv_bytes_per_token)

    def drop(self, tenant: str, session_id: str) -> None:
        """Forget an idle session in every tier, its snapshot file included."""
        with self._lock:
            s = self._idle(tenant, session_id)
            self._discard(s)

    def _drop_kv(self, s: Session) -> None:
        """Forget the session's KV in every tier but disk (its tokens stay)."""
        if s.block_table is not None:
            s.block_table.release(self.blocks)
            s.block_table = None
        self.ram.pop(s.key)
        s.host_kv, s.tier, s.disk_read_s = None, Tier.NONE, None
        s.num_computed = 0
        s.block_keys = []

    def _discard(self, s: Session) -> None:
        self._drop_kv(s)
        self._sessions.pop(s.key, None)
        if self.order is not None and not s.ephemeral:
            self.order.drop(s.key, next(self._versions))

    def set_pinned(self, tenant: str, session_id: str, pinned: bool) -> SessionInfo:
        """Pinned sessions are never demoted by memory pressure."""
        with self._lock:
            s = self._sessions.get((tenant, session_id))
            if s is None or s.ephemeral:
                raise SessionNotFoundError(f"no session {session_id!r}")
            s.pinned = pinned
            return s.info(self.kv_bytes_per_token)

    def usage(self) -> PoolUsage:
        with self._lock:
            counts = {t: 0 for t in Tier}
            device_tokens = 0
            for s in self._sessions.values():
                counts[s.tier] += 1
                if s.tier is Tier.DEVICE:
                    device_tokens += s.num_computed
            index = self.blocks.usage()
            return PoolUsage(
                device_blocks_used=self.blocks.num_used,
                device_blocks_total=self.blocks.num_blocks,
                device_sessions=counts[Tier.DEVICE],
                device_bytes=device_tokens * self.kv_bytes_per_token,
                ram_sessions=counts[Tier.RAM],
                ram_bytes=self.ram.used_bytes,
                ram_budget_bytes=self.ram.budget_bytes,
                disk_sessions=counts[Tier.DISK],
                disk_bytes=self.disk.used_bytes if self.disk else 0,
                disk_budget_bytes=self.disk.budget_bytes if self.disk else 0,
                device_blocks_indexed=index.num_indexed,
                device_blocks_cached=index.num_cached,
                device_blocks_pinned=index.num_pinned,
            )

    def _check_keys(self, s: Session) -> None:
        """A device session's chain keys name its tokens, and a block it holds that the
        index knows is indexed under the key of the session's block at that place."""
        assert s.block_table is not None
        bs = self.cfg.block_size
        k = min(len(s.block_keys), len(s.token_ids) // bs) if s.loaded else 0
        assert s.block_keys[:k] == self.blocks.keys(s.tenant, s.token_ids[: k * bs]), s.key
        if not s.in_flight:  # a running request's keys may run ahead of the session's state
            assert len(s.block_keys) <= s.num_computed // bs, s.key
        for key, b in zip(s.block_keys, s.block_table.blocks):
            indexed = self.blocks.key_of(b)
            assert indexed is None or indexed == key, f"{s.key}: block {b} holds other tokens"

    def check_integrity(self) -> None:
        """Raise AssertionError if tiers, blocks, the block index and budgets disagree."""
        with self._lock:
            holders: Counter[int] = Counter()
            for s in self._sessions.values():
                assert s.num_computed <= max(len(s.token_ids), s.num_computed)
                if s.tier is Tier.DEVICE:
                    assert s.block_table is not None and s.host_kv is None
                    assert s.block_table.capacity >= s.num_computed
                    holders.update(s.block_table.blocks)
                    self._check_keys(s)
                else:
                    assert s.block_table is None, s.key
                if s.tier is Tier.RAM:
                    assert s.host_kv is not None and s.host_kv.shape[2] == s.num_computed
                if s.loaded:
                    assert s.num_computed <= len(s.token_ids), s.key
            self.blocks.check_integrity(dict(holders))  # refcounts == holders (+ index)
            for key in self.ram.lru_keys():
                assert self._sessions[key].tier is Tier.RAM, key
            assert self.ram.used_bytes <= max(self.ram.budget_bytes, 1)
            if self.disk:
                assert self.disk.used_bytes <= self.disk.budget_bytes
