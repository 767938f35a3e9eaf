"""`--cpu-linear`: the CPU projections through oneDNN prepacked weights (model/cpu_linear.py),
the option's parsing and refusals, and the fallback to F.linear when the check at load fails."""

from __future__ import annotations

import argparse
import resource

import pytest
import torch
from torch import nn

from ds4pool.engine import EngineConfig
from ds4pool.errors import DeviceError
from ds4pool.model import cpu_linear
from ds4pool.model.config import ModelConfig
from ds4pool.model.cpu_linear import (
    EXACT_ROWS,
    ROW_BUCKETS,
    ROW_CAP,
    PackedLinear,
    pack_cpu_linears,
    row_bucket,
    select_cpu_linear,
)
from ds4pool.model.demo import init_random_
from ds4pool.model.loader import build_empty
from ds4pool.serve import add_engine_flags, add_server_flags, build_config
from tests.hf_models import tiny_hf_config

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    select_cpu_linear("auto", CPU, torch.float32) != "onednn", reason="no oneDNN linear here"
)


def tiny_model(arch: str = "llama", **extra: object) -> nn.Module:
    cfg = ModelConfig.from_hf({**tiny_hf_config(300, arch), **extra})
    model = build_empty(cfg, CPU, torch.float32)
    init_random_(model, seed=1)
    model.fuse_projections()
    return model


def engine_cfg(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    add_server_flags(p)
    return build_config(p.parse_args(argv)).engine


def test_flag_parses_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_cfg([]).cpu_linear == "auto"  # row buckets bound oneDNN's primitives
    assert engine_cfg(["--cpu-linear", "torch"]).cpu_linear == "torch"
    monkeypatch.setenv("DS4POOL_CPU_LINEAR", "onednn")
    assert engine_cfg([]).cpu_linear == "onednn"
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        EngineConfig(cpu_linear="mkl")
    with pytest.raises(DeviceError, match="unknown --cpu-linear"):
        select_cpu_linear("mkl", CPU, torch.float32)


def test_onednn_is_refused_off_cpu_and_off_float32_auto_falls_back() -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert select_cpu_linear("auto", cuda, torch.bfloat16) == "torch"
    with pytest.raises(DeviceError, match="needs the CPU device"):
        select_cpu_linear("onednn", cuda, torch.float32)
    assert select_cpu_linear("auto", CPU, torch.bfloat16) == "torch"
    with pytest.raises(DeviceError, match="float32 only"):
        select_cpu_linear("onednn", CPU, torch.bfloat16)
    assert select_cpu_linear("torch", CPU, torch.float32) == "torch"


@needs_onednn
def test_packing_keeps_outputs_weight_bytes_and_dense_readers() -> None:
    model = tiny_model("deepseek-v3")
    x = torch.randn(5, 64)
    attn = model.model.layers[0].self_attn
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    o_in = torch.randn(5, attn.o_proj.in_features)
    want = attn.o_proj(o_in)
    head_want = model.lm_head(x)
    assert pack_cpu_linears(model, "auto", CPU, torch.float32) == "onednn"
    assert isinstance(attn.o_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    # MLA reads kv_b_proj's weight densely (absorbed attention): it stays an nn.Linear
    assert type(attn.kv_b_proj) is nn.Linear
    attn.absorbed()
    got = attn.o_proj(o_in)
    assert (got - want).abs().max().item() < 1e-4
    assert (model.lm_head(x) - head_want).abs().max().item() < 1e-4
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == bytes_before


@needs_onednn
def test_a_tied_lm_head_stays_the_embedding() -> None:
    model = tiny_model(tie_word_embeddings=True)
    assert pack_cpu_linears(model, "onednn", CPU, torch.float32) == "onednn"
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)


def test_a_failing_check_at_load_falls_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mkldnn_linear_pointwise: not supported here")

    monkeypatch.setattr(PackedLinear, "forward", broken)
    model = tiny_model()
    assert pack_cpu_linears(model, "auto", CPU, torch.float32) == "torch"
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(DeviceError, match="oneDNN linear failed: mkldnn_linear_pointwise"):
        pack_cpu_linears(model, "onednn", CPU, torch.float32)

    def wrong(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], self.out_features)

    monkeypatch.setattr(PackedLinear, "forward", wrong)
    assert cpu_linear.onednn_usable(torch.float32) == "oneDNN linear does not match F.linear"
    assert pack_cpu_linears(model, "auto", CPU, torch.float32) == "torch"


@pytest.mark.timeout(120)
def test_cli_refuses_onednn_in_bfloat16_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, demo_dir
) -> None:
    from ds4pool.cli import main

    monkeypatch.setenv("DS4POOL_CACHE", str(demo_dir.parent))
    args = ["serve", "--model", str(demo_dir), "--kv-device-gb", "0.02", "--port", "0"]
    assert main([*args, "--device", "cpu", "--dtype", "bfloat16", "--cpu-linear", "onednn"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ds4pool: error:") and "float32 only" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_row_buckets_are_few_and_waste_at_most_a_quarter() -> None:
    assert len(ROW_BUCKETS) <= 28 and ROW_BUCKETS[-1] == ROW_CAP
    for m in range(1, ROW_CAP + 1):
        b = row_bucket(m)
        assert m <= b <= ROW_CAP and b in ROW_BUCKETS
        assert b == m if m <= EXACT_ROWS else (b - m) / m <= 0.25, (m, b)


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


@needs_onednn
def test_any_row_count_runs_on_the_buckets_with_solo_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every row count from 1 to 600 (past ROW_CAP: slabs) matches F.linear, gives each row
    the bits it has alone, and only ROW_BUCKETS row counts reach oneDNN."""
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(72, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 72, generator=gen))
    packed = PackedLinear(lin)
    x = torch.randn(600, 72, generator=gen)
    seen: set[int] = set()
    run = PackedLinear._run

    def recording(self: PackedLinear, rows: torch.Tensor) -> torch.Tensor:
        seen.add(rows.shape[0])
        return run(self, rows)

    monkeypatch.setattr(PackedLinear, "_run", recording)
    with torch.no_grad():
        solo = torch.cat([packed(x[i : i + 1]) for i in range(600)])
        want = lin(x)
        for m in [*range(1, 80), 97, 129, 255, 256, 257, 300, 511, 512, 513, 600]:
            got = packed(x[:m])
            assert got.shape == (m, 40)
            assert torch.equal(got, solo[:m]), f"M={m}: {(got - solo[:m]).abs().max()}"
        assert (solo - want).abs().max().item() < 1e-4
        assert packed(x[:6].reshape(2, 3, 72)).shape == (2, 3, 40)
        assert packed(x[:0]).shape == (0, 40)
    assert seen <= set(ROW_BUCKETS), sorted(seen - set(ROW_BUCKETS))


@needs_onednn
def test_rss_stays_bounded_over_every_row_count() -> None:
    """oneDNN caches ~0.57 MiB per distinct input shape: unbucketed, rows 1..600 on one weight
    grew the RSS by ~340 MiB; with the buckets at most len(ROW_BUCKETS) primitives."""
    lin = nn.Linear(88, 24)  # a shape no other test uses: its primitives are new here
    packed = PackedLinear(lin)
    x = torch.randn(600, 88)
    with torch.no_grad():
        packed(x[:1])
        before = rss_mib()
        for m in range(1, 601):
            packed(x[:m])
    grown = rss_mib() - before
    assert grown < 40, f"RSS grew {grown:.0f} MiB over row counts 1..600"
