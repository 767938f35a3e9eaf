"""bench/agents_compare.py --variant: more ds4pool configurations in one comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agents_compare import (
    kv_bytes_per_token,
    main,
    parse_args,
    server_command,
    table,
    targets,
)


def test_a_variant_is_ds4pool_serve_with_its_flags() -> None:
    args = parse_args(
        ["--servers", "ds4pool", "ds4pool:main", "--variant", "main=--max-prefill-tokens 64"]
    )
    argv, _, client = server_command("ds4pool:main", Path("/m"), 1234, args)
    assert argv[1:4] == ["-m", "ds4pool", "serve"] and argv[-2:] == ["--max-prefill-tokens", "64"]
    plain, _, _ = server_command("ds4pool", Path("/m"), 1234, args)
    assert "--max-prefill-tokens" not in plain and client == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_before_is_ds4pool_serve_imported_from_the_refs_worktree(tmp_path: Path) -> None:
    """The ds4pool:before server imports the tree's package, even started from the
    repository's root, where `python -m` would put the code under test first (it did until
    session 41: every before/after run compared the current code with itself)."""
    tree = tmp_path / "tree"
    (tree / "ds4pool").mkdir(parents=True)
    (tree / "ds4pool" / "__init__.py").write_text("")
    args = parse_args(["--servers", "ds4pool", "ds4pool:before", "--before-ref", "HEAD~1"])
    args.before_tree = tree
    argv, env, _ = server_command("ds4pool:before", Path("/m"), 1234, args)
    assert argv[1:4] == ["-m", "ds4pool", "serve"]
    probe = [argv[0], "-c", "import ds4pool; print(ds4pool.__file__)"]
    root = Path(__file__).resolve().parents[2]
    found = subprocess.run(probe, env=env, cwd=root, capture_output=True, text=True, check=True)
    assert Path(found.stdout.strip()) == tree / "ds4pool" / "__init__.py"
    _, plain_env, _ = server_command("ds4pool", Path("/m"), 1234, args)
    found = subprocess.run(probe, env=plain_env, cwd=root, capture_output=True, text=True)
    assert Path(found.stdout.strip()) == root / "ds4pool" / "__init__.py"
    args.before_tree = tmp_path / "empty"  # no package there: refused, not served from main
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="would import"):
        server_command("ds4pool:before", Path("/m"), 1234, args)
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


def _targets(*servers: tuple[str, float, float]) -> list[str]:
    return targets([report(*s) for s in servers])


def test_every_variant_gets_its_own_target_line() -> None:
    lines = _targets(
        ("ds4pool", 0.4, 40.0), ("ds4pool:main", 0.8, 20.0), ("llama-server", 0.05, 30.0)
    )
    assert len(lines) == 2
    mine = next(x for x in lines if x.startswith("N=16, ds4pool vs"))
    old = next(x for x in lines if x.startswith("N=16, ds4pool:main vs"))
    assert "gen tok/s 1.33x" in mine and "ITL p50 8.00x" in mine
    assert "gen tok/s 0.67x" in old and "ITL p50 16.00x" in old


def _llama_files(tmp_path: Path) -> tuple[Path, Path]:
    """An empty GGUF and an executable that stands in for llama-server (never started)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return gguf, exe


def test_the_gpu_comparison_serves_bf16_on_cuda_with_one_llama_slot_per_agent(
    tmp_path: Path,
) -> None:
    gguf, exe = _llama_files(tmp_path)
    args = parse_args(
        ["--device", "cuda", "--servers", "ds4pool", "llama-server", "--llama-slots", "agents"]
        + ["--gguf", str(gguf), "--llama-server", str(exe), "--llama-args", "-ngl 99"]
    )
    argv, _, _ = server_command("ds4pool", Path("/m"), 1234, args, 32)
    assert argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    llama, _, _ = server_command("llama-server", Path("/m"), 1234, args, 32)
    assert llama[llama.index("-np") + 1] == "32" and "-ngl" in llama
    assert llama[llama.index("-c") + 1] == str(32 * args.llama_slot_ctx)
    cpu = parse_args(["--servers", "ds4pool", "--dtype", "bfloat16"])
    assert (cpu.device, cpu.dtype) == ("cpu", "bfloat16")
    with pytest.raises(SystemExit):
        parse_args(["--llama-slots", "0"])


