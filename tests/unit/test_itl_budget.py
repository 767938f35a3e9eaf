"""--itl-budget-factor end to end (demo model, CPU): the scheduler sizes a prompt's chunks next
to decoders by the step-time budget, the worker feeds it measured steps, metrics show it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig, itl_budget_factor
from ds4pool.metrics import Metrics, render
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Request
from ds4pool.sched.step_time import StepTime

K, WORK_CAP, TOKEN_CAP, BUDGET = 4096, 112, 64, 40.0  # the CPU defaults; a smaller budget


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


class FixedBudget(StepTime):
    """As if the measurements said BUDGET units: records what the scheduler asked."""

    def __init__(self) -> None:
        super().__init__(2.5)
        self.asked: list[tuple[int, float, float]] = []

    def budget(self, decode_rows: int, cap: float, floor: float) -> float:
        self.asked.append((decode_rows, cap, floor))
        return min(cap, BUDGET)


def longest(start: int, work: float) -> int:
    """Independent of PrefillCost: the most tokens after start whose cost fits `work`."""
    n, cost = 0, 0.0
    while cost + 1 + (start + n + 1) / K <= work:
        cost, n = cost + 1 + (start + n + 1) / K, n + 1
    return n


def run_long_next_to_decoder(e: Engine, length: int) -> list[tuple[int, int]]:
    """(sequences, tokens) of each step that ran while a `length` prompt was prefilled next
    to one decoder, after one lone prompt (no decoders) of `length` tokens."""
    steps: list[tuple[int, int]] = []
    e.scheduler.observer.step = lambda b, n, *_: steps.append((b, n))  # type: ignore[method-assign]
    rng = random.Random(7)
    ids = [rng.randrange(4, 200) for _ in range(length)]
    _, _, lone = e.submit(Request(session_id="lone", prompt_ids=ids[::-1], max_tokens=1)).collect(
        timeout=300
    )
    assert lone.error is None
    dec = e.submit(Request(session_id="d", prompt_ids=[5, 6, 7], max_tokens=4000, ignore_eos=True))
    for _ in range(3):
        dec.get(timeout=60)  # decoding, and a few decode-only steps measured
    steps.append((0, 0))  # the marker: what follows ran next to the decoder
    _, _, final = e.submit(Request(session_id="long", prompt_ids=ids, max_tokens=1)).collect(
        timeout=300
    )
    assert final.error is None
    dec.cancel()
    return steps


def test_chunks_next_to_decoders_follow_the_step_time_budget(loaded: LoadedModel) -> None:
    length = 600
    e = Engine(EngineConfig(kv_device_gb=0.05, max_batch_tokens=256), loaded=loaded)
    fixed = FixedBudget()
    e.scheduler.step_time = fixed  # before any work: the worker thread is idle
    try:
        steps = run_long_next_to_decoder(e, length)
    finally:
        e.close()
    assert steps[0] == (1, 256)  # no decoders: the full max_batch_tokens, no work budget
    mark = steps.index((0, 0))
    chunks = [n - 1 for b, n in steps[mark + 1 :] if b == 2]
    assert sum(chunks) == length
    want, start = [], 0
    while start < length:  # each chunk the most that fits BUDGET (<= 64 tokens, >= 16)
        n = min(length - start, max(16, longest(start, BUDGET)))
        want.append(n)
        start += n
    assert chunks == want
    assert chunks[0] == 39 < TOKEN_CAP  # the token and work caps alone: 64 at its start
    # one decoder, the work cap of 112 (no --prefill-decode-ratio), the floor of 16 tokens
    assert fixed.asked and {a[:2] for a in fixed.asked} == {(1, float(WORK_CAP))}
    assert fixed.asked[0][2] == pytest.approx(16 + 16 * 17 / 2 / K)


def test_the_worker_measures_the_steps_and_metrics_show_the_budget(
    loaded: LoadedModel,
) -> None:
    m = Metrics()
    cfg = EngineConfig(kv_device_gb=0.05, max_batch_tokens=256, itl_budget_factor=2.5)
    e = Engine(cfg, loaded=loaded, sched_observer=m.scheduler_observer())
    try:
        run_long_next_to_decoder(e, 400)
        st = e.scheduler.step_time
        decode, per_work = st.decode_s(1), st.seconds_per_work
        assert decode is not None and per_work is not None and decode > 0 and per_work > 0
        render(m, e)
    finally:
        e.close()
    reg = m.registry
    assert (reg.get_sample_value("ds4pool_prefill_work_budget_count") or 0) >= 400 / TOKEN_CAP
    budget_sum = reg.get_sample_value("ds4pool_prefill_work_budget_sum") or 0
    assert 0 < budget_sum <= WORK_CAP * reg.get_sample_value("ds4pool_prefill_work_budget_count")
    assert reg.get_sample_value("ds4pool_prefill_seconds_per_work") == per_work


def test_factor_defaults_by_device_and_off() -> None:
    # off by default: see FACTOR_DEFAULTS
    assert itl_budget_factor(EngineConfig(), torch.device("cuda")) == 0.0
    assert itl_budget_factor(EngineConfig(), torch.device("cpu")) == 0.0
    assert itl_budget_factor(EngineConfig(itl_budget_factor=0), torch.device("cuda")) == 0.0
    assert itl_budget_factor(EngineConfig(itl_budget_factor=3), torch.device("cpu")) == 3.0
    with pytest.raises(ValueError, match="itl_budget_factor"):
        EngineConfig(itl_budget_factor=0.8)
