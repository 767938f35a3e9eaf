"""The scheduler's shortcuts for decode rows build the same steps as its general path.

`Scheduler.schedule` keeps the running order sorted from the last build while the running
list is unchanged, takes one-token rows without chunk sizing and, where their last block
has room, without the pool lock (`SessionLease.has_room`), and charges the queue once per
build. Here one engine runs with them, a second with the general path of before (a sort
per build, every row through `_take` and a locked `reserve`, a charge per row), on the same
script: rows crossing block boundaries, a preemption under a tight KV pool, an arrival while
others decode, a row finishing while others go on, a cancel. Every step's rows (sessions,
counts, token ids, positions, block tables and epochs), the queue's virtual times after each
build and the users' tokens must be the same (demo model, CPU, both loops).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.lease import SessionLease
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Request, RequestStream
from ds4pool.sched.scheduler import Scheduler
from ds4pool.sched.step import Step

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def prompt(loaded: LoadedModel, i: int) -> str:
    body = " ".join(f"line {j} of file {i}" for j in range(3 + 4 * i))
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": body}])


def general_path(sched: Scheduler) -> None:
    """Put `sched` back on the general path the shortcuts stand in for."""

    def order() -> list[Any]:
        return sorted(sched.running, key=lambda s: (s.priority, s.arrival))

    add = sched._add

    def add_and_charge(step: Step, seq: Any, n: int) -> None:
        add(step, seq, n)
        sched._charge(step)  # one charge per row, as it was

    sched._build_order = order  # type: ignore[method-assign]
    sched._take_decodes = sched._take  # type: ignore[method-assign]
    sched._add = add_and_charge  # type: ignore[method-assign]


def no_room(lease: SessionLease, num_tokens: int) -> bool:
    return False  # every reserve takes the pool lock and checks there


Row = tuple[str, int, tuple[int, ...], int, tuple[int, ...], int, bool]


def run_script(
    loaded: LoadedModel, overlap: str, sampling: SamplingParams, shortcuts: bool
) -> tuple[list[list[Row]], list[dict[str, float]], list[tuple[list[int], str | None]], int]:
    per_block = loaded.config.kv_bytes_per_token(4) * 16
    cfg = EngineConfig(
        overlap=overlap,
        kv_device_gb=17 * per_block / (1 << 30),  # 16 blocks: the four cannot all fit
        restore_policy="always",  # a preempted session is read back, never timed against
        max_prefill_cost=0,
        itl_budget_factor=None,
    )
    e = Engine(cfg, loaded=loaded)
    e.worker.stop()  # this thread drives the steps: both engines see the same script
    sched = e.scheduler
    if not shortcuts:
        general_path(sched)
    steps: list[list[Row]] = []
    vtimes: list[dict[str, float]] = []
    build = sched.schedule

    epochs: dict[int, int] = {}  # the pool's epochs count on from other pools': renumbered

    def record() -> Step | None:
        step = build()
        if step is not None:
            steps.append(
                [
                    (
                        seq.req.session_id or "",
                        n,
                        tuple(inp.token_ids),
                        inp.num_computed,
                        tuple(inp.block_table),
                        epochs.setdefault(inp.table_epoch, len(epochs)),
                        inp.sample,
                    )
                    for seq, n, inp in zip(step.seqs, step.counts, step.inputs)
                ]
            )
            vtimes.append(dict(sched.queue._vtime))
        return step

    sched.schedule = record  # type: ignore[method-assign]
    preempted: list[int] = []
    sched.observer.preempted = lambda: preempted.append(1)  # type: ignore[method-assign]
    has_room = SessionLease.has_room

    def request(sid: str, i: int, max_tokens: int, priority: int) -> RequestStream:
        return sched.submit(
            Request(
                session_id=sid,
                tenant="b" if sid == "low" else "a",  # a requeue reads both virtual times
                prompt_text=prompt(loaded, i),
                max_tokens=max_tokens,
                priority=priority,
                sampling=sampling,
                ignore_eos=True,
            )
        )

    streams = {"low": request("low", 2, 120, 5), "high": request("high", 3, 60, 0)}
    streams["gone"] = request("gone", 0, 100, 0)
    try:
        for turn in range(600):
            if turn == 12:  # an arrival while the others decode; it ends first
                streams["late"] = request("late", 1, 6, 0)
            if turn == 20:
                streams["gone"].cancel()
            if not (sched.has_work() or e.worker.in_flight):
                break
            if not shortcuts:  # the general path reserves under the lock, every row
                SessionLease.has_room = no_room  # type: ignore[method-assign]
            try:
                e.worker.step_once()
            finally:
                SessionLease.has_room = has_room  # type: ignore[method-assign]
        assert not sched.has_work(), "the script did not finish"
        e.pool.check_integrity()
        outputs = []
        for sid in ("low", "high", "gone", "late"):
            _, ids, final = streams[sid].collect(timeout=10)
            assert final.error is None, final.error
            outputs.append((ids, final.finish_reason))
        return steps, vtimes, outputs, len(preempted)
    finally:
        e.close()


@pytest.mark.parametrize(
    "overlap, sampling", [("off", GREEDY), ("on", SEEDED)], ids=["sync-greedy", "overlap-seeded"]
)
def test_decode_shortcuts_build_the_steps_of_the_general_path(
    loaded: LoadedModel, overlap: str, sampling: SamplingParams
) -> None:
    fast = run_script(loaded, overlap, sampling, shortcuts=True)
    full = run_script(loaded, overlap, sampling, shortcuts=False)
    steps, vtimes, outputs, preempted = fast
    # the script did what it is for, on both paths
    assert preempted > 0, "the tight pool preempted no one"
    reasons = [reason for _, reason in outputs]
    assert reasons == ["length", "length", "cancelled", "length"], reasons
    late_done = max(i for i, rows in enumerate(steps) if any(r[0] == "late" for r in rows))
    assert any(r[0] == "high" for r in steps[late_done + 1]), "late ended before the others"
    grown = [
        (a[0], len(a[4]), len(b[4]))
        for before, after in zip(steps, steps[1:])
        for a in before
        for b in after
        if a[0] == b[0] and a[1] == b[1] == 1 and len(b[4]) > len(a[4])
    ]
    assert len(grown) >= 4, "decode rows should cross block boundaries"
    # ... and the shortcuts changed nothing
    assert len(steps) == len(full[0])
    for i, (a, b) in enumerate(zip(steps, full[0])):
        assert a == b, f"step {i} differs"
    assert vtimes == full[1]
    assert outputs == full[2]
    assert preempted == full[3]
