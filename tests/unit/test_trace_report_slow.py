"""bench/trace_report.py's slow steps: the steps far over the median of their kind."""

from __future__ import annotations

from bench import trace_report


def step(t0: float, ms: float, chunks: int, decode: int = 0, host: float = 0.0) -> dict:
    return {
        "t0": t0,
        "t1": t0 + ms / 1e3,
        "decode": decode,
        "chunks": [[i, 8, 0, 8] for i in range(chunks)],
        "host": host,
    }


def test_a_slow_step_is_listed_with_the_idle_time_before_it() -> None:
    steps = [step(0.0, 10, 1), step(0.011, 10, 1), step(0.022, 60, 8, decode=3)]
    steps += [step(0.083, 61, 8), step(0.5, 900, 8, decode=1, host=0.02), step(1.41, 62, 8)]
    steps += [step(1.48, 45, 1)]  # 4.5x the 1-chunk median: listed; 8-chunk ones at 1x: not
    lines = trace_report.slow_steps(steps)
    assert lines[0].startswith("2 steps took over 3x")
    rows = [line.strip("|").split("|") for line in lines[3:]]
    assert [float(r[1].replace(",", "")) for r in rows] == [900.0, 45.0]  # longest first
    slow = rows[0]
    assert float(slow[2]) == 61.5  # the 8-chunk steps' median
    assert (int(slow[3]), int(slow[4])) == (1, 8)
    assert float(slow[5]) == 356.0  # 0.5 s - (0.083 + 0.061) s: idle before it
    assert float(slow[6]) == 20.0
    assert slow[7].strip() == "n/a / n/a"  # a trace from before the launch's CPU was written


def test_a_slow_step_shows_its_launch_call_against_the_threads_cpu_in_it() -> None:
    """A launch call far longer than the step thread's CPU time in it waited (run M's wave
    steps: the GIL behind the API's threads)."""
    steps = [step(0.0, 40, 2), step(0.05, 38, 2), step(0.1, 39, 2), step(0.2, 160, 2)]
    for s in steps:
        s["ret"], s["cpu"] = s["t1"] - 0.002, 0.030
    steps[-1]["cpu"] = 0.031
    rows = [line.strip("|").split("|") for line in trace_report.slow_steps(steps)[3:]]
    assert len(rows) == 1 and rows[0][7].strip() == "158.0 / 31.0"


def test_no_step_is_slow_in_a_steady_trace() -> None:
    steps = [step(i * 0.02, 10 + i % 3, 1) for i in range(20)]
    assert trace_report.slow_steps(steps)[0].startswith("0 steps")


def test_the_step_table_counts_the_steps_that_ran_eagerly() -> None:
    steps = [step(0.0, 50, 8), step(0.06, 20, 8), step(0.09, 10, 1)]
    steps[0]["eager"] = 1
    lines = trace_report.step_lines(steps)
    assert lines[0].startswith("| prompt chunks | steps | eager |")
    rows = {r.strip("|").split("|")[0].strip(): r.strip("|").split("|") for r in lines[2:]}
    assert (rows["8"][1].strip(), rows["8"][2].strip()) == ("2", "1")
    assert (rows["1"][1].strip(), rows["1"][2].strip()) == ("1", "0")
