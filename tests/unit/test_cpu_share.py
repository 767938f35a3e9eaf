"""cpu_share.ThreadGovernor: the model's threads give a core back while other processes
keep one busy, and take it again once they stop (fake /proc readings and clock), and the
engine runs it before every step where its start-up probe chose one thread per core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.cpu_share import ThreadGovernor, read_cpu_seconds


class Machine:
    """Busy seconds of the whole machine and of this process, advanced by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.readable = 0.0, 1000.0, 10.0, True
        self.set_calls: list[int] = []

    def run(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass, in which other processes use `others` cores and this one `own`."""
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def read(self) -> tuple[float, float] | None:
        return (self.busy, self.own) if self.readable else None


def governor(m: Machine) -> ThreadGovernor:
    return ThreadGovernor(1, 2, m.set_calls.append, m.read, lambda: m.now)


def test_a_core_goes_back_while_others_use_one_and_comes_back_after() -> None:
    m = Machine()
    g = governor(m)
    assert g.threads == 2 and g.tick() == 2 and m.set_calls == []  # started with the probe's
    m.run(1.0, others=0.05, own=1.9)  # the model busy on both cores, nothing else
    assert g.tick() == 2 and g.others == pytest.approx(0.05) and m.set_calls == []
    m.run(0.5, others=1.0, own=1.0)  # a build starts: within the interval, nothing read
    assert g.tick() == 2 and m.set_calls == []
    m.run(0.6, others=1.0, own=1.0)
    assert g.tick() == 1 and m.set_calls == [1] and g.others == pytest.approx(1.0)
    m.run(1.5, others=0.4, own=1.0)  # between the thresholds: stays
    assert g.tick() == 1 and m.set_calls == [1]
    m.run(1.5, others=0.1, own=1.0)  # the build is over: calm for 1.5 s, not yet 5
    assert g.tick() == 1 and m.set_calls == [1]
    m.run(1.5, others=0.6, own=1.0)  # a burst: the calm starts again
    assert g.tick() == 1 and m.set_calls == [1]
    for _ in range(3):
        m.run(1.5, others=0.1, own=1.0)
        assert g.tick() == 1
    m.run(1.5, others=0.1, own=1.0)  # 6 s of calm
    assert g.tick() == 2 and m.set_calls == [1, 2] and g.switches == 2
    m.run(1.5, others=0.9, own=1.0)  # back to fewer at the first busy reading
    assert g.tick() == 1 and m.set_calls == [1, 2, 1]


def test_without_proc_stat_the_count_stays() -> None:
    m = Machine()
    m.readable = False
    g = governor(m)
    m.run(2.0, others=2.0, own=0.0)
    assert g.tick() == 2 and g.others is None and m.set_calls == []


def test_this_machines_reading() -> None:
    got = read_cpu_seconds()
    if not Path("/proc/stat").exists():
        assert got is None
        return
    assert got is not None
    busy, own = got
    assert busy > 0 and 0 < own <= busy  # this process's time is part of the machine's


def test_the_engine_runs_it_before_each_step_where_the_probe_chose_more(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds4pool import threads
    from ds4pool.model.loader import load_model
    from tests.unit.test_sharing import engine, ids, run

    loaded = load_model(str(demo_dir), torch.device("cpu"), torch.float32)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "PROBE_FASTER", 0.0)  # no time counts as faster
        e = engine(loaded, cpu_threads=1, cpu_threads_up_to=2)
        try:
            assert e.thread_probe is not None and e.thread_probe.chosen == 1
            assert e.governor is None and e.worker.before_step is None
        finally:
            e.close()
        monkeypatch.setattr(threads, "PROBE_FASTER", 100.0)  # any time counts as faster
        e = engine(loaded, cpu_threads=1, cpu_threads_up_to=2)
        try:
            g = e.governor
            assert g is not None and (g.fewer, g.more, g.threads) == (1, 2, 2)
            assert e.worker.before_step == g.tick and e.cpu_threads == 2
            ticks = []
            monkeypatch.setattr(g, "tick", lambda: ticks.append(1) or 2)
            e.worker.before_step = g.tick
            run(e, ids(1, 40), "s")
            assert len(ticks) >= 2  # a prompt step and decode steps
        finally:
            e.close()
    finally:
        torch.set_num_threads(before)
