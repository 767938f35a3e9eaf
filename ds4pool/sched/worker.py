"""The decode worker: one thread running stages 2-4 in a loop, one forward per step.

    wait for work → (coalesce window) → schedule → [engine lock] runner.step → writeback

Submissions take only the scheduler's queue lock, so they never wait on the device.
A step that raises fails exactly its batch (sessions rolled back); the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time

from ds4pool.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, scheduler: Scheduler, coalesce_us: int = 0) -> None:
        self.scheduler = scheduler
        self.coalesce_s = coalesce_us / 1e6
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
                while not sched.has_work() and not self._stopping:
                    sched.wakeup.wait()
                if self._stopping and not sched.has_work():
                    return
            if idle and self.coalesce_s > 0:
                time.sleep(self.coalesce_s)  # let a burst of arrivals share the first step
            try:
                self._step()
            except Exception as exc:  # a bug must not kill the server nor hang its clients
                log.exception("worker: unexpected error; failing the running requests")
                sched.abort_running(exc)
                time.sleep(0.01)

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
        t0 = time.perf_counter()
        try:
            with self.engine_lock:
                out = sched.runner.step(step.inputs)
        except Exception as exc:  # OOM, a kernel fault, a bad batch: fail this batch only
            log.error("worker: step of %d requests failed: %s", len(step.seqs), exc)
            sched.fail(step, exc)
            return
        t1 = time.perf_counter()
        sched.process(step, out)
        self.steps += 1
        # host work around the forward (planning + writeback): the device idles meanwhile,
        # which is what an overlapped loop (plan step N+1 while step N runs) would win back
        host = (t0 - t_plan) + (time.perf_counter() - t1)
        sched.observer.step(len(step.seqs), sum(step.counts), t1 - t0, host)
