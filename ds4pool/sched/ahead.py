"""The decode step built ahead: the next step of a steady decode batch, launched before the
step in flight has been read back (sched/worker.py, overlap "ahead").

The overlapped loop still leaves the device idle between two steps, from the end of step N
to the launch of N+1: the sync, N's advance, the build and the input upload of N+1 (~0.15-0.5
ms a step on the H200, 3-9% of a batch-64 step). While every running request decodes, step
N+1 is known before N's tokens are: the same rows, each one position on, their input ids the
ids N samples. So N+1 is built from N's rows alone and launched right behind it, its ids fed
on the device from N's sampled ids (runner.SeqInput.fed_from), and N is read back while N+1
runs.

Going ahead is a bet that nothing else would change the step; the build declines (None), and
the worker schedules from N's results as before, when anything could:
- a request waits in the queue (it might be admitted), or a running request is not in N;
- a row of N is a prompt chunk, or does not sample;
- a row has an output grammar (its mask needs the token) or penalties (they count it);
- a row was cancelled or is past its deadline (it must end first);
- a row's next block cannot be had without preempting someone (nothing moves while a
  step that writes it runs).
Rows that N ends for certain are left out: a stop string found in the settle before
(`Writeback.late`) and a request whose N token is its last by max_tokens. A row that N
ends by a token only its readback shows (end of sequence, a stop string) is computed in
vain: its request is finished once N+1 has been waited, its N+1 row discarded — the deferred
finish the overlapped loop already has for stop strings.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.lease import BlocksNeverFitError
from ds4pool.sched.request import State
from ds4pool.sched.seq import Seq
from ds4pool.sched.step import Step


def ahead_rows(
    prev: Step, running: list[Seq], waiting: int, late: Collection[int]
) -> list[int] | None:
    """Rows of `prev` that go on into the step after it (their indices in prev), or None
    where that step must be scheduled from prev's results."""
    if waiting or len(running) != len(prev.seqs):
        return None
    now = time.monotonic()
    rows = []
    for j, (seq, inp, n) in enumerate(zip(prev.seqs, prev.inputs, prev.counts)):
        req = seq.req
        p = req.sampling
        if (
            n != 1
            or not inp.sample
            or seq.state is not State.RUNNING
            or seq.grammar is not None
            or p.presence_penalty
            or p.frequency_penalty
            or seq.stream.cancelled
            or (req.deadline and now > req.deadline)
        ):
            return None
        if seq.seq_id in late or len(seq.output_ids) + 1 >= seq.max_tokens:
            continue  # prev's row is its last
        rows.append(j)
    return rows or None


def build_ahead(prev: Step, rows: list[int]) -> Step | None:
    """The step after `prev` for its `rows`: each one position on, its id fed from prev's
    sampled ids; None if a row's next block cannot be reserved without preempting."""
    step = Step([], [], [])
    for j in rows:
        seq = prev.seqs[j]
        assert seq.lease is not None
        need = seq.num_computed + 2  # prev computes position num_computed, this step the next
        if not seq.lease.has_room(need):
            try:
                seq.lease.reserve(need)  # demotes idle sessions at most, never a running one
            except (OutOfBlocksError, BlocksNeverFitError):
                return None
        step.add_fed(seq, j)
    return step
