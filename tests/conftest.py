"""Shared fixtures: tiny models built locally (no downloads) and loaded the real way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Keep the suite predictable on 2-core CI machines.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


# The GPU image has torch but not the server stack: there `pytest -m cuda tests` collects
# only the files that hold CUDA tests (engine, kernels, fidelity, sampler), which need torch
# alone, and leaves out the suites that need a real server or the API's libraries. The
# stack counts as present only with the clients its suites use too: a GPU box that had
# litestar but not the anthropic SDK failed collection in 9 modules (session 21).
SERVER_STACK = all(map(_importable, ("uvicorn", "litestar", "openai", "anthropic", "jsonschema")))
collect_ignore = [] if SERVER_STACK else ["integration", "reliability"]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if SERVER_STACK or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.cuda" not in collection_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ds4pool.model.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected Triton-interpreter children in the background (tests/interpreter.py):
    they run one at a time beside the rest of the suite."""
    if session.config.option.collectonly:
        return
    from tests.interpreter import start_ahead

    scripts: list[str] = []
    seen: set[str] = set()
    for item in session.items:
        path = str(item.path.resolve())
        if path in seen or "cuda" in item.keywords:
            continue
        seen.add(path)
        if "interpreter_results(__file__" in item.path.read_text(encoding="utf-8"):
            scripts.append(path)
    start_ahead(scripts)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.interpreter import stop_ahead

    stop_ahead()
