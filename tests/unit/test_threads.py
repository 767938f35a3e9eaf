"""The command line's OpenMP defaults: set before torch loads, never over the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys
from ds4pool.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules, "policy:", os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def test_cli_sets_passive_before_torch(env: dict[str, str]) -> None:
    assert _run(env) == "torch loaded: False policy: PASSIVE"


def test_user_value_wins(env: dict[str, str]) -> None:
    assert _run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "torch loaded: False policy: ACTIVE"


def test_no_effect_after_torch_loaded() -> None:
    import torch  # noqa: F401

    from ds4pool.threads import apply_thread_env

    environ: dict[str, str] = {}
    assert apply_thread_env(environ) == {} and environ == {}


def test_a_server_leaves_one_core_to_its_http_side() -> None:
    from ds4pool.threads import server_cpu_threads

    assert server_cpu_threads("auto", 2, {}) == 1  # the 2-core box: one model thread
    assert server_cpu_threads("auto", 16, {}) == 15
    assert server_cpu_threads("auto", 1, {}) == 1  # never zero
    assert server_cpu_threads("auto", 8, {"OMP_NUM_THREADS": "4"}) is None  # the user's
    assert server_cpu_threads("3", 8, {"OMP_NUM_THREADS": "4"}) == 3  # a number wins
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a number"):
            server_cpu_threads(bad, 8, {})
