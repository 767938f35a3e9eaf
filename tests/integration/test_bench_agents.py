"""`ds4pool bench agents` against a real server on loopback: the report's fields, exact
generation lengths (ignore_eos), and that resumed turns reuse the session's KV."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ds4pool.bench.agents import code_text, make_vocab, steps_note
from ds4pool.cli import main
from tests.integration.conftest import Server

TINY = [
    "--agents", "2", "--turns", "2", "--system-tokens", "120", "--user-tokens", "30",
    "--gen-tokens", "4", "--think-s", "0", "0", "--seed", "7",
]  # fmt: skip

BLOCK_SIZE = 16  # the test server's KV block size (ds4pool's default)


def _run(server: Server, out: Path, label: str, *extra: str) -> dict:
    argv = ["bench", "agents", "--url", server.url, *TINY, "--out", str(out), "--label", label]
    assert main([*argv, *extra]) == 0
    return json.loads((out / f"{label}.json").read_text())


def test_report_fields_and_reuse(
    serve: Callable[..., Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run(serve(), tmp_path, "tiny")
    assert "| tiny | 2 | 4/4 | 0 |" in capsys.readouterr().out  # the markdown table
    keys = "wall_s ttft_first_s ttft_resumed_s itl_s tpot_s gen_tok_s prefill session_moves"
    for key in [*keys.split(), "workload", "machine_before", "turns"]:
        assert key in report, key
    assert report["turns_ok"] == 4 and report["errors"] == 0 and report["turns_skipped"] == 0
    assert report["ttft_first_s"]["n"] == 2 and report["ttft_resumed_s"]["n"] == 2
    assert report["ttft_resumed_s"]["p50"] > 0 and report["gen_tok_s"] > 0
    # the fixture's server has no Prometheus metrics (ds4pool serve has): n/a is None
    assert report["session_moves"] is None or isinstance(report["session_moves"], dict)
    turns = {(t["agent"], t["turn"]): t for t in report["turns"]}
    for agent in (0, 1):
        first, second = turns[agent, 0], turns[agent, 1]
        assert first["completion_tokens"] == second["completion_tokens"] == 4  # ignore_eos
        # a first turn can only reuse the other agent's shared system prompt: whole blocks
        assert first["cached_tokens"] < first["prompt_tokens"]
        assert first["cached_tokens"] % BLOCK_SIZE == 0
        # the whole previous turn (prompt + reply but its last sampled token) was reused
        assert second["cached_tokens"] == first["prompt_tokens"] + 4 - 1
    # every streamed chunk is counted; the demo model's UTF-8 fragments can share one
    chunks = sum(len(t["gaps"]) + 1 for t in report["turns"])
    assert report["content_chunks"] == chunks <= report["completion_tokens"] == 16
    assert report["tokens_per_chunk"] == 16 / chunks
    prefill = report["prefill"]
    assert prefill["reused_resumed"] > prefill["computed_resumed"]
    assert prefill["computed"] + prefill["reused"] == prefill["prompt_tokens"]


def test_the_servers_steps_over_the_measured_part(
    serve: Callable[..., Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against a server with metrics the report says what its steps were while the clock
    ran (not during the warm-up): how many, how long, rows and tokens, the queue wait."""
    report = _run(serve(metrics=True), tmp_path, "steps")
    st = report["server_steps"]
    assert st["admitted"] == 4  # the measured turns: the 2 warm-up requests came before
    # 4 turns of 4 tokens: a prompt step each (it samples the first token), 3 decode rows
    assert 4 <= st["steps"] <= 4 * 4 and st["step_ms"] > 0 and st["host_ms"] >= 0
    assert 1 <= st["rows"] <= 2 and st["tokens"] >= 1 and st["queue_wait_ms"] >= 0
    # the engine's TTFT (from arrival) is within what the client measured over HTTP
    client = report["ttft_first_s"]["mean"] + report["ttft_resumed_s"]["mean"]
    assert 0 < st["ttft_ms"] <= client / 2 * 1e3
    assert report["session_moves"] is not None  # ds4pool's counters are there too
    # the model's CPU threads at the end (ds4pool_cpu_threads), which the steps line names
    n = report["server_cpu_threads"]
    assert n is not None and n >= 1
    on = f"{st['steps']:,} steps on {n} CPU thread{'s' * (n != 1)} of"
    assert "steps: " in capsys.readouterr().err and on in (steps_note(report) or "")
    # a server without metrics: n/a, and no line
    plain = _run(serve(), tmp_path, "plain")
    assert plain["server_steps"] is None and steps_note(plain) is None
    assert plain["server_cpu_threads"] is None


def test_agents_dealt_to_client_processes(serve: Callable[..., Server], tmp_path: Path) -> None:
    """--client-procs 2: each agent's turns come from one of two processes, all of them,
    each resumed turn on its own session's KV, and the CPU of both is counted."""
    report = _run(serve(), tmp_path, "two", "--client-procs", "2", "--seed", "9")
    assert report["client_procs"] == 2 and report["client_cpu_s"] > 0
    assert report["turns_ok"] == 4 and report["errors"] == 0
    turns = {(t["agent"], t["turn"]): t for t in report["turns"]}
    assert sorted(turns) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for agent in (0, 1):
        first, second = turns[agent, 0], turns[agent, 1]
        assert second["cached_tokens"] == first["prompt_tokens"] + 4 - 1


def test_no_session_header_reuses_only_shared_blocks(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """Without a session a request keeps nothing of its own: all it can reuse is indexed
    full KV blocks (the shared system prompt, earlier turns' full blocks), never the
    partial block and reply a session would keep."""
    report = _run(serve(), tmp_path, "plain", "--no-session-header", "--seed", "8")
    assert report["turns_ok"] == 4
    for t in report["turns"]:
        assert t["cached_tokens"] % BLOCK_SIZE == 0 and t["cached_tokens"] < t["prompt_tokens"]


def test_workload_text_is_seeded() -> None:
    def text(seed: int) -> str:
        return code_text(random.Random(seed), make_vocab(seed), 200, 6.0)

    assert text(1) == text(1) != text(2)


def test_the_warm_up_computes_first_turns_that_no_measured_turn_reuses(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """The warm-up's requests (not measured) prefill prompts of a first turn's size on the
    server, and the measured turns find nothing of them cached: the same reuse as a run
    without a warm-up."""
    cold, warm = serve(), serve()
    a = _run(cold, tmp_path, "cold", "--agents", "1", "--no-warmup")
    b = _run(warm, tmp_path, "warm", "--agents", "1", "--warmup-requests", "2")
    assert (a["warmup_requests"], b["warmup_requests"]) == (0, 2)
    assert [t["cached_tokens"] for t in a["turns"]] == [t["cached_tokens"] for t in b["turns"]]
    assert a["turns"][0]["cached_tokens"] == 0 and b["turns_ok"] == 2
    # the server computed and indexed the warm-up's prompts: about two more first turns
    extra = warm.engine.pool.usage().device_blocks_indexed
    extra -= cold.engine.pool.usage().device_blocks_indexed
    assert extra >= a["turns"][0]["prompt_tokens"] // BLOCK_SIZE


def test_the_default_warm_up_is_one_request_per_agent_up_to_four(
    serve: Callable[..., Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = serve()
    assert _run(server, tmp_path, "two")["warmup_requests"] == 2  # TINY: 2 agents
    argv = ["bench", "agents", "--url", server.url, *TINY, "--warmup-requests", "-1"]
    assert main(argv) != 0
    assert "--warmup-requests must be >= 0" in capsys.readouterr().err