def test_the_kv_budget_counts_the_dtypes_bytes(tmp_path: Path) -> None:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    assert kv_bytes_per_token(tmp_path) == 3 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 3 * 2 * 2 * 16 * 2


def test_transformers_serve_gets_an_empty_hub_cache_of_the_runs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers serve's /v1/models (the readiness probe) fails where the hub cache
    directory does not exist: the run gives it an existing, empty one under --out; its
    requests name the model directory the server is pinned to."""
    exe = tmp_path / "transformers"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=":")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2})
    )
    args = parse_args(
        ["--device", "cuda", "--servers", "transformers", "--out", str(tmp_path / "o")]
    )
    argv, env, client = server_command("transformers", tmp_path / "m", 1234, args, 16)
    assert Path(env["HF_HUB_CACHE"]).is_dir() and env["HF_HUB_OFFLINE"] == "1"
    assert argv[argv.index("--device") + 1] == "cuda" and "--no-ignore-eos" in client
    # the requests name the model it is pinned to (5.17 answers 400 to any other name)
    assert client[client.index("--model") + 1] == str(tmp_path / "m")


def test_a_comparison_whose_runs_all_failed_has_no_target_lines() -> None:
    assert targets([]) == []


def test_a_llama_variant_sets_its_own_slots_and_context(tmp_path: Path) -> None:
    """-np 4 and one slot per agent in one comparison: ITL at equal concurrency."""
    gguf, exe = _llama_files(tmp_path)
    args = parse_args(
        ["--servers", "ds4pool", "llama-server", "llama-server:all", "llama-server:poll"]
        + ["--llama-variant", "all=-np agents --poll 0", "--llama-variant", "poll=--poll 0"]
        + ["--gguf", str(gguf), "--llama-server", str(exe), "--llama-args", "-fa on"]
    )
    plain, _, _ = server_command("llama-server", Path("/m"), 1234, args, 16)
    every, _, _ = server_command("llama-server:all", Path("/m"), 1234, args, 16)
    poll, _, _ = server_command("llama-server:poll", Path("/m"), 1234, args, 16)
    assert plain[plain.index("-np") + 1] == "4" and "--poll" not in plain
    assert every[every.index("-np") + 1] == "16" and every.count("-np") == 1
    assert every[every.index("-c") + 1] == str(16 * args.llama_slot_ctx)
    assert every[every.index("--poll") + 1] == "0" and "-fa" in every
    assert poll[poll.index("-np") + 1] == "4" and "--poll" in poll
    with pytest.raises(SystemExit):  # a slot count that is not one
        parse_args(["--llama-variant", "x=-np zero"])
    with pytest.raises(SystemExit):
        parse_args(["--llama-variant", "x=--parallel"])
    with pytest.raises(SystemExit):  # listed without its --llama-variant
        parse_args(["--servers", "llama-server:x"])


def test_ds4pool_is_held_to_llama_servers_goals_against_each_llama_variant() -> None:
    lines = _targets(
        ("ds4pool", 0.4, 40.0), ("llama-server", 0.05, 30.0), ("llama-server:np16", 0.2, 20.0)
    )
    assert len(lines) == 2
    np16 = next(x for x in lines if "vs llama-server:np16" in x)
    assert "gen tok/s 2.00x" in np16 and "ITL p50 2.00x theirs" in np16 and "met)" in np16


def _full(server: str, sha: str) -> dict:
    ms = {"p50": 0.1, "p95": 0.2}
    return {
        **report(server, 0.1, 10.0),
        "turns_ok": 1,
        "turns_planned": 1,
        "ttft_first_s": ms,
        "ttft_resumed_s": ms,
        "itl_s": ms,
        "wall_s": 1.0,
        "prefill": {"computed": 1, "reused": 0},
        "session_moves": None,
        "machine_before": {"loadavg": [0.0]},
        "turns": [{"agent": 0, "turn": 0, "reply_sha256": sha, "error": None}],
    }


def test_the_text_is_compared_with_a_ds4pool_variant_when_plain_ds4pool_did_not_run() -> None:
    rows = table([_full("ds4pool:t2", "a"), _full("llama-server", "a"), _full("x", "b")])
    same = [line.split("|")[12].strip() for line in rows.splitlines()[2:]]
    assert same == ["1/1", "1/1", "0/1"]  # before: n/a, n/a, n/a


def _run(server: str, agents: int, itl: float, tps: float, device: str | None) -> dict:
    r = {**_full(server, "a"), "workload": {"agents": agents, "model": "/m", "turns": 4}}
    r["itl_s"], r["gen_tok_s"] = {"p50": itl, "p95": itl}, tps
    r["ttft_by_turn_s"] = {"0": {"p50": 0.1}, "1": {"p50": 0.1}}  # for the plot
    return r if device is None else {**r, "device": device}


def _comparison(path: Path, *runs: dict) -> Path:
    path.mkdir(parents=True)
    (path / "agents_compare.json").write_text(
        json.dumps({"header": f"runs of {path.name}", "failures": [], "reports": list(runs)})
    )
    return path


def test_merge_gives_one_table_and_the_targets_at_every_n(tmp_path: Path) -> None:
    """bench/h200_agents.sh runs every server and N in a comparison of its own: --merge puts
    them in one table and holds ds4pool to the goals at each N, by the runs' device (on
    CUDA: at least llama-server's ITL; on CPU: at most 2x llama-server -np 4's)."""
    a = _comparison(tmp_path / "a", _run("ds4pool", 16, 0.008, 900.0, "cuda"))
    b = _comparison(tmp_path / "b", _run("llama-server", 16, 0.013, 500.0, "cuda"))
    c = _comparison(  # older runs that did not record their device: --device says
        tmp_path / "c",
        _run("ds4pool", 64, 0.035, 1200.0, None),
        _run("llama-server", 64, 0.030, 600.0, None),
    )
    out = tmp_path / "all"
    args = ["--merge", str(a), str(b / "agents_compare.json"), str(c), "--device", "cuda"]
    assert main([*args, "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    text = (out / "agents_compare.md").read_text()
    assert text.count("\n| ds4pool |") == 2 and text.count("\n| llama-server |") == 2
    n16 = next(x for x in text.splitlines() if x.startswith("N=16, ds4pool vs llama-server"))
    n64 = next(x for x in text.splitlines() if x.startswith("N=64, ds4pool vs llama-server"))
    assert "ITL p50 0.62x theirs [0.62] (target <= 1x: met)" in n16
    assert "ITL p50 1.17x theirs [1.17] (target <= 1x: NOT met)" in n64
    assert "gen tok/s 2.00x" in n64
    merged = json.loads((out / "agents_compare.json").read_text())
    assert {r["device"] for r in merged["reports"]} == {"cuda"} and "runs of a" in text
    # the same 64-agent runs judged as CPU runs: 1.17x is within the 2x goal
    cpu = main(["--merge", str(c), "--out", str(tmp_path / "cpu"), "--plot", str(tmp_path / "q")])
    assert cpu == 0
    assert "(target <= 2x: met)" in (tmp_path / "cpu" / "agents_compare.md").read_text()


def test_merge_of_a_file_that_is_no_comparison_exits_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"reports": 3, "failures": [], "header": ""}')
    with pytest.raises(SystemExit, match="is not an agents_compare.json"):
        main(["--merge", str(bad), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="is not an agents_compare.json"):
        main(["--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
