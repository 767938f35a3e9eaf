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
    proc = run_cli("generate", "--prompt", "def add(a, b):", "--max-tokens", "12", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # the completion, nothing else
    assert "prefill:" in proc.stderr and "decode:" in proc.stderr and "tok/s" in proc.stderr
    assert "prefill:" not in proc.stdout
    # greedy by default: the same command prints the same text
    again = run_cli("generate", "--prompt", "def add(a, b):", "--max-tokens", "12", cache=cache)
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
    a, b = run_cli(*args, cache=cache), run_cli(*args, cache=cache)
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
    model = tmp_path / "m"
    build_hf_model("llama", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((demo_dir / name).read_bytes())
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated download
    proc = run_cli("generate", "--model", str(model), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "model.safetensors")
    weights.unlink()
    proc = run_cli("generate", "--model", str(model), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "safetensors")
    (model / "config.json").unlink()
    proc = run_cli("generate", "--model", str(model), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "config.json")
    proc = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "nope")


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

    if not torch.cuda.is_available():
        proc = run_cli("generate", "--device", "cuda", "--prompt", "x", cache=cache)
        assert_one_line_error(proc, "cuda")
    proc = run_cli("generate", "--dtype", "float8", "--prompt", "x", cache=cache)
    assert_one_line_error(proc, "float8")
    proc = run_cli("generate", "--device", "tpu", "--prompt", "x", cache=cache)
    assert_one_line_error(proc, "tpu")


def test_bad_sampling_values(cache: Path) -> None:
    proc = run_cli("generate", "--prompt", "x", "--top-p", "1.5", cache=cache)
    assert_one_line_error(proc, "top_p")
    proc = run_cli("generate", "--prompt", "x", "--max-tokens", "0", cache=cache)
    assert_one_line_error(proc, "max-tokens")
