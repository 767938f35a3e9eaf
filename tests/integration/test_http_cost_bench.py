"""bench/http_cost.py end to end at a tiny size: fresh servers on both HTTP stacks, the event
loop's CPU per streamed chunk and per request measured and tabled."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import http_cost


def test_the_bench_measures_both_stacks(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DS4POOL_CACHE", str(demo_dir.parent))
    monkeypatch.setenv("DS4POOL_KV_DEVICE_GB", "0.02")
    argv = ["--model", str(demo_dir), "--streams", "3", "--gen", "6", "--requests", "3"]
    argv += ["--prompt-tokens", "300", "--passes", "1", "--rounds", "1"]
    argv += ["--variant", "h11/asyncio", "--variant", "httptools/uvloop"]
    assert http_cost.main(argv) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    rows = {r[1].strip(): r for r in rows if len(r) > 5 and r[1].strip() in http_cost.VARIANTS}
    assert set(rows) == {"h11/asyncio", "httptools/uvloop"}
    for cells in rows.values():  # µs per chunk and per request: measured, not zero
        assert float(cells[2].replace(",", "")) > 0 and float(cells[4].replace(",", "")) > 0
    assert rows["h11/asyncio"][3].strip() == "1.00x"
