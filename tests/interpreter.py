"""Run a test module's cases under Triton's interpreter (TRITON_INTERPRET=1) in a child
process: the variable must be set before triton is imported, and the parent has imported it.
The module, run as a script, prints one JSON object per case, each with a "name"."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
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


AHEAD_TIMEOUT_S = 600.0  # a child run ahead: the longest of the modules' own limits


def _start_child(script: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, script], env=env, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _finish_child(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run_child(script: str, timeout: float) -> subprocess.CompletedProcess:
    return _finish_child(_start_child(script), timeout)


class AheadRuns:
    """The selected modules' interpreter children, run one after another on a background
    thread from the end of collection (conftest.py), so that on a 2-core machine they take
    the core the rest of the suite leaves idle instead of ~2 minutes of the suite's wall
    time; the module's fixture then waits for its own child's result."""

    def __init__(self, scripts: list[str]) -> None:
        self._done: dict[str, threading.Event] = {s: threading.Event() for s in scripts}
        self._results: dict[str, subprocess.CompletedProcess | BaseException] = {}
        self._live: subprocess.Popen | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run_all, name="interpreter-ahead", daemon=True)
        self._thread.start()

    def _run_all(self) -> None:
        for script, done in self._done.items():
            try:
                if self._stopped:
                    raise RuntimeError("the test session ended first")
                self._live = _start_child(script)
                self._results[script] = _finish_child(self._live, AHEAD_TIMEOUT_S)
            except BaseException as exc:  # a timeout: the fixture reports it
                self._results[script] = exc
            done.set()

    def stop(self) -> None:
        """At the session's end (also an interrupted one): no child outlives pytest."""
        self._stopped = True
        if self._live is not None and self._live.poll() is None:
            self._live.kill()

    def result(self, script: str) -> subprocess.CompletedProcess | None:
        """The child's result (waiting for it), or None if this script was not run ahead."""
        done = self._done.get(script)
        if done is None:
            return None
        done.wait()
        got = self._results[script]
        if isinstance(got, BaseException):
            raise got
        return got


AHEAD: list[AheadRuns] = []  # set once by conftest.py's pytest_collection_finish


def start_ahead(scripts: list[str]) -> None:
    if scripts and importlib.util.find_spec("triton") is not None and interpreter_works():
        AHEAD.append(AheadRuns(scripts))


def stop_ahead() -> None:
    for runs in AHEAD:
        runs.stop()


def interpreter_results(script: str, timeout: float) -> dict[str, dict[str, Any]]:
    """{case name: its JSON record}, from running `script` with the interpreter on (or from
    its run ahead, see AheadRuns)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not interpreter_works():
        pytest.skip("triton < 3.9's interpreter fails on numpy >= 2.4 (int() of a 1-d array)")
    ahead = AHEAD[0].result(str(Path(script).resolve())) if AHEAD else None
    proc = ahead if ahead is not None else _run_child(script, timeout)
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
