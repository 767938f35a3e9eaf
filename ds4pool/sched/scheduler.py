"""Stage 1 (enqueue) and stages 2 and 4 (build a step, write its results back).

There is no prefill phase and no decode phase: every running request has
`num_computed` catching up to `num_tokens` (prompt tokens, then each sampled token).
A step takes one token from each request that is decoding, then prompt chunks of
running and newly admitted requests, under `max_batch_tokens` and `max_batch_size`.
While any request decodes, prompt chunks also share `max_prefill_tokens` and, with
`prefill_cost`, a budget of work that counts their attention over the context
(sched/prefill_cost.py), lowered to what a decoder's ITL affords by sched/step_time.py: a
step's length is set by its prefill work, and every decoder waits for the whole step.
`prefill_burst` B > 1 lets up to B x those caps into a step, but only as prompts' last
chunks that would each fit the single caps alone: when many short prompts wait (agents'
resumed turns ending together), B of them start per step instead of one or two, while a
long prompt still advances by the single caps (its chunks do not end it) and its decoders'
gaps stay as they were. A burst step lasts longer, but the decoders lose no throughput over
the steps it replaces (the same prompt work, in fewer steps) and the prompts queue less
(vLLM's long-prefill threshold next to a larger step budget is the same idea). This
module decides who runs, reserves blocks, preempts and finishes; a waiting request is made
ready by sched/admission.py, a step's rows are sized and assembled by sched/step.py, its
results are written back by sched/writeback.py (in two halves, so the worker can overlap
the second with the next step).

Locks: `self.lock` guards the waiting queue (submissions only ever take it); the
running list is the worker thread's alone. The engine lock (stage 3) is the worker's.
"""

from __future__ import annotations

import itertools
import threading
import time

from ds4pool.errors import Ds4poolError, OutOfBlocksError
from ds4pool.kv.cost import StepSample
from ds4pool.kv.lease import BlocksNeverFitError
from ds4pool.kv.pool import SessionPool
from ds4pool.kv.session import SessionBusyError, Tier
from ds4pool.model.runner import ModelRunner, StepOutput
from ds4pool.sched.admission import Admission
from ds4pool.sched.ahead import ahead_rows, build_ahead
from ds4pool.sched.config import SchedulerConfig, SchedulerObserver
from ds4pool.sched.pretokenize import Pretokenizer, PromptPieces
from ds4pool.sched.queue import FairQueue
from ds4pool.sched.request import Event, QueueFullError, Request, RequestStream, State
from ds4pool.sched.seq import Seq
from ds4pool.sched.step import Step
from ds4pool.sched.step_time import StepTime
from ds4pool.sched.writeback import Pending, Writeback

