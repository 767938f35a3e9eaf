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
# the engine and GPU tests and leaves out the suites that need a real server.
collect_ignore = (
    [] if all(map(_importable, ("uvicorn", "litestar"))) else ["integration", "reliability"]
)


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
