"""bench/agents_compare.py --variant: more ds4pool configurations in one comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.agents_compare import parse_args, server_command, targets


def test_a_variant_is_ds4pool_serve_with_its_flags() -> None:
    args = parse_args(
        ["--servers", "ds4pool", "ds4pool:main", "--variant", "main=--max-prefill-tokens 64"]
    )
    argv, _, client = server_command("ds4pool:main", Path("/m"), 1234, args)
    assert argv[1:4] == ["-m", "ds4pool", "serve"] and argv[-2:] == ["--max-prefill-tokens", "64"]
    plain, _, _ = server_command("ds4pool", Path("/m"), 1234, args)
    assert "--max-prefill-tokens" not in plain and client == []


def test_before_is_ds4pool_serve_imported_from_the_refs_worktree() -> None:
    args = parse_args(["--servers", "ds4pool", "ds4pool:before", "--before-ref", "HEAD~1"])
    args.before_tree = Path("/tmp/tree")
    argv, env, _ = server_command("ds4pool:before", Path("/m"), 1234, args)
    assert argv[1:4] == ["-m", "ds4pool", "serve"] and env["PYTHONPATH"] == "/tmp/tree"
    _, plain_env, _ = server_command("ds4pool", Path("/m"), 1234, args)
    assert "PYTHONPATH" not in plain_env or plain_env["PYTHONPATH"] != "/tmp/tree"
    with pytest.raises(SystemExit):  # ds4pool:before without a ref
        parse_args(["--servers", "ds4pool:before"])


def test_unknown_servers_and_bad_variants_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--servers", "ds4pool:nope"])
    with pytest.raises(SystemExit):
        parse_args(["--variant", "no-equals-sign"])


def report(server: str, itl: float, tps: float) -> dict:
    return {
        "server": server,
        "workload": {"agents": 16},
        "ttft_resumed_s": {"p50": 1.0},
        "itl_s": {"p50": itl},
        "gen_tok_s": tps,
    }


def test_every_variant_gets_its_own_target_line() -> None:
    lines = targets(
        [
            report("ds4pool", 0.4, 40.0),
            report("ds4pool:main", 0.8, 20.0),
            report("llama-server", 0.05, 30.0),
        ]
    )
    assert len(lines) == 2
    mine = next(x for x in lines if x.startswith("N=16, ds4pool vs"))
    old = next(x for x in lines if x.startswith("N=16, ds4pool:main vs"))
    assert "gen tok/s 1.33x" in mine and "ITL p50 8.00x" in mine
    assert "gen tok/s 0.67x" in old and "ITL p50 16.00x" in old
