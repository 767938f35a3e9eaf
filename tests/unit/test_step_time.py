"""The ITL budget (sched/step_time.py): a step's prompt work from measured step times."""

from __future__ import annotations

import pytest

from ds4pool.kv.cost import StepSample
from ds4pool.sched.step_time import StepTime

CAP, FLOOR = 896.0, 16.0
MS = 1e-3


def decode(rows: int, seconds: float) -> StepSample:
    return StepSample(num_prefill_tokens=0, num_decode_rows=rows, seconds=seconds)


def mixed(rows: int, seconds: float, work: float) -> StepSample:
    return StepSample(num_prefill_tokens=int(work), num_decode_rows=rows, seconds=seconds,
                      prefill_work=work)  # fmt: skip


def test_unmeasured_means_the_cap() -> None:
    t = StepTime(2.5)
    assert t.budget(8, CAP, FLOOR) == CAP  # nothing measured
    t.observe(mixed(8, 30 * MS, 100))  # a mixed step before any decode-only one: unattributed
    assert t.seconds_per_work is None and t.budget(8, CAP, FLOOR) == CAP
    t.observe(decode(8, 10 * MS))  # decode known, prompt rate not yet
    assert t.budget(8, CAP, FLOOR) == CAP


def test_budget_keeps_a_mixed_step_within_factor_decode_steps() -> None:
    t = StepTime(2.5)
    t.observe(decode(8, 10 * MS))
    t.observe(mixed(8, 30 * MS, 100))  # 20 ms of prompt for 100 units: 0.2 ms a unit
    assert t.seconds_per_work == pytest.approx(0.2 * MS)
    # (2.5 - 1) x 10 ms / 0.2 ms = 75 units: 10 ms + 75 x 0.2 ms = 25 ms = 2.5 decode steps
    assert t.budget(8, CAP, FLOOR) == pytest.approx(75)
    assert StepTime(3.0, alpha=1.0).budget(8, CAP, FLOOR) == CAP  # a fresh one: unmeasured


def test_shrinks_when_slow_grows_back_when_fast_floor_and_cap_hold() -> None:
    t = StepTime(2.5)
    t.observe(decode(8, 10 * MS))
    t.observe(mixed(8, 30 * MS, 100))
    first = t.budget(8, CAP, FLOOR)
    for _ in range(3):  # the prompt's context grows: the same work now takes longer
        t.observe(mixed(8, 60 * MS, 100))
    slow = t.budget(8, CAP, FLOOR)
    assert slow < first * 0.6
    for _ in range(20):
        t.observe(mixed(8, 1000 * MS, 50))  # a huge context: the floor, not zero
    assert t.budget(8, CAP, FLOOR) == FLOOR
    for _ in range(40):
        t.observe(mixed(8, 11 * MS, 100))  # cheap again (0.01 ms a unit): back to the cap
    assert t.budget(8, CAP, FLOOR) == CAP
    for _ in range(40):
        t.observe(mixed(8, 30 * MS, 100))  # and back to the first size, within the EWMA
    assert t.budget(8, CAP, FLOOR) == pytest.approx(first, rel=0.01)


def test_no_decoders_or_factor_zero_is_the_cap() -> None:
    on, off = StepTime(2.5), StepTime(0.0)
    for t in (on, off):
        t.observe(decode(8, 10 * MS))
        t.observe(mixed(8, 100 * MS, 100))
    assert on.budget(8, CAP, FLOOR) < 200
    assert on.budget(0, CAP, FLOOR) == CAP  # no decoders: nothing to protect
    assert off.budget(8, CAP, FLOOR) == CAP  # off: today's work cap exactly
    assert off.budget(8, 112.0, FLOOR) == 112.0  # whatever the cap the step computed


def test_decode_time_per_rows_and_the_decoders_share_taken_out() -> None:
    t = StepTime(2.0, alpha=1.0)
    t.observe(decode(4, 8 * MS))
    t.observe(decode(16, 20 * MS))
    assert t.decode_s(4) == pytest.approx(8 * MS)
    assert t.decode_s(5) == pytest.approx(8 * MS)  # the nearest measured row count
    assert t.decode_s(10) == pytest.approx(20 * MS)  # a tie: the larger (the slower)
    t.observe(decode(4, 1e-6))  # timer noise
    assert t.decode_s(4) == pytest.approx(8 * MS)
    # the decode part is taken out of a mixed step by its own row count
    t.observe(mixed(16, 40 * MS, 100))
    assert t.seconds_per_work == pytest.approx(0.2 * MS)
    # a step measured faster than its decode estimate: at least a tenth is the prompt's
    t.observe(mixed(16, 10 * MS, 100))
    assert t.seconds_per_work == pytest.approx(0.01 * MS)


def test_a_prompt_only_step_is_the_first_guess_until_a_mixed_one() -> None:
    t = StepTime(2.5)
    t.observe(decode(8, 10 * MS))
    t.observe(StepSample(2048, 0, 0.21, prefill_work=2100))  # a lone prompt: 0.1 ms a unit
    assert t.seconds_per_work == pytest.approx(0.1 * MS)
    assert t.budget(8, CAP, FLOOR) == pytest.approx(150)  # 1.5 x 10 ms / 0.1 ms, not the cap
    t.observe(mixed(8, 50 * MS, 100))  # next to decoders: 0.4 ms a unit, replaces the guess
    assert t.seconds_per_work == pytest.approx(0.4 * MS)
    t.observe(StepSample(2048, 0, 0.21, prefill_work=2100))  # a lone prompt no longer counts
    assert t.budget(8, CAP, FLOOR) == pytest.approx(37.5)


@pytest.mark.parametrize("factor", [-1.0, 0.5, 1.0])
def test_factor_is_zero_or_above_one(factor: float) -> None:
    with pytest.raises(ValueError, match="itl_budget_factor must be 0 .off. or > 1"):
        StepTime(factor)
