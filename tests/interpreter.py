"""Run a test module's cases under Triton's interpreter (TRITON_INTERPRET=1) in a child
process: the variable must be set before triton is imported, and the parent has imported it.
The module, run as a script, prints one JSON object per case, each with a "name"."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interpreter_works() -> bool:
    """triton < 3.9's interpreter fails on numpy >= 2.4 (int() of a 1-d array)."""
    from importlib.metadata import version

    import numpy

    def major_minor(v: str) -> tuple[int, int]:
        return tuple(int(x) for x in v.split(".")[:2])  # type: ignore[return-value]

    return major_minor(version("triton")) >= (3, 9) or major_minor(numpy.__version__) < (2, 4)


def interpreter_results(script: str, timeout: float) -> dict[str, dict[str, Any]]:
    """{case name: its JSON record}, from running `script` with the interpreter on."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not interpreter_works():
        pytest.skip("triton < 3.9's interpreter fails on numpy >= 2.4 (int() of a 1-d array)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return {r["name"]: r for r in lines}


def print_cases(cases: Iterable[str], run_case: Callable[[str], dict[str, Any]]) -> None:
    """The child's side: one JSON record per case on stdout; a case that raises is reported
    with its traceback and the others still run."""
    import traceback

    import torch

    torch.set_num_threads(1)
    for name in cases:
        try:
            print(json.dumps(run_case(name)), flush=True)
        except Exception:  # report the case, keep checking the others
            print(json.dumps({"name": name, "error": traceback.format_exc()}), flush=True)
