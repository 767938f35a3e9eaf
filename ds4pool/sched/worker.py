"""The decode worker: one thread running stages 2-4 in a loop, one forward per step.

    wait for work → (coalesce window) → schedule → [engine lock] runner.step → writeback

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

from ds4pool.kv.cost import StepSample
from ds4pool.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        scheduler: Scheduler,
        coalesce_us: int = 0,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self.scheduler = scheduler
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
                while not sched.has_work() and not self._stopping and not self._idle_left:
                    sched.wakeup.wait()
                if self._stopping and not sched.has_work():
                    return
                busy = sched.has_work()
            if not busy:
                self._run_idle()
                continue
            if idle and self.coalesce_s > 0:
                time.sleep(self.coalesce_s)  # let a burst of arrivals share the first step
            try:
                self._step()
            except Exception as exc:  # a bug must not kill the server nor hang its clients
                log.exception("worker: unexpected error; failing the running requests")
                sched.abort_running(exc)
                time.sleep(0.01)

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
        keys = [seq.lease.key for seq in step.seqs if seq.lease is not None]
        assert len(set(keys)) == len(keys) == len(step.seqs), "a session twice in one batch"
        # rows that decode one token; the rest of the step's tokens are prompt (or recomputed)
        # KV: the prefill rate of the restore-vs-recompute decision (kv/cost.py)
        rows = sum(1 for seq, n in zip(step.seqs, step.counts) if n == 1 and seq.output_ids)
        t0 = time.perf_counter()
        try:
            with self.engine_lock:
                out = sched.runner.step(step.inputs)
        except Exception as exc:  # OOM, a kernel fault, a bad batch: fail this batch only
            log.error("worker: step of %d requests failed: %s", len(step.seqs), exc)
            sched.fail(step, exc)
            return
        t1 = time.perf_counter()
        sched.pool.cost.observe_step(StepSample(sum(step.counts) - rows, rows, t1 - t0))
        sched.process(step, out)
        self.steps += 1
        self._idle_left = self._idle is not None  # the step may have left idle work
        # host work around the forward (planning + writeback): the device idles meanwhile,
        # which is what an overlapped loop (plan step N+1 while step N runs) would win back
        host = (t0 - t_plan) + (time.perf_counter() - t1)
        sched.observer.step(len(step.seqs), sum(step.counts), t1 - t0, host)
