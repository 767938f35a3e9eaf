"""Restore vs recompute (kv/cost.py): the decision from measured rates, and a session
whose KV is recomputed instead of read back gives the same greedy completions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.config import PoolObserver
from ds4pool.kv.cost import Choice, CostPriors, RestoreCost, RestorePolicy, StepSample
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Request, Usage

MB = 1 << 20


def test_priors_read_back_until_measured_then_the_cheaper_side_wins() -> None:
    cost = RestoreCost()
    # 1,000 tokens of 4 KiB: the priors price a read far below a 500 tok/s prefill
    d = cost.decide("disk", 1000, 1000 * 4096)
    assert d.choice is Choice.READ and d.read_s < d.recompute_s
    assert cost.rates().measured == frozenset()
    cost.observe_step(StepSample(num_prefill_tokens=4000, num_decode_rows=0, seconds=0.1))
    cost.observe_read("disk", 50 * MB, 1.0)  # a slow disk: 50 MB/s
    r = cost.rates()
    assert r.prefill_tokens_per_s == pytest.approx(40_000)  # the first sample replaces the prior
    assert r.disk_bytes_per_s == pytest.approx(50 * MB)
    assert r.measured == {"disk", "prefill"}
    d = cost.decide("disk", 1000, 1000 * 128 * 1024)  # 125 MiB: 2.5 s to read, 25 ms to prefill
    assert d.choice is Choice.RECOMPUTE
    assert d.recompute_s == pytest.approx(0.025)
    assert cost.decide("ram", 1000, 1000 * 128 * 1024).choice is Choice.RECOMPUTE
    cost.observe_read("ram", 10 << 30, 1.0)  # a fast host → device copy: RAM is read back
    assert cost.decide("ram", 1000, 1000 * 128 * 1024).choice is Choice.READ


def test_the_ewma_moves_towards_new_samples_and_ignores_noise() -> None:
    cost = RestoreCost(priors=CostPriors(alpha=0.5))
    cost.observe_read("ram", 100, 1.0)
    cost.observe_read("ram", 300, 1.0)
    assert cost.rates().ram_bytes_per_s == pytest.approx(200)
    cost.observe_read("ram", 10**9, 1e-9)  # too short to mean anything
    cost.observe_read("ram", 0, 1.0)
    assert cost.rates().ram_bytes_per_s == pytest.approx(200)


def test_the_decoders_share_of_a_mixed_step_is_not_charged_to_the_prompt() -> None:
    cost = RestoreCost()
    cost.observe_step(StepSample(num_prefill_tokens=0, num_decode_rows=16, seconds=0.1))
    cost.observe_step(StepSample(num_prefill_tokens=64, num_decode_rows=16, seconds=0.15))
    assert cost.rates().prefill_tokens_per_s == pytest.approx(64 / 0.05)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_forced_policy_wins_over_the_rates(tier: str) -> None:
    always, never = RestoreCost(RestorePolicy.ALWAYS), RestoreCost(RestorePolicy.NEVER)
    for c in (always, never):
        c.observe_read(tier, 1, 1.0)  # 1 B/s: reading is hopeless
        c.observe_read("ram", 1, 1.0)
    assert always.decide(tier, 100, 100 * 4096).choice is Choice.READ
    cheap = RestoreCost(RestorePolicy.NEVER)  # reading would be far cheaper
    assert cheap.decide(tier, 100, 1).choice is Choice.RECOMPUTE
    assert never.decide(tier, 0, 0).choice is Choice.READ  # nothing to recompute


# ---------------------------------------------------------------- through the engine


class Decisions(PoolObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def restore_decided(self, tier: str, choice: str) -> None:
        self.seen.append((tier, choice))


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


FIRST = "The system prompt of an agent, then its first question: what is in the box? " * 3
SECOND = " A tool result came back, and then the agent asks again what the box holds."


def two_turns(
    loaded: LoadedModel,
    disk: Path,
    policy: str,
    evict_to: str,
    slow: str | None = None,
    keep_cached: bool = False,
) -> tuple[list[list[int]], Usage, list[tuple[str, str]]]:
    """Turn 1, evict the session to `evict_to`, turn 2: (completions, turn 2's usage, the
    pool's restore decisions). `slow`: make that tier's measured read rate 1 B/s first.
    The evicted session's full blocks stay cached in the block index if `keep_cached`."""
    obs = Decisions()
    cfg = EngineConfig(kv_device_gb=0.01, kv_disk_dir=disk, restore_policy=policy)
    e = Engine(cfg, loaded=loaded, pool_observer=obs)
    try:

        def run(prompt: str) -> tuple[str, list[int], Usage]:
            stream = e.submit(Request(session_id="s", prompt_text=prompt, max_tokens=12))
            text, ids, final = stream.collect(timeout=60)
            assert final.error is None and final.usage is not None, final.error
            return text, ids, final.usage

        text1, out1, first = run(FIRST)
        e.pool.evict("default", "s", evict_to)
        if not keep_cached:
            e.pool.drop_cached_blocks()
        if slow is not None:
            e.pool.cost.observe_read(slow, 1, 1.0)
        _, out2, usage = run(FIRST + text1 + SECOND)
        assert usage.prompt_tokens > first.prompt_tokens + len(out1)
        e.pool.check_integrity()
        return [out1, out2], usage, obs.seen
    finally:
        e.close()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_recomputing_a_returning_session_gives_the_same_greedy_completions(
    loaded: LoadedModel, tmp_path: Path, tier: str
) -> None:
    read, read_usage, read_seen = two_turns(loaded, tmp_path / "a", "always", tier)
    again, again_usage, again_seen = two_turns(loaded, tmp_path / "b", "never", tier)
    assert again == read  # greedy: recomputed KV and read-back KV give the same text
    assert read_seen == [(tier, "read")] and again_seen == [(tier, "recompute")]
    assert read_usage.prompt_tokens == again_usage.prompt_tokens
    # turn 1's prompt and reply came back (all but the last sampled token, which has no KV)
    assert read_usage.cached_tokens > 0.6 * read_usage.prompt_tokens
    assert again_usage.cached_tokens == 0  # the session kept its tokens, its KV was computed


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_auto_recomputes_when_the_measured_read_rate_is_slower(
    loaded: LoadedModel, tmp_path: Path, tier: str
) -> None:
    fast, _, fast_seen = two_turns(loaded, tmp_path / "a", "auto", tier)
    slow, usage, slow_seen = two_turns(loaded, tmp_path / "b", "auto", tier, slow=tier)
    assert fast_seen == [(tier, "read")]  # the demo model prefills far slower than it reads
    assert slow_seen == [(tier, "recompute")]
    assert slow == fast and usage.cached_tokens == 0


def test_a_recompute_keeps_the_prefix_the_block_index_still_holds(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """Demoted to RAM, the session's full blocks stay cached on the device: a restore takes
    them from the index, and only the rest is read back or, here, recomputed."""
    read, read_usage, _ = two_turns(loaded, tmp_path / "a", "always", "ram", keep_cached=True)
    again, usage, seen = two_turns(loaded, tmp_path / "b", "never", "ram", keep_cached=True)
    assert again == read and seen == [("ram", "recompute")]
    assert 0 < usage.cached_tokens < read_usage.cached_tokens
    assert usage.cached_tokens % 16 == 0  # whole blocks of the index
