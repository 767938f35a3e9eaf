"""`ds4pool serve --tool-parser / --reasoning-parser` and their DS4POOL_* variables."""

from __future__ import annotations

import argparse

import pytest

from ds4pool.errors import Ds4poolError
from ds4pool.serve import add_engine_flags, add_server_flags, build_config


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    add_server_flags(p)
    return p.parse_args(argv)


def test_defaults_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = build_config(parse())
    assert (cfg.output.tool_parser, cfg.output.reasoning_parser) == ("auto", "auto")
    cfg = build_config(parse("--tool-parser", "mistral", "--reasoning-parser", "none"))
    assert (cfg.output.tool_parser, cfg.output.reasoning_parser) == ("mistral", "none")
    monkeypatch.setenv("DS4POOL_TOOL_PARSER", "deepseek_v3")
    monkeypatch.setenv("DS4POOL_REASONING_PARSER", "think")
    cfg = build_config(parse())
    assert (cfg.output.tool_parser, cfg.output.reasoning_parser) == ("deepseek_v3", "think")


def test_bad_values_fail_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse("--tool-parser", "xml")
    monkeypatch.setenv("DS4POOL_TOOL_PARSER", "xml")  # argparse does not check env defaults
    with pytest.raises(Ds4poolError, match="tool_parser 'xml' is not one of auto, hermes"):
        build_config(parse())
