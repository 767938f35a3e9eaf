"""`--max-prefill-tokens` / DS4POOL_MAX_PREFILL_TOKENS as `ds4pool serve` reads them."""

from __future__ import annotations

import argparse

import pytest
import torch

from ds4pool.engine import EngineConfig, prefill_tokens
from ds4pool.errors import Ds4poolError
from ds4pool.serve import add_engine_flags, add_server_flags, build_config


def serve_config(argv: list[str]):  # noqa: ANN201 - ServerConfig
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    add_server_flags(p)
    return build_config(p.parse_args(argv))


def test_flag_env_and_device_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS4POOL_MAX_PREFILL_TOKENS", raising=False)
    unset = serve_config([]).engine
    assert unset.max_prefill_tokens is None  # the engine picks by device
    assert prefill_tokens(unset, torch.device("cpu")) == 64
    assert prefill_tokens(unset, torch.device("cuda")) == 512
    monkeypatch.setenv("DS4POOL_MAX_PREFILL_TOKENS", "96")
    assert serve_config([]).engine.max_prefill_tokens == 96
    cfg = serve_config(["--max-prefill-tokens", "200"]).engine  # the flag beats the env
    assert prefill_tokens(cfg, torch.device("cpu")) == 200


def test_zero_is_a_clear_error() -> None:
    with pytest.raises(Ds4poolError, match="max_prefill_tokens must be >= 1"):
        serve_config(["--max-prefill-tokens", "0"])
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=-5)
