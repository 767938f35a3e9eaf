"""Stage 4, writing a step's results back, in two halves around the next step's launch.

    advance   what the next build needs: num_computed, the token appended, the grammar's
              accept, end of sequence and max_tokens (a request that ends here ends here)
    settle    the rest: KV offered for sharing, detokenization, stop strings, the stream
              event, the observer

The synchronous loop runs both after its step (`Scheduler.process`). The overlapped loop
(sched/worker.py) runs advance N, builds and launches N+1, then settles N while the device
runs N+1. A request a stop string ends in that settle is in N+1 already: it is finished by
`finish_late` once N+1 has been waited (before N+1 is advanced, so its N+1 row is
discarded), never while a step that writes its blocks is in flight. A request that the build
finishes or preempts before its row is settled is settled first (`settle_first`), as the
synchronous loop would have done already: what users get is the same in both loops.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from ds4pool.model.runner import StepOutput
from ds4pool.sched.config import SchedulerObserver
from ds4pool.sched.request import State
from ds4pool.sched.seq import Seq
from ds4pool.sched.step import Step


class Finish(Protocol):  # Scheduler._finish
    def __call__(
        self,
        seq: Seq,
        reason: str,
        *,
        error: str | None = None,
        error_type: str | None = None,
        token_ids: tuple[int, ...] = (),
    ) -> None: ...


@dataclass(slots=True)  # one per row per step: not frozen (see SeqInput)
class Pending:
    """One row of a step advanced (counts, token accepted) and not settled yet."""

    seq: Seq
    token: int | None  # None: a prompt chunk that does not sample
    first: bool  # its first token
    gap: float  # seconds since its previous token (or its arrival, for the first)


class Writeback:
    def __init__(
        self, eos_ids: frozenset[int], observer: SchedulerObserver, finish: Finish
    ) -> None:
        self.eos_ids = eos_ids
        self.observer = observer
        self.finish = finish  # ends a request: commits its session, releases its lease
        self._unsettled: dict[int, Pending] = {}  # by seq_id: advanced, not settled
        # ended (a stop string; with a step launched ahead, any reason) under a step in flight
        self._late: list[tuple[Seq, int, str]] = []

    def advance(
        self, step: Step, out: StepOutput, held: Collection[int] = frozenset()
    ) -> list[Pending]:
        """The first half of a step's writeback; returns the rows left for `settle`. Rows
        of requests no longer running (ended by `finish_late`) are discarded. `held`: the
        seq_ids of the step in flight (launched ahead of this writeback): a request of it
        that ends here is finished by `finish_late`, once that step has been waited."""
        pending = []
        for seq, n, token in zip(step.seqs, step.counts, out.sampled):
            if seq.state is not State.RUNNING:
                continue
            seq.num_computed += n
            assert seq.lease is not None
            if token is None:
                p = Pending(seq, None, False, 0.0)
            else:
                first = seq.first_token_at is None
                prev = seq.last_token_at or seq.arrival
                reason = seq.accept(token, self.eos_ids)
                assert seq.last_token_at is not None
                p = Pending(seq, token, first, seq.last_token_at - (seq.arrival if first else prev))
                if reason is not None or seq.out_of_tokens:  # it ends here: nothing deferred
                    self._settle(p, reason, in_flight=seq.seq_id in held)
                    continue
            self._unsettled[seq.seq_id] = p
            pending.append(p)
        return pending

    def settle(self, pending: list[Pending], in_flight: bool) -> None:
        """The second half. `in_flight`: the next step runs (it may hold these requests), so
        a request a stop string ends now is finished by `finish_late`."""
        for p in pending:
            if self._unsettled.pop(p.seq.seq_id, None) is p:  # else settled by settle_first
                self._settle(p, None, in_flight)

    def finish_late(self) -> None:
        """Finish the requests `settle` found done while a step was in flight (call once
        that step has been waited: nothing writes their blocks any more)."""
        late, self._late = self._late, []
        for seq, token, reason in late:
            if seq.state is State.RUNNING:
                self.finish(seq, reason, token_ids=self._shown(token))

    @property
    def late(self) -> set[int]:
        """seq_ids of the requests waiting in `finish_late`."""
        return {seq.seq_id for seq, _, _ in self._late}

    def settle_first(self, seq: Seq) -> bool:
        """Before a request is finished or preempted by anything else: settle its row left
        from the last step. True if that ended it (a stop string)."""
        p = self._unsettled.pop(seq.seq_id, None)
        if p is not None:
            self._settle(p, None, in_flight=False)
        return seq.state is State.FINISHED

    def _settle(self, p: Pending, reason: str | None, in_flight: bool) -> None:
        seq, token = p.seq, p.token
        assert seq.lease is not None
        # full blocks are shared as soon as they are computed: a prompt admitted next
        # step finds the system prompt another request is still prefilling
        seq.lease.offer(seq.prompt_ids, seq.output_ids, seq.num_computed)
        seq.offered = seq.num_computed
        if token is None:
            return
        if reason is None:
            reason = seq.settle_text()
        self.observer.token(seq, p.first, p.gap)
        if reason == "error":  # the grammar rejected a sampled token: a masking bug
            error = f"sampled token {token} is outside the output grammar"
            self.finish(seq, "error", error=error, error_type="internal")
        elif reason and in_flight:
            self._late.append((seq, token, reason))  # its lease and KV wait for the step in flight
        elif reason:
            self.finish(seq, reason, token_ids=self._shown(token))
        else:
            seq.stream.push(seq.event((token,), None))

    def _shown(self, token: int) -> tuple[int, ...]:
        """The final event's token ids: an end-of-sequence token is not part of the output."""
        return (token,) if token not in self.eos_ids else ()
