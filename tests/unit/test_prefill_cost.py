"""The per-step prefill cap by work: which chunk a prompt gets next to decoders."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4pool.sched.prefill_cost import DEFAULTS, PrefillCost
from ds4pool.sched.step import Step

BUCKETS = (32, 64, 128, 256, 512)  # the runner's graph chunk buckets for a 512 cap


def cuda_cost() -> PrefillCost:
    scale, budget = DEFAULTS["cuda"]
    return PrefillCost(scale, budget, BUCKETS)


def brute_cost(start: int, n: int, k: int) -> float:
    # token p attends p + 1 keys: 1 for its GEMMs + (p + 1) / K for its attention
    return sum(1 + (p + 1) / k for p in range(start, start + n))


def test_cost_is_tokens_weighted_by_their_context() -> None:
    c = PrefillCost(4096, 896)
    for start, n in ((0, 1), (0, 512), (2048, 300), (16384, 128)):
        assert c.cost(start, n) == pytest.approx(brute_cost(start, n, 4096))
    # the same 512 tokens cost ~4.8x more at a 16k context than at the start of a prompt
    assert 4.7 < c.cost(16384, 512) / c.cost(0, 512) < 4.8


@pytest.mark.parametrize("start", [0, 100, 2048, 9000, 16384, 100_000])
@pytest.mark.parametrize("work", [1, 50, 896, 5000])
def test_fit_is_the_longest_chunk_within_the_work(start: int, work: int) -> None:
    c = PrefillCost(4096, 896)
    n = c.fit(start, work)
    assert c.cost(start, n) <= work
    assert c.cost(start, n + 1) > work


def test_default_cuda_chunks_at_2k_and_16k_contexts() -> None:
    c = cuda_cost()
    budget = c.budget
    # a prompt's start keeps the full 512-token chunks (the token cap binds)
    assert c.chunk(0, 512, budget, first=True) == 512
    assert c.chunk(512, 512, budget, first=True) == 512
    # then they shrink with the context, so a mixed step stays within ~3x a decode step
    assert c.chunk(2048, 512, budget, first=True) == 256
    assert c.chunk(8192, 512, budget, first=True) == 128
    assert c.chunk(16384, 512, budget, first=True) == 64
    # an agent's new turn of a few hundred tokens stays one chunk up to a ~6k context
    assert c.chunk(6000, 256, budget, first=True) == 256
    # chunks land on graph buckets (a 300-token chunk would be padded to 512 and cost it)
    for start in range(0, 40_000, 997):
        n = c.chunk(start, 512, budget, first=True)
        assert n in BUCKETS
        assert c.cost(start, n) <= budget or n == BUCKETS[0]


def test_a_prompts_last_chunk_is_not_rounded_down() -> None:
    c = cuda_cost()
    assert c.chunk(2048, 77, c.budget, first=True) == 77
    assert c.chunk(16384, 100, c.budget, first=True) == 100  # fits the work as it is


def test_a_huge_context_still_advances_but_a_second_chunk_waits() -> None:
    c = cuda_cost()
    assert c.cost(1_000_000, 32) > c.budget
    assert c.chunk(1_000_000, 512, c.budget, first=True) == 32  # the smallest bucket
    left = c.budget - c.cost(1_000_000, 32)  # the first chunk overran the budget
    assert c.chunk(1_000_000, 512, left, first=False) == 0


def test_a_later_chunk_in_the_step_takes_what_fits_unrounded() -> None:
    # a step with two chunks runs eagerly: no graph bucket to pad to
    c = cuda_cost()
    left = c.budget - c.cost(3000, 294)  # a resumed turn's tool result took its share
    n = c.chunk(3100, 218, left, first=False)
    assert n == c.fit(3100, left) and n not in BUCKETS and 0 < n < 218
    # without graph buckets the floor is min_chunk (and never more than what is pending)
    plain = PrefillCost(4096, 112)
    assert plain.chunk(1_000_000, 64, 112, first=True) == 16
    assert plain.chunk(1_000_000, 9, 112, first=True) == 9


def test_cpu_default_keeps_the_token_cap_at_agent_contexts_and_shrinks_beyond() -> None:
    scale, budget = DEFAULTS["cpu"]
    c = PrefillCost(scale, budget)
    assert c.chunk(2800, 64, budget, first=True) == 64
    n8k = c.chunk(8192, 64, budget, first=True)
    assert 16 < n8k < 64 and c.cost(8192, n8k) <= budget < c.cost(8192, n8k + 1)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        PrefillCost(0, 896)
    with pytest.raises(ValueError, match=">= 1"):
        PrefillCost(4096, 0)


def test_relative_budget_follows_the_decoders_work() -> None:
    # CPU-like: a decode row costs 8 prompt token-equivalents, prompt work <= 0.5x theirs
    c = PrefillCost(4096, 112, decode_ratio=0.5, decode_row=8.0)
    # 16 decoders at 3k: 0.5 * 8 * 16 * (1 + 3001/4096) = 110.9, under the absolute 112
    assert c.step_budget([3000] * 16) == pytest.approx(0.5 * 8 * 16 * (1 + 3001 / 4096))
    # 8 decoders at 800: half of the token cap's 64 tokens
    b8 = c.step_budget([800] * 8)
    assert b8 == pytest.approx(0.5 * 8 * 8 * (1 + 801 / 4096))
    n = c.chunk(800, 64, b8, first=True)
    assert n == c.fit(800, b8) == 31 and c.cost(800, n) <= b8 < c.cost(800, n + 1)
    # 4 decoders: the work fits 15 tokens, the floor gives the first chunk min_chunk
    assert c.fit(800, c.step_budget([800] * 4)) == 15
    assert c.chunk(800, 64, c.step_budget([800] * 4), first=True) == 16
    # many decoders at long contexts: the absolute budget stays the bound
    assert c.step_budget([8000] * 64) == 112
    # no decoders, or ratio 0: the absolute budget as before
    assert c.step_budget([]) == 112
    assert PrefillCost(4096, 112).step_budget([3000] * 16) == 112


def test_relative_budget_still_lets_a_prompt_advance() -> None:
    # one decoder at a short context has ~4 units of work: the budget floors at min_chunk's
    # cost, and a first chunk takes min_chunk whatever its context
    c = PrefillCost(4096, 112, decode_ratio=0.5, decode_row=8.0)
    budget = c.step_budget([10])
    assert budget == pytest.approx(c.cost(0, 16))
    assert c.chunk(0, 500, budget, first=True) == 16
    assert c.chunk(50_000, 500, budget, first=True) == 16  # costs more than budget: floor
    with pytest.raises(ValueError):
        PrefillCost(4096, 112, decode_ratio=-1)
    with pytest.raises(ValueError):
        PrefillCost(4096, 112, decode_row=0)


def _old_chunks(
    rows: list[tuple[int, int]], tokens: int, work: float, cost: PrefillCost
) -> list[int]:
    """A step's chunk sizes as Step.chunk_len sized them before --prefill-burst: one token
    budget and one work budget shared in order, the first chunk rounded to a bucket."""
    out, first = [], True
    for start, pending in rows:
        if tokens <= 0:
            break
        n = min(pending, tokens)
        if n > 1:
            n = cost.chunk(start, n, work, first)
            work -= cost.cost(start, n)
            first = False
        out.append(n)
        tokens -= n
    return out


def _step_chunks(
    rows: list[tuple[int, int]], tokens: int, work: float, cost: PrefillCost, burst: int
) -> tuple[list[int], Step]:
    """The same rows through Step.chunk_len with `burst` x the caps (as the scheduler sets
    them while others decode), the caller's token budget decremented as _take does."""
    step = Step([], [], [], work_left=work, tokens_left=tokens, cap_tokens=tokens)
    step.cap_work, step.burst_work = work, work * (burst - 1)
    step.burst_tokens = tokens * (burst - 1)
    budget, out = tokens * burst, []
    for start, pending in rows:
        if budget <= 0:
            break
        seq = SimpleNamespace(num_computed=start, num_pending=pending)
        n = step.chunk_len(seq, budget, cost)  # type: ignore[arg-type]
        out.append(n)
        budget -= n
    return out, step


