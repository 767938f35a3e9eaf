"""The decode worker: one thread running stages 2-4 in a loop, one forward per step.

    wait for work → (coalesce window) → schedule → [engine lock] runner.step → writeback

With `overlap` (the default on CUDA) the writeback is split around the next launch, so the
host's slow part runs while the device computes (deferred writeback):

    wait N → advance N → schedule N+1 → launch N+1 → settle N → wait N+1 → ...

except before a launch that runs a prompt step eagerly (no CUDA graph for its shape): that
launch holds the host for its whole dispatch, so N is settled (its tokens streamed) first.

advance: counts, tokens, grammar, end of sequence, max_tokens (all the schedule needs);
settle: detokenize, stop strings, stream events, lease.offer, the observer. A request that a
stop string ends in settle N is already in step N+1: it is finished after N+1's sync and its
N+1 row is discarded, so no lease is released and no KV moves while a step that writes it
runs, and the tokens, text and sessions are those of the synchronous loop.

With `ahead` as well (overlap "ahead"), a steady decode batch does not wait for the host at
all: step N+1 is built from N's rows and launched before N is waited, its input ids fed on
the device from N's sampled ids (sched/ahead.py, runner.launch(feed=)):

    launch N+1 (fed by N) → wait N → advance N → settle N → launch N+2 (fed by N+1) → ...

and whenever the next step could differ from N's rows one position on (a request waits, a
prompt chunk, a grammar, a row ending for certain), the turn falls back to the overlapped
one above. A request that N ends by its token (end of sequence, a stop string) is in N+1
already: finished after N+1's sync, as a stop string in the overlapped loop. Tokens, text and
sessions stay those of the synchronous loop.

Submissions take only the scheduler's queue lock, so they never wait on the device.
A step that raises fails exactly its batch (sessions rolled back); the loop goes on.
With no work, the loop runs `idle()` (one short piece of device work, e.g. a CUDA graph
capture; True while more remains) before it sleeps: a request that arrives meanwhile waits
for that piece at most, never a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ds4pool.model.runner import Launched
from ds4pool.sched.scheduler import Scheduler
from ds4pool.sched.step import Step
from ds4pool.sched.trace import StepTrace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InFlight:
    """A step launched on the device and not waited yet."""

    step: Step
    launched: Launched
    t0: float  # perf_counter at its launch
    host: float  # host seconds from the previous step's results to this launch
    returned: float  # perf_counter when the launch returned (the host was free again)
    # this thread's CPU seconds in the launch call: far under returned - t0, the thread
    # waited inside it (for the GIL behind other threads, or for the device)
    launch_cpu: float


class Worker:
    def __init__(
        self,
        scheduler: Scheduler,
        coalesce_us: int = 0,
        idle: Callable[[], bool] | None = None,
        overlap: bool = False,
        ahead: bool = False,
        trace: StepTrace | None = None,
        before_step: Callable[[], object] | None = None,
    ) -> None:
        self.scheduler = scheduler
        # called on this thread before each turn of the loop (cpu_share.ThreadGovernor.tick)
        self.before_step = before_step
        self.overlap = overlap or ahead
        self.ahead = ahead
        self.trace = trace  # --trace-steps: a line per step (sched/trace.py)
        self._in_flight: InFlight | None = None
        # a step launched ahead, while the one before it (popped from _in_flight) is waited
        self._ahead: InFlight | None = None
        self._ahead_failed: tuple[Step, Exception] | None = None
        self._ready_at = 0.0  # perf_counter when the last step's results were in
        self.coalesce_s = coalesce_us / 1e6
        self._idle = idle
        self._idle_left = idle is not None  # idle() may have work: call it when idle
        self.engine_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ds4pool-worker", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        sched = self.scheduler
        with sched.wakeup:
            self._stopping = True
            sched.wakeup.notify_all()
        self._thread.join(timeout)
        sched.close()

    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with sched.wakeup:
                idle = not sched.running
                while not self.busy() and not self._stopping and not self._idle_left:
                    sched.wakeup.wait()
                if self._stopping and not self.busy():
                    return
                busy = self.busy()
            if not busy:
                self._run_idle()
                continue
            if idle and self.coalesce_s > 0:
                time.sleep(self.coalesce_s)  # let a burst of arrivals share the first step
            try:
                self.step_once()
            except Exception as exc:  # a bug must not kill the server nor hang its clients
                log.exception("worker: unexpected error; failing the running requests")
                self._drain()
                sched.abort_running(exc)
                time.sleep(0.01)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None or self._ahead is not None

    def in_flight_seqs(self) -> set[int]:
        """seq_ids of the requests in steps launched and not waited (tests probe this)."""
        return {
            seq.seq_id
            for f in (self._in_flight, self._ahead)
            if f is not None
            for seq in f.step.seqs
        }

    def busy(self) -> bool:
        return self.scheduler.has_work() or self.in_flight

    def step_once(self) -> None:
        """One turn of the loop: a whole step, or (overlap) wait one and launch the next."""
        if self.before_step is not None:
            self.before_step()
        if self.overlap:
            self._step_overlapped()
        else:
            self._step()

    def _drain(self) -> None:
        """Wait out the steps in flight (their results are dropped): before the running
        requests are failed, nothing may still write their blocks."""
        for inflight in (self._in_flight, self._ahead):  # launch order
            if inflight is not None:
                self._wait_out(inflight)
        self._in_flight = self._ahead = None
        self.scheduler.finish_late()

    def _wait_out(self, inflight: InFlight) -> None:
        try:
            self.scheduler.runner.wait(inflight.launched)
        except Exception:
            log.exception("worker: the step in flight failed as well")

    def _run_idle(self) -> None:
        assert self._idle is not None
        try:
            with self.engine_lock:
                self._idle_left = self._idle()
        except Exception:  # idle work is an optimisation: never let it kill the loop
            log.exception("worker: idle work failed; not retrying it")
            self._idle = None
            self._idle_left = False

    def _step(self) -> None:
        sched = self.scheduler
        t_plan = time.perf_counter()
        step = sched.schedule()
        if step is None:
            # Work exists but cannot run now (a busy session, no free blocks): poll briefly.
            with sched.wakeup:
                sched.wakeup.wait(0.005)
            return
        _check_sessions(step)
        t0 = time.perf_counter()
        try:
            with self.engine_lock:
                out = sched.runner.step(step.inputs)
        except Exception as exc:  # OOM, a kernel fault, a bad batch: fail this batch only
            log.error("worker: step of %d requests failed: %s", len(step.seqs), exc)
            sched.fail(step, exc)
            return
        t1 = time.perf_counter()
        sched.observe_step(step.sample(t1 - t0, sched.cfg.prefill_cost))
        sched.process(step, out)
        self.steps += 1
        self._idle_left = self._idle is not None  # the step may have left idle work
        # host work around the forward (planning + writeback): the device idles meanwhile,
        # which is what the overlapped loop (settle N while N+1 runs) wins back, in part
        host = (t0 - t_plan) + (time.perf_counter() - t1)
        sched.observer.step(len(step.seqs), sum(step.counts), t1 - t0, host)
        if self.trace is not None:  # (no "eager" mark: the overlapped loop's launches have it)
            self.trace.step(step, t0, t1, host)

    def _step_overlapped(self) -> None:
        sched = self.scheduler
        prev = self._in_flight
        if prev is not None and self.ahead:
            self._launch_ahead(prev)
        self._in_flight = None
        ahead = self._ahead
        pending = None
        t_ready = time.perf_counter()
        if prev is not None:
            try:
                with self.engine_lock:
                    out = sched.runner.wait(prev.launched)
            except Exception as exc:  # a fault reported at the sync: fail that batch only
                log.error("worker: step of %d requests failed: %s", len(prev.step.seqs), exc)
                if ahead is not None:  # fed by the failed step, holding its requests
                    self._wait_out(ahead)
                    self._ahead = ahead = None
                sched.finish_late()
                sched.fail(prev.step, exc)
            else:
                t_ready = time.perf_counter()
                # launch → results: the device's step, mostly; a step launched ahead starts
                # when the one before it ends
                step_s = t_ready - max(prev.t0, self._ready_at)
                sched.observe_step(prev.step.sample(step_s, sched.cfg.prefill_cost))
                sched.finish_late()  # before advance: their rows of prev are discarded
                pending = sched.advance(prev.step, out, held=ahead.step if ahead else None)
                self.steps += 1
                self._idle_left = self._idle is not None
                sched.observer.step(len(prev.step.seqs), sum(prev.step.counts), step_s, prev.host)
                if self.trace is not None:
                    self.trace.step(
                        prev.step, prev.t0, t_ready, prev.host, prev.returned,
                        prev.launched.eager, prev.launch_cpu,
                    )  # fmt: skip
        self._ready_at = t_ready
        if self._ahead_failed is not None:  # its requests' prev rows are advanced: fail them
            (failed, exc), self._ahead_failed = self._ahead_failed, None
            sched.fail(failed, exc)
        step = None
        if ahead is not None:
            self._in_flight, self._ahead = ahead, None
        else:
            step = sched.schedule()
        if step is not None:
            _check_sessions(step)
            if pending is not None and sched.runner.launches_eagerly(step.inputs):
                # its launch holds the host for the whole dispatch: stream prev's tokens
                # first (a first token waited out that dispatch; docs/BENCHMARKS.md, run I)
                sched.settle(pending, in_flight=True)
                pending = None
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                with self.engine_lock:
                    launched = sched.runner.launch(step.inputs)
            except Exception as exc:  # on CPU the forward runs here: fail this batch only
                log.error("worker: step of %d requests failed: %s", len(step.seqs), exc)
                sched.fail(step, exc)
            else:
                # exposed host time, as the synchronous loop's: from the previous results to
                # this launch (the runner's own prep is counted in neither)
                cpu = time.thread_time() - cpu0
                self._in_flight = InFlight(
                    step, launched, t0, t0 - t_ready, time.perf_counter(), cpu
                )
        if pending is not None:
            sched.settle(pending, in_flight=self._in_flight is not None)
        if self._in_flight is None:
            sched.finish_late()  # nothing runs: a request a stop string ended ends now
            if step is None and prev is None:
                # Work exists but cannot run now (a busy session, no free blocks): poll.
                with sched.wakeup:
                    sched.wakeup.wait(0.005)

    def _launch_ahead(self, prev: InFlight) -> None:
        """Step N+1 from N's rows, launched before N is waited (sched/ahead.py), if it can be."""
        sched = self.scheduler
        step = sched.schedule_ahead(prev.step)
        if step is None:
            return
        _check_sessions(step)
        cpu0 = time.thread_time()
        try:
            with self.engine_lock:
                launched = sched.runner.launch(step.inputs, feed=prev.launched)
        except Exception as exc:  # on CPU the forward runs here: fail it once prev is written
            log.error("worker: step of %d requests failed: %s", len(step.seqs), exc)
            self._ahead_failed = (step, exc)
            return
        # no host time exposed: the device had the step before it still to run
        now = time.perf_counter()
        self._ahead = InFlight(step, launched, now, 0.0, now, time.thread_time() - cpu0)


def _check_sessions(step: Step) -> None:
    keys = [seq.lease.key for seq in step.seqs if seq.lease is not None]
    assert len(set(keys)) == len(keys) == len(step.seqs), "a session twice in one batch"
