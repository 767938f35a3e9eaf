"""--trace-steps: a JSON line per step and per first event, from a real server on loopback
driven by `ds4pool bench agents`; bench/trace_report.py splits each first token's wait."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import trace_report
from ds4pool.cli import main
from tests.integration.conftest import Server
from tests.integration.test_bench_agents import TINY
from tests.integration.test_serve_cli import assert_one_line, serve_refused


def test_trace_of_an_agents_run(
    serve: Callable[..., Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "steps.jsonl"
    server = serve({"trace_steps": trace})
    argv = ["bench", "agents", "--url", server.url, *TINY, "--out", str(tmp_path)]
    assert main([*argv, "--label", "run", "--no-warmup"]) == 0
    server.engine.worker.trace.close()  # flushed: the module's server stays up
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [s for s in lines if "t0" in s]
    firsts = {s["rid"]: s for s in lines if "t0" not in s}
    news = {r["rid"]: r for s in steps for r in s.get("new", ())}
    assert len(news) == len(firsts) == 4  # 2 agents x 2 turns, each seen once
    sessions = sorted(r["session"] for r in news.values())
    assert sessions == ["agent-0-7", "agent-0-7", "agent-1-7", "agent-1-7"]
    for rid, r in news.items():
        chunk_steps = [s for s in steps if any(c[0] == rid for c in s["chunks"])]
        last = chunk_steps[-1]
        [chunk] = [c for c in last["chunks"] if c[0] == rid]
        assert chunk[2] + chunk[1] == chunk[3]  # its last chunk ends the prompt
        first = firsts[rid]
        # every stamp in the order the request went through the server
        stamps = [r["received"], r["arrival"], r["admitted"], chunk_steps[0]["t0"]]
        stamps += [last["t1"], first["pushed"], first["taken"]]
        assert stamps == sorted(stamps), (rid, stamps)
    assert all(s["t0"] <= s["t1"] and s["decode"] >= 0 for s in steps)

    capsys.readouterr()
    assert trace_report.main([str(trace), "--agents", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "4 requests with a first token; 4 matched to the client's turns" in out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines()}
    for group in ("first", "resumed"):
        cells = rows[group].strip("|").split("|")
        assert cells[1].strip() == "2"
        assert "n/a" not in rows[group], rows[group]  # every part measured


def test_a_trace_file_that_cannot_be_written_is_one_line(demo_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "steps.jsonl"
    proc = serve_refused(demo_dir, "--trace-steps", str(missing), "--port", "0")
    assert_one_line(proc, "--trace-steps", str(missing))


def test_a_trace_of_two_servers_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def line(arrival: float) -> str:
        new = {"rid": 1, "session": None, "received": None, "arrival": arrival, "admitted": 0}
        step = {"t0": 0.0, "t1": 0.1, "host": 0.0, "decode": 0, "chunks": [[1, 8, 0, 8]]}
        return json.dumps({**step, "new": [new]}) + "\n"

    trace = tmp_path / "two.jsonl"
    trace.write_text(line(1.0) + line(1.0))  # a preempted request comes back: fine
    assert trace_report.main([str(trace)]) == 0
    # the handler may write a first event before the worker writes the step's line
    first = json.dumps({"rid": 1, "pushed": 0.2, "taken": 0.3}) + "\n"
    trace.write_text(first + line(1.0))
    _, reqs = trace_report.read_trace(trace)
    assert (reqs[1].pushed, reqs[1].taken) == (0.2, 0.3)
    trace.write_text(line(1.0) + line(5.0))  # another server's request 1
    assert trace_report.main([str(trace)]) == 1
    assert "more than one server's run" in capsys.readouterr().err


def test_busy_periods_chain_overlapping_prompts() -> None:
    def req(rid: int, arrival: float, done: float | None) -> trace_report.Req:
        r = trace_report.Req(rid, None, None, arrival, arrival, arrival, done)
        r.parts = trace_report.split(r)
        return r

    # 1 and 2 overlap, 3 arrives before 2's first token (the chain), 4 after: alone;
    # 5 never got a first token
    reqs = [req(1, 0.0, 0.05), req(2, 0.01, 0.10), req(3, 0.09, 0.20), req(4, 0.5, 0.51)]
    reqs.append(req(5, 0.6, None))
    periods = trace_report.busy_periods(reqs)
    assert [[r.rid for r in p] for p in periods] == [[1, 2, 3], [4]]
    rows = {line.split("|")[1].strip(): line for line in trace_report.period_lines(reqs)}
    assert rows["1"].split("|")[2:6] == [" 1 ", " 1 ", " 0.0 ", " 10.0 "]
    # three requests: arrivals 90 ms apart, the last first token 200 ms after the first arrival
    assert rows["2-3"].split("|")[2:6] == [" 1 ", " 3 ", " 90.0 ", " 200.0 "]
