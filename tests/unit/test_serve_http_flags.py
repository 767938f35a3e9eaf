"""`ds4pool serve --http / --loop`: uvicorn's HTTP implementation and event loop."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from ds4pool.errors import Ds4poolError
from ds4pool.serve import add_server_flags, check_http_stack, http_stack


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_flags(p)
    return p.parse_args(argv)


def test_defaults_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse()
    assert (args.http, args.loop) == ("auto", "auto")
    args = parse("--http", "h11", "--loop", "asyncio")
    assert (args.http, args.loop) == ("h11", "asyncio")
    monkeypatch.setenv("DS4POOL_HTTP", "httptools")
    monkeypatch.setenv("DS4POOL_LOOP", "uvloop")
    assert (parse().http, parse().loop) == ("httptools", "uvloop")
    with pytest.raises(SystemExit):
        parse("--http", "h2")


def test_auto_names_what_uvicorn_will_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    assert http_stack("h11", "asyncio") == "h11 on asyncio"
    installed = {"httptools"}  # as where uvloop does not build
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name in installed else None
    )
    assert http_stack("auto", "auto") == "httptools on asyncio"
    installed.clear()
    assert http_stack("auto", "auto") == "h11 on asyncio"


def test_a_package_that_is_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    check_http_stack("auto", "auto")  # nothing to check
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    check_http_stack("h11", "asyncio")
    with pytest.raises(Ds4poolError, match="--loop uvloop: the uvloop package is not installed"):
        check_http_stack("h11", "uvloop")
    with pytest.raises(Ds4poolError, match="--http httptools: the httptools package"):
        check_http_stack("httptools", "asyncio")
