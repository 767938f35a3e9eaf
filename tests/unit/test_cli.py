"""`ds4pool generate` as a user runs it: a real subprocess, stdout/stderr and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import build_hf_model


def run_cli(*args: str, cache: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS4POOL_CACHE=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "ds4pool", *args],
        capture_output=True,
        text=True,
        env=env,
        input=stdin,
        timeout=120,
    )


def run_clis(*commands: list[str], cache: Path) -> list[subprocess.CompletedProcess]:
    """Independent invocations side by side (each one's start-up is mostly the imports)."""
    env = dict(os.environ, DS4POOL_CACHE=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ds4pool", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for args in commands
    ]
    done = []
    for args, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return done


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Path:
    return demo_dir.parent  # the session's demo model, already written


def test_generate_prints_completion_and_timing(cache: Path) -> None:
    args = ["generate", "--prompt", "def add(a, b):", "--max-tokens", "12"]
    proc, again = run_clis(args, args, cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # the completion, nothing else
    assert "prefill:" in proc.stderr and "decode:" in proc.stderr and "tok/s" in proc.stderr
    assert "prefill:" not in proc.stdout
    # greedy by default: the same command prints the same text
    assert again.stdout == proc.stdout


def test_generate_chat_seeded_sampling_is_reproducible(cache: Path) -> None:
    args = [
        "generate",
        "--chat",
        "--prompt",
        "hello",
        "--max-tokens",
        "10",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "42",
    ]
    a, b = run_clis(args, args, cache=cache)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_prompt_from_stdin(cache: Path) -> None:
    proc = run_cli("generate", "--prompt", "-", "--max-tokens", "4", cache=cache, stdin="hi")
    assert proc.returncode == 0, proc.stderr


def test_unknown_architecture(tmp_path: Path, demo_dir: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    cfg = json.loads((demo_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("generate", "--model", str(model), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_missing_and_corrupt_files(tmp_path: Path, demo_dir: Path) -> None:
    def model_dir(name: str) -> Path:
        model = tmp_path / name
        build_hf_model("llama", model)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (model / f).write_bytes((demo_dir / f).read_bytes())
        return model

    truncated, no_weights, no_config = model_dir("t"), model_dir("w"), model_dir("c")
    weights = truncated / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated download
    (no_weights / "model.safetensors").unlink()
    (no_config / "model.safetensors").unlink()
    (no_config / "config.json").unlink()
    procs = run_clis(
        *(
            ["generate", "--model", str(m), "--prompt", "x"]
            for m in (truncated, no_weights, no_config, tmp_path / "nope")
        ),
        cache=tmp_path,
    )
    for proc, fragment in zip(
        procs, ("model.safetensors", "safetensors", "config.json", "nope"), strict=True
    ):
        assert_one_line_error(proc, fragment)


def test_corrupt_config_json(tmp_path: Path, demo_dir: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    proc = run_cli("generate", "--model", str(model), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "config.json")


def test_prompt_longer_than_context(tmp_path: Path, demo_dir: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    for f in demo_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    cfg = json.loads((demo_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 32
    (model / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("generate", "--model", str(model), "--prompt", "word " * 100, cache=tmp_path)
    assert_one_line_error(proc, "context")


def test_unavailable_device_and_bad_dtype(cache: Path) -> None:
    import torch

    cases = [(["--dtype", "float8"], "float8"), (["--device", "tpu"], "tpu")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "cuda"))
    procs = run_clis(*(["generate", *flags, "--prompt", "x"] for flags, _ in cases), cache=cache)
    for proc, (_, fragment) in zip(procs, cases, strict=True):
        assert_one_line_error(proc, fragment)


def test_bad_sampling_values(cache: Path) -> None:
    top_p, max_tokens = run_clis(
        ["generate", "--prompt", "x", "--top-p", "1.5"],
        ["generate", "--prompt", "x", "--max-tokens", "0"],
        cache=cache,
    )
    assert_one_line_error(top_p, "top_p")
    assert_one_line_error(max_tokens, "max-tokens")
