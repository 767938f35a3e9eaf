"""Tenant isolation: tenant A's cached prefix gives tenant B no reuse (bench/tenant_timing.py
measures the timing side; its numbers go in docs/BENCHMARKS.md, not in a timed test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tenant_timing import bootstrap_median_diff, run_trials, summarize
from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


@pytest.mark.parametrize("sessions", [True, False])
def test_tenant_b_reuses_nothing_of_tenant_as_cached_prefix(
    loaded: LoadedModel, sessions: bool
) -> None:
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded)
    try:
        samples = run_trials(e, trials=3, prompt_tokens=80, seed=1, sessions=sessions)
        e.pool.check_integrity()
    finally:
        e.close()
    summary = summarize(samples, seed=1)
    cached = summary["cached_tokens"]
    assert cached == {"same": [0], "different": [0], "control": [64]}  # A: its 4 full blocks
    assert summary["prompt_tokens"] == [80]
    assert len(samples) == 9


def test_the_bootstrap_interval_brackets_the_difference_of_medians() -> None:
    a, b = [10.0, 11.0, 12.0, 13.0, 14.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    d, lo, hi = bootstrap_median_diff(a, b, rounds=500, seed=0)
    assert d == 9.0 and 0 < lo <= d <= hi
    d, lo, hi = bootstrap_median_diff(a, a, rounds=500, seed=0)
    assert d == 0.0 and lo < 0 < hi
