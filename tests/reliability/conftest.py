"""The reliability suite: every test here carries the `reliability` marker, runs a reduced
size by default and the full size with DS4POOL_RELIABILITY_FULL=1 (see helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.engine import fingerprint_for
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.tokenizer import Tokenizer
from tests.reliability.helpers import REPORTED, SIZE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if REPORTED:
        terminalreporter.section(f"reliability figures ({SIZE} size)")
        for line in REPORTED:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="session")
def fingerprint(loaded: LoadedModel) -> ModelFingerprint:
    return fingerprint_for(loaded)