ROWS = st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 1_500)), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, tokens=st.integers(16, 1_024), work=st.floats(1, 2_000))
def test_without_burst_room_chunks_are_sized_as_before(
    rows: list[tuple[int, int]], tokens: int, work: float
) -> None:
    cost = cuda_cost()
    want = _old_chunks(rows, tokens, work, cost)
    got, _ = _step_chunks(rows, tokens, work, cost, burst=1)
    assert got[: len(want)] == want and not any(got[len(want) :])


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, tokens=st.integers(16, 1_024), work=st.floats(1, 2_000), burst=st.integers(2, 8))
def test_burst_room_goes_only_to_whole_last_chunks_within_the_single_caps(
    rows: list[tuple[int, int]], tokens: int, work: float, burst: int
) -> None:
    """With burst room: chunks that do not end their prompt share the single caps (a first
    chunk may take the floor of the smallest bucket); a chunk that ends its prompt fits the
    single caps alone (or is that floor); the step stays within burst x both caps."""
    cost = cuda_cost()
    got, step = _step_chunks(rows, tokens, work, cost, burst)
    floor = BUCKETS[0]
    partial_tokens, partial_work, all_tokens, all_work = 0, 0.0, 0, 0.0
    for (start, pending), n in zip(rows, got):
        w = cost.cost(start, n) if n > 1 else 0.0
        all_tokens, all_work = all_tokens + n, all_work + w
        if n < pending:
            partial_tokens, partial_work = partial_tokens + n, partial_work + w
        elif n > 1:
            assert n <= tokens and (w <= work + 1e-9 or n <= floor), (start, n, w)
    assert partial_tokens <= tokens
    assert partial_work <= work + cost.cost(20_000, floor)
    assert all_tokens <= burst * tokens
    assert all_work <= burst * work + cost.cost(20_000, floor)
    assert step.burst_tokens >= 0 and step.burst_work >= -1e-6
