"""The command line's OpenMP defaults: set before torch loads, never over the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys
from ds4pool.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules, "policy:", os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def test_cli_sets_passive_before_torch(env: dict[str, str]) -> None:
    assert _run(env) == "torch loaded: False policy: PASSIVE"


def test_user_value_wins(env: dict[str, str]) -> None:
    assert _run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "torch loaded: False policy: ACTIVE"


def test_no_effect_after_torch_loaded() -> None:
    import torch  # noqa: F401

    from ds4pool.threads import apply_thread_env

    environ: dict[str, str] = {}
    assert apply_thread_env(environ) == {} and environ == {}


def test_a_server_leaves_one_core_to_its_http_side_unless_the_probe_finds_it_faster() -> None:
    from ds4pool.threads import CpuThreads, server_cpu_threads

    assert server_cpu_threads("auto", 2, {}) == CpuThreads(1, 2)  # 2 cores: 1, or 2 if faster
    assert server_cpu_threads("auto", 16, {}) == CpuThreads(15, 16)
    assert server_cpu_threads("auto", 1, {}) == CpuThreads(1)  # never zero, nothing to try
    assert server_cpu_threads("auto", 8, {"OMP_NUM_THREADS": "4"}) == CpuThreads(None)  # user's
    assert server_cpu_threads("3", 8, {"OMP_NUM_THREADS": "4"}) == CpuThreads(3)  # a number wins
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a number"):
            server_cpu_threads(bad, 8, {})


class FakeSteps:
    """A step whose time depends on the thread count set before it (a fake clock)."""

    def __init__(self, seconds: dict[int, list[float]]) -> None:
        self.seconds = {n: list(v) for n, v in seconds.items()}
        self.now, self.threads, self.calls = 0.0, 0, []

    def set_threads(self, n: int) -> None:
        self.threads = n

    def step(self) -> None:
        self.calls.append(self.threads)
        self.now += self.seconds[self.threads].pop(0)

    def clock(self) -> float:
        return self.now


def probe(seconds: dict[int, list[float]], **kw):  # noqa: ANN003, ANN201
    from ds4pool.threads import choose_threads

    fake = FakeSteps(seconds)
    got = choose_threads(fake.step, 1, 2, fake.set_threads, fake.clock, **kw)
    return got, fake


def test_the_probe_keeps_more_threads_only_when_measurably_faster() -> None:
    # untimed warm-ups first (slow: primitives), then alternating; medians 0.100 vs 0.070
    got, fake = probe({1: [1, 0.10, 0.30, 0.10], 2: [1, 0.07, 0.07, 0.50]})
    assert fake.calls == [1, 2, 1, 2, 1, 2, 1, 2]
    assert (got.fewer_s, got.more_s) == pytest.approx((0.10, 0.07)) and got.chosen == 2
    assert fake.threads == 2
    assert "2 of 1-2 by a start-up probe: a step 100 ms with 1, 70 ms with 2" in got.describe()
    # 0.09 is 0.9x: not faster by enough to give up the HTTP side's core
    got, fake = probe({1: [1, 0.10, 0.10, 0.10], 2: [1, 0.09, 0.09, 0.09]})
    assert got.chosen == 1 and fake.threads == 1
    # sleeping threads that buy nothing (session 28's Xeon)
    got, fake = probe({1: [1, 0.10, 0.10, 0.10], 2: [1, 0.11, 0.10, 0.12]})
    assert got.chosen == 1 and fake.threads == 1


def test_the_probe_stops_early_on_a_slow_step() -> None:
    got, fake = probe({1: [5, 5], 2: [4, 2]}, max_s=3.0)  # one timed round only
    assert fake.calls == [1, 2, 1, 2] and (got.fewer_s, got.more_s, got.chosen) == (5, 2, 2)


def test_an_engine_probes_on_scratch_blocks_and_then_serves_as_one_without(demo_dir) -> None:  # noqa: ANN001
    import torch

    from ds4pool.engine import EngineConfig
    from ds4pool.model.loader import load_model
    from tests.unit.test_sharing import engine, ids, run

    loaded = load_model(str(demo_dir), torch.device("cpu"), torch.float32)
    before = torch.get_num_threads()
    prompt = ids(1, 100)
    try:
        probed = engine(loaded, cpu_threads=1, cpu_threads_up_to=2)
        try:
            p = probed.thread_probe
            assert p is not None and (p.fewer, p.more) == (1, 2) and p.chosen in (1, 2)
            assert p.fewer_s > 0 and p.more_s > 0 and torch.get_num_threads() == p.chosen
            got = [run(probed, prompt, "s"), run(probed, prompt + ids(2, 20), "s")]
        finally:
            probed.close()
        plain = engine(loaded, cpu_threads=p.chosen)
        try:
            assert plain.thread_probe is None
            want = [run(plain, prompt, "s"), run(plain, prompt + ids(2, 20), "s")]
        finally:
            plain.close()
        assert got == want  # the blocks the probe wrote were free for sessions again
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads_up_to must be more than cpu_threads"):
        EngineConfig(cpu_threads=2, cpu_threads_up_to=2)
    with pytest.raises(ValueError, match="cpu_threads_up_to"):
        EngineConfig(cpu_threads_up_to=2)


def test_the_scratch_step_fits_any_cache(demo_dir) -> None:  # noqa: ANN001
    import torch

    from ds4pool.model.loader import load_model
    from ds4pool.model.runner import ModelRunner

    loaded = load_model(str(demo_dir), torch.device("cpu"), torch.float32)
    for blocks in (1, 3, 9, 40, 400):
        runner = ModelRunner(loaded, num_blocks=blocks, block_size=16)
        seqs = runner.scratch_step()
        used = {b for s in seqs for b in s.block_table}
        assert max(used) < blocks and len(used) == sum(len(s.block_table) for s in seqs)
        assert seqs[-1].num_computed > 0 or blocks < 9  # a chunk after a context where it fits
        runner.step(seqs)  # valid: no error
