"""Admission of a waiting request: bring its session up, match its prompt, check its fit.

The scheduler's build (sched/scheduler.py) walks the queue in order and asks `activate` for
each candidate; this module owns what makes a request ready to run: its session read ahead
and its text tokenized off the step thread, its lease acquired (bounded wait on a busy
session), its prompt matched against the session and validated, and its device blocks
checked against what the running requests still need (`Room`). It never touches the queue
or the running list.
"""

from __future__ import annotations

from collections.abc import Callable

from ds4pool.errors import ContextLengthError, OutOfBlocksError
from ds4pool.kv.pool import SessionPool
from ds4pool.kv.session import SessionBusyError
from ds4pool.model.runner import ModelRunner
from ds4pool.sched.config import SchedulerConfig, SchedulerObserver
from ds4pool.sched.prefix_wait import leader, may_lead
from ds4pool.sched.seq import Seq

# A request waits for at most this many bring-ups of its session (kv/prefetch.py). One can
# be undone by RAM pressure before admission, or not fit the RAM tier at all; then the step
# thread reads the snapshot itself rather than the prefetch thread reading it again.
MAX_READ_AHEADS = 1


class Room:
    """Admission's view of the device blocks in one build: a request is admitted only
    when its blocks fit beside what the running requests still need (blocks they share are
    theirs already, so they count once), unless it outranks a running request (which it
    may then preempt)."""

    def __init__(self, admission: Admission, running: list[Seq]) -> None:
        self.admission = admission
        self.running = running
        self.left: int | None = None  # computed on first use: most builds admit nobody
        self._idle_counted = False  # left counts the blocks idle sessions would give up
        self._leaders: list[Seq] = []
        self._leaders_of: tuple[int, int] | None = None  # the running list they were read from

    def leaders(self) -> list[Seq]:
        """The running requests a waiting prompt may wait for (sched/prefix_wait.py), read
        again whenever the running list changed: one admitted earlier in this build leads
        the prompts behind it."""
        of = (len(self.running), id(self.running[-1]) if self.running else 0)
        if of != self._leaders_of:
            self._leaders = [r for r in self.running if may_lead(r)]
            self._leaders_of = of
        return self._leaders

    def take(self, seq: Seq) -> None:
        running = [r for r in self.running if r.lease is not None]
        if not running or any(r.priority > seq.priority for r in running):
            return
        pool = self.admission.pool
        if self.left is None:
            # free and cached blocks first: counting what idle sessions hold walks every
            # block table (~6 ms a build at 64 agents on a 2-core VM), and a roomy device
            # admits a whole wave of resumed turns without it
            reserved = sum(self.admission.need(r) for r in running)
            self.left = pool.num_free_blocks() - reserved
        need = self.admission.need(seq)
        if need > self.left and not self._idle_counted:
            self._idle_counted = True  # the blocks idle sessions hold now (demoted on demand)
            self.left += pool.num_idle_blocks()
        if need > self.left:
            raise OutOfBlocksError(f"waits for {need} KV blocks, {self.left} left")
        self.left -= need


class Admission:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: SessionPool,
        runner: ModelRunner,
        observer: SchedulerObserver,
        encode: Callable[[str], list[int]],
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.runner = runner
        self.observer = observer
        self.encode = encode

    def room(self, running: list[Seq]) -> Room:
        """The fit check for one build (running: the scheduler's list, read, not changed)."""
        return Room(self, running)

    def activate(self, seq: Seq, now: float, room: Room) -> bool:
        """Acquire, match and restore the session of a waiting request. False if its
        session is busy with another request (it stays queued, bounded in time);
        OutOfBlocksError when its blocks do not fit beside the running requests'."""
        if seq.lease is None:
            # a disk session's snapshot is read on the prefetch thread, not on this one
            if self.pool.prefetching(seq.tenant, seq.req.session_id):
                return False
            # and a text prompt is tokenized on the pretokenize thread (sched/pretokenize.py)
            if seq.pieces is not None and not seq.pieces.done.is_set():
                return False
            # and a prompt another running request is computing the start of waits for it
            # to be indexed (sched/prefix_wait.py)
            if leader(seq, room.leaders(), self.pool.cfg.block_size) is not None:
                return False
            if seq.reads < MAX_READ_AHEADS and self.pool.prefetch(seq.tenant, seq.req.session_id):
                seq.reads += 1
                return False
            try:
                seq.lease = self.pool.acquire(seq.req.tenant, seq.req.session_id, timeout=0)
            except SessionBusyError:
                seq.blocked_since = seq.blocked_since or now
                if now - seq.blocked_since > self.cfg.session_wait_s:
                    raise
                return False
        lease = seq.lease
        assert lease is not None
        if self.cfg.serialized:
            self.pool.demote_all_but(lease, "serialized")
        matched = seq.admitted_at is None
        if matched:
            self.prepare(seq)
        try:
            room.take(seq)  # raises OutOfBlocksError: the request waits, nobody is preempted
        except OutOfBlocksError:
            if matched:
                lease.keep_prepared()  # its next prepare gives exactly these tokens again
            raise
        if seq.admitted_at is None:
            self.observer.admitted(now - seq.arrival)
            seq.admitted_at = now
        lease.restore()
        # A preempted request's KV can be lost while it waits (it did not fit in RAM and the
        # disk write failed, or there is no disk tier), and a restore may choose to recompute
        # it (kv/cost.py): recompute what the session lacks, and report it as computed.
        seq.num_computed = min(seq.num_computed, lease.num_computed)
        seq.num_reused = min(seq.num_reused, seq.num_computed)
        return True

    def prepare(self, seq: Seq) -> None:
        assert seq.lease is not None
        req = seq.req
        m = seq.lease.prepare(
            prompt_ids=req.prompt_ids,
            prompt_text=req.prompt_text,
            tokenize=seq.pieces.tokenize if seq.pieces is not None else self.encode,
            priority=req.priority,
        )
        limit = self.runner.max_model_len
        if len(m.token_ids) >= limit:
            raise ContextLengthError(
                f"prompt has {len(m.token_ids)} tokens; the model's context is {limit}"
            )
        if not m.token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.loaded.config.vocab_size
        if min(m.token_ids) < 0 or max(m.token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq.prompt_ids, seq.num_reused, seq.num_computed = m.token_ids, m.num_cached, m.num_cached
        seq.offered = m.num_cached
        seq.max_tokens = min(req.max_tokens, limit - len(m.token_ids))
        seq.start_decoding(self.runner.loaded.tokenizer, vocab)

    def need(self, seq: Seq) -> int:
        """Device blocks seq still needs for its prompt and one block of output."""
        assert seq.lease is not None
        return seq.lease.blocks_to_hold(seq.num_tokens + self.pool.cfg.block_size)