MAX_PRIORITY = (1 << 31) - 1  # |priority| bound; lower runs first


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: SessionPool,
        runner: ModelRunner,
        observer: SchedulerObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.runner = runner
        self.tokenizer = runner.loaded.tokenizer
        self.observer = observer or SchedulerObserver()
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.queue = FairQueue(cfg.queue)
        self.running: list[Seq] = []
        self.accepting = True
        self._max_running = 1 if cfg.serialized else cfg.max_batch_size
        self._seq_ids = itertools.count(1)  # identities for the runner's input batch
        # running in build order, and the running list it was sorted from (ids): decoding
        # keeps the same set step after step, and a sort per step visits every row
        self._order: list[Seq] = []
        self._order_of: tuple[int, ...] = ()
        self.pretokenizer = Pretokenizer(pool.text_resume, pool.prefetching)
        self.admission = Admission(cfg, pool, runner, self.observer, self._encode)
        self.writeback = Writeback(
            frozenset(self.tokenizer.eos_token_ids), self.observer, self._finish
        )
        self.step_time = StepTime(cfg.itl_budget_factor)  # the worker's thread only

    def close(self) -> None:
        """Stop the helper threads of stage 1 (after the worker has stopped)."""
        self.pretokenizer.stop()

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------ stage 1: enqueue

    def submit(self, req: Request) -> RequestStream:
        """Queue a request; raises QueueFullError at once beyond the admission limits."""
        if req.prompt_ids is None and req.prompt_text is None:
            raise ValueError("a request needs prompt_ids or prompt_text")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not -MAX_PRIORITY <= req.priority <= MAX_PRIORITY:
            # the queue ages priorities as floats: a huge int would fail every step
            raise ValueError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        stream = RequestStream(req)
        seq = Seq(req, stream, seq_id=next(self._seq_ids))
        if req.prompt_text is not None:
            seq.pieces = PromptPieces(req.prompt_text, self._encode)
        with self.wakeup:
            if not self.accepting:
                self.observer.rejected("draining")
                raise QueueFullError("the server is shutting down", 5.0, "draining")
            try:
                self.queue.push(seq)
            except QueueFullError as exc:
                self.observer.rejected(exc.reason)
                raise
            self.wakeup.notify_all()
        if self.pool.prefetch(req.tenant, req.session_id):  # a disk session: read it ahead
            seq.reads = 1
        if seq.pieces is not None:  # its text is tokenized off the step thread
            self.pretokenizer.submit(req.tenant, req.session_id, seq.pieces)
        return stream

    def has_work(self) -> bool:
        return bool(self.running) or len(self.queue) > 0

    # ------------------------------------------------------------ stage 2: build

    def schedule(self) -> Step | None:
        """Build the next step, or None if nothing can run now."""
        self._drop_cancelled()
        step = Step([], [], [])
        # Decodes first (they keep their pace), then prompt chunks; higher priority first.
        order = self._build_order()
        budget = self._take_decodes(
            step, [s for s in order if s.num_pending == 1], self.cfg.max_batch_tokens
        )
        if step.seqs:  # someone decodes: prompt chunks share the smaller prefill budget
            extra = self.cfg.prefill_burst - 1  # ... and short prompts' last chunks more
            budget = min(budget, self.cfg.max_prefill_tokens * (1 + extra))
            step.tokens_left = step.cap_tokens = self.cfg.max_prefill_tokens
            step.burst_tokens = self.cfg.max_prefill_tokens * extra
            cost = self.cfg.prefill_cost
            if cost is not None:  # decoders' KV: before this step's token
                cap = cost.step_budget([s.num_computed for s in step.seqs])
                # ... and what a decoder's ITL affords, from measured step times
                step.work_left = self.step_time.budget(
                    len(step.seqs), cap, cost.cost(0, cost.min_chunk)
                )
                step.cap_work, step.burst_work = step.work_left, step.work_left * extra
                self.observer.prefill_budget(step.work_left)
        budget = self._take(step, [s for s in order if s.num_pending > 1], budget)
        self._admit(step, budget)
        self._charge(step)
        if step.burst_chunks:
            self.observer.prefill_burst(step.burst_chunks)
        return step if step.seqs else None

    def schedule_ahead(self, prev: Step) -> Step | None:
        """The step after `prev` (in flight, not read back) if nothing but prev's own tokens
        can change it: its decode rows one position on, ids fed on the device (sched/ahead.py);
        None: build the next step from prev's results (`schedule`)."""
        rows = ahead_rows(prev, self.running, len(self.queue), self.writeback.late)
        if rows is None:
            return None
        step = build_ahead(prev, rows)
        if step is not None:
            self._charge(step)
        return step

    def _build_order(self) -> list[Seq]:
        """The running requests by (priority, arrival), sorted again only when the running
        list changed (the ids in the key stay unique: the cached list holds the seqs)."""
        of = tuple(map(id, self.running))
        if of != self._order_of:
            self._order = sorted(self.running, key=lambda s: (s.priority, s.arrival))
            self._order_of = of
        return self._order

    def _take_decodes(self, step: Step, seqs: list[Seq], budget: int) -> int:
        """`_take` for rows of one token each (every step's decode rows): the same rows and
        reservations, without the chunk sizing a one-token row does not need."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq.state is not State.RUNNING:  # preempted by an earlier _reserve
                continue
            assert seq.lease is not None
            # has_room: no lock for a row whose last block has room (most of them)
            if seq.lease.has_room(seq.num_computed + 1) or self._reserve(seq, 1, step):
                self._add(step, seq, 1)
                budget -= 1
        return budget

    def _charge(self, step: Step) -> None:
        """Charge the queue with the step's rows added so far: one lock for all of them, the
        same additions in the same order as a charge per row. Before anything reads the
        queue's virtual times (a requeue, the admission order) and at the end of the build."""
        if step.uncharged:
            with self.lock:
                self.queue.charge_rows(step.uncharged)
            step.uncharged.clear()

    def _take(self, step: Step, seqs: list[Seq], budget: int) -> int:
        """Adds up to `budget` tokens of running seqs, in order; returns the budget left."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq.state is not State.RUNNING:  # preempted by an earlier _reserve
                continue
            n = step.chunk_len(seq, budget, self.cfg.prefill_cost)
            if n and self._reserve(seq, n, step):
                self._add(step, seq, n)
                budget -= n
        return budget

    def _reserve(self, seq: Seq, n: int, step: Step) -> bool:
        """Blocks for n more tokens of seq; preempts lower-priority running requests
        (their KV goes to RAM, they requeue and resume later without recomputation)."""
        assert seq.lease is not None
        while True:
            try:
                seq.lease.reserve(seq.num_computed + n)
                return True
            except BlocksNeverFitError as exc:  # can never fit: fail, don't loop
                self._finish(seq, "error", error=str(exc), error_type="invalid_request")
                return False
            except OutOfBlocksError as exc:
                # the one to yield: lowest priority, newest first (admission keeps this rare
                # between requests of one priority)
                victims = [
                    s
                    for s in self.running
                    if s is not seq
                    and s not in step.seqs
                    and s.state is State.RUNNING
                    and (s.priority, s.arrival) > (seq.priority, seq.arrival)
                ]
                self._charge(step)  # a preempted request requeues at the virtual times so far
                if victims:
                    self._preempt(max(victims, key=lambda s: (s.priority, s.arrival)))
                elif step.seqs or len(self.running) > 1:
                    self._preempt(seq)  # wait for the others to finish
                    return False
                else:
                    self._finish(seq, "error", error=str(exc), error_type="invalid_request")
                    return False

    def _preempt(self, seq: Seq) -> None:
        if self.writeback.settle_first(seq):
            return
        assert seq.lease is not None
        self._sync_session(seq)
        seq.lease.demote(Tier.RAM, "preempt")  # it keeps the lease while it waits
        seq.state = State.WAITING
        self.running.remove(seq)
        with self.lock:
            self.queue.push(seq, force=True)
        self.observer.preempted()

    def _admit(self, step: Step, budget: int) -> None:
        self._charge(step)  # the order below reads the virtual times
        with self.lock:
            candidates = list(self.queue.ordered())
        now = time.monotonic()
        room = self.admission.room(self.running)
        for seq in candidates:
            if budget <= 0 or len(self.running) >= self._max_running:
                return
            if seq.stream.cancelled or (seq.req.deadline and now > seq.req.deadline):
                self._dequeue(seq)
                self._finish(seq, "cancelled")
                continue
            try:
                if not self.admission.activate(seq, now, room):
                    continue
            except OutOfBlocksError:
                if seq.lease is not None and seq.admitted_at is None:
                    seq.lease.release()  # it keeps its place in the queue
                    seq.lease = None
                return
            except SessionBusyError as exc:
                self._dequeue(seq)
                self._finish(seq, "error", error=str(exc), error_type="busy")
                continue
            except (Ds4poolError, ValueError) as exc:
                self._dequeue(seq)
                self._finish(seq, "error", error=str(exc), error_type="invalid_request")
                continue
            self._dequeue(seq)
            seq.state = State.RUNNING
            self.running.append(seq)
            n = step.chunk_len(seq, budget, self.cfg.prefill_cost)
            if not n:
                # no room left in this step for its prompt: the requests behind it wait for
                # the next build, whose step has room (admitting them now would only put
                # their session matching, 0.2-1 ms each, before this step's launch: a
                # wave of 32 turns held an H200's first wave step 15-35 ms, run L)
                return
            if self._reserve(seq, n, step):
                self._add(step, seq, n)
                budget -= n

    def _dequeue(self, seq: Seq) -> None:
        with self.lock:
            self.queue.remove(seq)

    def _add(self, step: Step, seq: Seq, n: int) -> None:
        """Puts seq's next n tokens in the step (charged to its tenant by `_charge`), unless
        its grammar allows no next token: that ends it."""
        grammar = seq.grammar
        bitmask = None
        if grammar is not None:
            if seq.num_computed + n == seq.num_tokens:
                bitmask = grammar.fill()
            if grammar.dead_end:
                error = (
                    "the requested output format (response_format, tool_choice) allows no "
                    "next token"
                )
                self._finish(seq, "error", error=error, error_type="invalid_request")
                return
        step.add(seq, n, bitmask)

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for seq in list(self.running):
            if seq.stream.cancelled or (seq.req.deadline and now > seq.req.deadline):
                self._finish(seq, "cancelled")

    # ------------------------------------------------------------ stage 4: writeback

    # stage 4 is sched/writeback.py's; the worker calls these (the overlapped loop splits
    # a step's writeback around the next launch: advance, schedule + launch, settle)

    def observe_step(self, sample: StepSample) -> None:
        """A step's measured cost: the restore-vs-recompute rates and the ITL budget's."""
        self.pool.cost.observe_step(sample)
        self.step_time.observe(sample)

    def process(self, step: Step, out: StepOutput) -> None:
        """The whole writeback of a step, nothing in flight (the synchronous loop)."""
        self.settle(self.advance(step, out), in_flight=False)

    def advance(self, step: Step, out: StepOutput, held: Step | None = None) -> list[Pending]:
        """`held`: the step launched ahead of this writeback, in flight (schedule_ahead)."""
        ids = frozenset(s.seq_id for s in held.seqs) if held is not None else frozenset()
        return self.writeback.advance(step, out, ids)

    def settle(self, pending: list[Pending], in_flight: bool) -> None:
        self.writeback.settle(pending, in_flight)

    def finish_late(self) -> None:
        self.writeback.finish_late()

    def fail(self, step: Step, exc: BaseException) -> None:
        """The step raised: every request in it fails and its session goes back to the
        state it had before the request (KV length == token count)."""
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for seq in step.seqs:
            if seq.state is State.RUNNING:
                self._finish(
                    seq,
                    "error",
                    error=f"inference step failed: {first}",
                    error_type="internal",
                    rollback=True,
                )

    def abort_running(self, exc: BaseException) -> None:
        """Last resort after an unexpected error: fail every running request (sessions
        rolled back) so that no client waits forever."""
        self.fail(Step(list(self.running), [], []), exc)

    def _sync_session(self, seq: Seq) -> None:
        assert seq.lease is not None
        # The text must stand exactly for the tokens: only when the prompt came as text.
        text = ""
        if seq.req.prompt_text is not None:
            text = seq.req.prompt_text + self.tokenizer.decode(seq.output_ids)
        seq.lease.commit(seq.all_ids, text, seq.num_computed)

    def _finish(
        self,
        seq: Seq,
        reason: str,
        *,
        error: str | None = None,
        error_type: str | None = None,
        token_ids: tuple[int, ...] = (),
        rollback: bool = False,
    ) -> None:
        if self.writeback.settle_first(seq):
            return
        if seq.lease is not None:
            if rollback:
                seq.lease.rollback()
            elif seq.admitted_at is not None:
                self._sync_session(seq)
            seq.lease.release()
            seq.lease = None
        if seq in self.running:
            self.running.remove(seq)
        seq.state = State.FINISHED
        if error is not None:
            seq.stream.push(
                Event(finish_reason="error", error=error, error_type=error_type, usage=seq.usage())
            )
        else:
            # never admitted (cancelled or past its deadline while queued): still report usage,
            # the API builds every final response from it
            ev = (
                seq.event(token_ids, reason)
                if seq.decoder
                else Event(finish_reason=reason, usage=seq.usage())
            )
            seq.stream.push(ev)
        self.observer.finished(seq, reason)
