"""SessionPool: (tenant, session id) → Session, with KV across device, RAM and disk tiers.

The facade the scheduler and the API call. Its roles live in their own modules:

    pool.py    leases (acquire / release), prefix matching, block growth, commit,
               the choice of which session moves (pressure, preemption), integrity
    sharing.py which blocks a session shares through the block index (index.py)
    tiers.py   the moves themselves (demote, to disk, load, restore copies) and snapshots
    persist.py the writer thread and the ordering of snapshot writes
    admin.py   list / show / evict / drop / pin / usage for the API and metrics

- Device blocks are needed → the least recently used idle, unpinned device session is
  demoted to RAM (in-flight sessions never are).
The KV tensors and their layout come in as a `DeviceKV` (kv/ never imports the model).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.admin import SessionAdmin
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.kv.blockstore import index_secret
from ds4pool.kv.config import PoolConfig, PoolObserver, PoolUsage
from ds4pool.kv.cost import RestoreCost, RestorePolicy
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.prefetch import Prefetcher
from ds4pool.kv.prefix import TextMark, resume_point, valid_marks
from ds4pool.kv.restore_plan import RestorePlanner
from ds4pool.kv.session import (
    PrefixMatch,
    Session,
    SessionBusyError,
    SessionInfo,
    SessionKey,
    Tier,
    validate_session_id,
)
from ds4pool.kv.sharing import PrefixInfo, PrefixSharing
from ds4pool.kv.snapshot import ModelFingerprint
from ds4pool.kv.tiers import Tiers
from ds4pool.kv.transfer import DeviceKV

__all__ = ["DeviceKV", "PoolConfig", "PoolObserver", "PoolUsage", "SessionPool"]


class SessionPool:
    def __init__(
        self,
        cfg: PoolConfig,
        kv: DeviceKV,
        fingerprint: ModelFingerprint,
        observer: PoolObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv_caches = kv.caches
        self.fingerprint = fingerprint
        self.observer = observer or PoolObserver()
        # block tables allocate through the index: it keeps full blocks nobody holds cached
        # (kv/index.py) and evicts them when the device needs room. With a disk tier its salt
        # secret lives there: block files are named by chain key, stable across restarts.
        self.blocks = BlockIndex(
            BlockPool(cfg.num_device_blocks),
            cfg.block_size,
            secret=index_secret(cfg.disk_dir) if cfg.disk_dir is not None else None,
            on_evict=self.observer.blocks_evicted,
        )
        self.sharing = PrefixSharing(self.blocks, kv, cfg.block_size, self.observer)
        self.kv_bytes_per_token = kv.layout.bytes_per_token
        # read a returning session's KV back or recompute it (kv/cost.py); the worker feeds
        # it the steps' prefill rate, the planner's restores the tiers' read rates
        self.cost = RestoreCost(RestorePolicy(cfg.restore_policy))
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sessions: dict[SessionKey, Session] = {}
        self._versions = itertools.count(1)
        self.prefetcher = Prefetcher(self._bring_up)  # and the reaper of host tensors
        self.tiers = Tiers(
            cfg,
            kv,
            self.blocks,
            fingerprint,
            self.observer,
            self._sessions,
            self._cond,
            lambda: next(self._versions),
            self.prefetcher.reap,
        )
        self.admin = SessionAdmin(
            self._sessions, self._cond, self.tiers, self.blocks, self._discard
        )
        self.planner = RestorePlanner(
            self.cost, self.tiers, kv, self.observer, cfg.block_size, lambda: next(self._versions)
        )
        # the tiers' parts, as callers and tests know them
        self.ram, self.disk, self.writer = self.tiers.ram, self.tiers.disk, self.tiers.writer

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

    def prefetch(self, tenant: str, session_id: str | None) -> bool:
        """Start bringing an idle disk or RAM session up ahead of its request, on the
        prefetch thread (kv/prefetch.py); True if one is queued or running now. Admit the
        request once `prefetching` is False: its restore then has nothing (or only the host
        → device copy) left."""
        if session_id is None:
            return False
        key = (tenant, session_id)
        with self._lock:
            s = self._sessions.get(key)
            if s is not None and s.tier in (Tier.DISK, Tier.RAM) and not s.in_flight:
                self.prefetcher.request(key)
        return self.prefetcher.pending(key)

    def prefetching(self, tenant: str, session_id: str | None) -> bool:
        """True while a bring-up of the session is queued or running."""
        return session_id is not None and self.prefetcher.pending((tenant, session_id))

    def _bring_up(self, key: SessionKey) -> None:
        with self._lock:
            read_kv = self.planner.reads_disk(self._sessions.get(key))  # or recompute it
        self.tiers.read_ahead(key, kv=read_kv)
        self.restore_ahead(key)

    def release(self, s: Session) -> None:
        """End the request's lease; ephemeral sessions are discarded."""
        with self._cond:
            s.in_flight = False
            s.last_used = time.time()
            if s.tier is Tier.RAM and s.key not in self.ram and not s.ephemeral:
                self.tiers.file_in_ram(s)  # read from disk, then the request ended before restore
            if s.ephemeral:
                self._discard(s)
            elif (
                self.writer
                and self.cfg.persist_every_tokens
                and s.dirty_tokens >= self.cfg.persist_every_tokens
            ):
                self.writer.enqueue(s.key)
            self._cond.notify_all()

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
        (another session's system prompt, this session's other branch), the session takes
        those blocks instead (kv/sharing.py)."""
        assert s.in_flight
        assert prompt_ids is not None or (prompt_text is not None and tokenize is not None)
        with self._lock:
            self.tiers.load(s)
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
            s.text_marks = list(dict.fromkeys(marks))  # a request matched again repeats some
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
            reuse = self._truncate_kv(s, reuse)  # less when a shared half block cannot be copied
            s.token_ids = ids[:reuse]
            own = reuse
            chain = self.sharing.chain_for(s, ids, reuse)
            if chain:
                persisted = min(s.num_persisted, reuse)
                self._drop_kv(s)
                reuse = self.sharing.adopt(s, ids, chain)
                s.num_persisted, s.version = persisted, next(self._versions)
            if reuse:
                s.hits += 1
            return PrefixMatch(
                token_ids=ids, num_reused=reuse, via_text=via_text, num_shared=reuse - own
            )

    def index_blocks(
        self, s: Session, prompt_ids: Sequence[int], output_ids: Sequence[int], num_computed: int
    ) -> None:
        """Share the full blocks a running request has computed (its tokens are prompt_ids +
        output_ids, the first num_computed with KV): a prompt admitted next finds them."""
        with self._lock:
            self.sharing.offer(s, prompt_ids, output_ids, num_computed)

    def restore(self, s: Session) -> None:
        """Bring the session's KV to the device (making room if needed)."""
        with self._lock:
            self.tiers.load(s)
            if s.tier is Tier.DEVICE:
                return
            move = self.tiers.begin_restore(s)
            table = BlockTable(self.cfg.block_size)
            shared = self.sharing.share_for_restore(s, table)  # only the rest is copied
            try:
                self._make_room(table.blocks_needed(s.num_computed), exclude=s)
                table.ensure(self.blocks, s.num_computed)
            except OutOfBlocksError:
                table.release(self.blocks)
                self.tiers.abort_restore(s, move)
                raise
            move = self.planner.plan_copy(s, move, shared)  # copy the rest, or recompute it
            self.planner.copy_in(s, move, table, shared)
            self.tiers.finish_restore(s, move, table, start=shared, copied=True)
            self.sharing.restored_into(s, table)

    def restore_ahead(self, key: SessionKey) -> None:
        """Put an idle RAM session's KV on the device now, on the calling (prefetch) thread,
        if free blocks allow it without demoting anyone; its request's restore() then finds
        it there. The copy runs without the pool lock, the session leased meanwhile."""
        with self._cond:
            s = self._sessions.get(key)
            if s is None or s.in_flight or s.tier is not Tier.RAM or s.host_kv is None:
                return
            table = BlockTable(self.cfg.block_size)
            if table.blocks_needed(s.num_computed) > self.blocks.num_free:
                return  # no room without demotions: the step thread's restore decides
            if not self.planner.reads_ahead(s):
                return  # to be recomputed: the step thread's restore decides it
            move = self.tiers.begin_restore(s)
            shared = self.sharing.share_for_restore(s, table)  # only the rest is copied
            table.ensure(self.blocks, s.num_computed)
            s.block_table = table  # held by the session while copying (check_integrity)
            s.in_flight = s.copying = True
        try:
            self.planner.copy_in(s, move, table, shared)
        except BaseException:
            with self._cond:
                table.release(self.blocks)
                s.block_table = None
                self.tiers.abort_restore(s, move)
                s.in_flight = s.copying = False
                self._cond.notify_all()
            raise
        with self._cond:
            self.tiers.finish_restore(s, move, table, start=shared, copied=True)
            self.sharing.restored_into(s, table)
            s.in_flight = s.copying = False
            self._cond.notify_all()

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
        with self._lock:
            self.tiers.demote(s, to, reason)

    def demote_all_but(self, keep: Session, reason: str) -> None:
        """Demote every idle device session except `keep` to RAM (serialized mode)."""
        with self._lock:
            for s in list(self._sessions.values()):
                if s is not keep and s.tier is Tier.DEVICE and not s.in_flight:
                    self.tiers.demote(s, Tier.RAM, reason)

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
            self.tiers.demote(victim, Tier.RAM, "pressure")
        if self.blocks.num_free < num_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {self.blocks.num_free} free and every other "
                "device session is in flight or pinned"
            )

    def _truncate_kv(self, s: Session, n: int) -> int:
        """Keep KV for the first n tokens; returns how many are kept (see sharing.truncate)."""
        if n >= s.num_computed:
            return n
        if s.tier is Tier.DEVICE:
            n = self.sharing.truncate(s, n)
        elif s.tier is Tier.RAM:
            self.tiers.truncate_host(s, n)
        # DISK: the snapshot keeps more tokens than needed; restore copies only n.
        s.num_computed = n
        s.num_persisted = min(s.num_persisted, n)
        del s.block_keys[n // self.cfg.block_size :]
        s.version = next(self._versions)
        return n

    def _drop_kv(self, s: Session) -> None:
        """Let go of the session's device blocks and host copy (its tokens and snapshot stay)."""
        if s.block_table is not None:
            s.block_table.release(self.blocks)
            s.block_table = None
        self.tiers.ram.pop(s.key)
        s.host_kv, s.tier, s.disk_read_s = None, Tier.NONE, None
        s.num_computed, s.block_keys = 0, []

    def _discard(self, s: Session) -> None:
        self._drop_kv(s)
        self.tiers.forget(s)
        self._sessions.pop(s.key, None)

    # ------------------------------------------------------------ persistence

    def persist(self, key: SessionKey) -> bool:
        return self.tiers.persist(key)

    def idle_dirty_keys(self, idle_s: float) -> list[SessionKey]:
        return self.tiers.idle_dirty_keys(idle_s)

    def flush(self) -> int:
        return self.tiers.flush()

    def close(self) -> None:
        """Stop bringing sessions up, flush to disk, stop the writer (clean shutdown)."""
        self.prefetcher.stop()
        self.tiers.close()

    # ------------------------------------------------------------ introspection / admin

    def list_sessions(
        self, tenant: str | None = None, tier: str | None = None
    ) -> list[SessionInfo]:
        return self.admin.list_sessions(tenant, tier)

    def get(self, tenant: str, session_id: str) -> SessionInfo | None:
        return self.admin.get(tenant, session_id)

    def evict(self, tenant: str, session_id: str, to: str) -> SessionInfo:
        return self.admin.evict(tenant, session_id, to)

    def drop(self, tenant: str, session_id: str) -> None:
        self.admin.drop(tenant, session_id)

    def set_pinned(self, tenant: str, session_id: str, pinned: bool) -> SessionInfo:
        return self.admin.set_pinned(tenant, session_id, pinned)

    def usage(self) -> PoolUsage:
        return self.admin.usage()

    def pin_prefix(self, tenant: str, token_ids: Sequence[int]) -> PrefixInfo:
        """Pin a prefix's blocks (kv/sharing.py); the engine computes it if it is not there."""
        with self._lock:
            return self.sharing.pin(tenant, token_ids)

    def unpin_prefix(self, prefix_id: str) -> PrefixInfo:
        with self._lock:
            return self.sharing.unpin(prefix_id)

    def prefix(self, prefix_id: str) -> PrefixInfo:
        with self._lock:
            return self.sharing.info(prefix_id)

    def drop_cached_blocks(self) -> int:
        """Evict every cached block (indexed, held by no session); returns how many."""
        with self._lock:
            return self.blocks.evict_all()

    def pinned_prefixes(self) -> list[PrefixInfo]:
        with self._lock:
            return self.sharing.pins()

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
                    self.sharing.check(s)
                elif s.copying and s.block_table is not None:  # restore_ahead under way
                    assert s.tier is Tier.RAM and s.in_flight
                    holders.update(s.block_table.blocks)
                else:
                    assert s.block_table is None, s.key
                if s.tier is Tier.RAM:
                    assert s.host_kv is not None and s.host_kv.shape[2] == s.num_computed
                if s.loaded:
                    assert s.num_computed <= len(s.token_ids), s.key
            self.blocks.check_integrity(dict(holders))  # refcounts == holders (+ the index)
            for key in self.tiers.ram.lru_keys():
                assert self._sessions[key].tier is Tier.RAM, key
            assert self.tiers.ram.used_bytes <= max(self.tiers.ram.budget_bytes, 1)
            if self.tiers.disk:
                assert self.tiers.disk.used_bytes <= self.tiers.disk.budget_bytes
                self.tiers.disk.check_integrity()  # block files' reference counts
