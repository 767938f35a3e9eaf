"""The worker's idle work (queued CUDA graph captures on a GPU): run one piece at a time when
there is nothing to step, under the engine lock, again after steps, and never ahead of work."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Request
from ds4pool.sched.worker import Worker


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def test_idle_work_runs_between_steps_and_not_before_them(loaded: LoadedModel) -> None:
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded)
    e.worker.stop()  # replaced by one with idle work
    left = [6]
    steps_at_call: list[int] = []
    locked: list[bool] = []
    done = threading.Event()

    def idle() -> bool:
        locked.append(worker.engine_lock.locked())
        steps_at_call.append(worker.steps)
        time.sleep(0.01)  # a capture's worth of device work
        left[0] -= 1
        if left[0] == 0:
            done.set()
        return left[0] > 0

    worker = Worker(e.scheduler, idle=idle)
    e.worker = worker
    try:
        stream = e.submit(Request(session_id="s", prompt_ids=[5, 6, 7], max_tokens=8))
        worker.start()
        _, ids, final = stream.collect(timeout=60)
        assert final.error is None and len(ids) == 8
        assert done.wait(30)  # the rest of the idle work ran once the request was done
    finally:
        e.close()
    assert len(steps_at_call) == 6 and all(locked)
    # the request was queued before the worker started: its steps came first
    assert steps_at_call[0] >= 8
