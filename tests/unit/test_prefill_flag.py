"""`--max-prefill-tokens` / DS4POOL_MAX_PREFILL_TOKENS (and the work cap and CUDA-graph flags
next to them) as `ds4pool serve` reads them."""

from __future__ import annotations

import argparse

import pytest
import torch

from ds4pool.engine import EngineConfig, prefill_burst, prefill_tokens
from ds4pool.errors import Ds4poolError
from ds4pool.model.device import select_blas
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


def test_work_cap_and_graph_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("MAX_PREFILL_COST", "PREFILL_COST_SCALE", "CUDA_GRAPHS", "NO_CUDA_GRAPHS")
    for name in (*names, "NO_EAGER_WARM_UP", "GRAPH_CHUNKS"):
        monkeypatch.delenv(f"DS4POOL_{name}", raising=False)
    unset = serve_config([]).engine
    assert unset.max_prefill_cost is None and unset.prefill_cost_scale is None
    assert unset.cuda_graphs == "ahead" and unset.eager_warm_up
    assert not serve_config(["--no-eager-warm-up"]).engine.eager_warm_up
    assert unset.graph_chunks == 1
    assert serve_config(["--graph-chunks", "8"]).engine.graph_chunks == 8
    with pytest.raises(Ds4poolError, match="graph_chunks"):
        serve_config(["--graph-chunks", "0"])
    cfg = serve_config(["--max-prefill-cost", "0", "--prefill-cost-scale", "2048"]).engine
    assert (cfg.max_prefill_cost, cfg.prefill_cost_scale) == (0, 2048)
    assert serve_config(["--cuda-graphs", "lazy"]).engine.cuda_graphs == "lazy"
    assert serve_config(["--no-cuda-graphs"]).engine.cuda_graphs == "eager"
    monkeypatch.setenv("DS4POOL_CUDA_GRAPHS", "eager")
    assert serve_config([]).engine.cuda_graphs == "eager"
    with pytest.raises(Ds4poolError, match="max_prefill_cost"):
        serve_config(["--max-prefill-cost", "-3"])


def test_prefill_decode_ratio_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS4POOL_PREFILL_DECODE_RATIO", raising=False)
    assert serve_config([]).engine.prefill_decode_ratio is None  # by device
    assert serve_config(["--prefill-decode-ratio", "0"]).engine.prefill_decode_ratio == 0
    monkeypatch.setenv("DS4POOL_PREFILL_DECODE_RATIO", "1.25")
    assert serve_config([]).engine.prefill_decode_ratio == 1.25
    assert serve_config(["--prefill-decode-ratio", "2"]).engine.prefill_decode_ratio == 2
    with pytest.raises(Ds4poolError, match="prefill_decode_ratio must be >= 0"):
        serve_config(["--prefill-decode-ratio", "-1"])


def test_itl_budget_factor_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS4POOL_ITL_BUDGET_FACTOR", raising=False)
    assert serve_config([]).engine.itl_budget_factor is None  # by device
    assert serve_config(["--itl-budget-factor", "0"]).engine.itl_budget_factor == 0
    monkeypatch.setenv("DS4POOL_ITL_BUDGET_FACTOR", "3")
    assert serve_config([]).engine.itl_budget_factor == 3
    assert serve_config(["--itl-budget-factor", "2.5"]).engine.itl_budget_factor == 2.5
    with pytest.raises(Ds4poolError, match=r"itl_budget_factor must be 0 \(off\) or > 1"):
        serve_config(["--itl-budget-factor", "0.5"])


def test_prefill_burst_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS4POOL_PREFILL_BURST", raising=False)
    unset = serve_config([]).engine
    assert unset.prefill_burst is None  # by device
    assert prefill_burst(unset, torch.device("cpu")) == 1
    assert prefill_burst(unset, torch.device("cuda")) == 8
    monkeypatch.setenv("DS4POOL_PREFILL_BURST", "3")
    assert serve_config([]).engine.prefill_burst == 3
    cfg = serve_config(["--prefill-burst", "4"]).engine
    assert prefill_burst(cfg, torch.device("cuda")) == 4
    with pytest.raises(Ds4poolError, match=r"prefill_burst must be >= 1 \(1: off\)"):
        serve_config(["--prefill-burst", "0"])


@pytest.mark.timeout(120)  # broken, the server would start and serve
def test_blas_flag_and_its_refusal_off_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, demo_dir
) -> None:
    from ds4pool.cli import main

    assert serve_config([]).engine.blas == "auto"
    select_blas("auto", torch.device("cpu"))  # auto is cuBLASLt on CUDA only: no error on CPU
    assert serve_config(["--blas", "cublaslt"]).engine.blas == "cublaslt"
    monkeypatch.setenv("DS4POOL_BLAS", "cublas")
    assert serve_config([]).engine.blas == "cublas"
    with pytest.raises(ValueError, match="blas must be one of"):
        EngineConfig(blas="mkl")
    if torch.cuda.is_available():
        return
    # a CPU server asked for a CUDA library says so in one line, exit status 1
    monkeypatch.setenv("DS4POOL_CACHE", str(demo_dir.parent))
    args = ["serve", "--model", str(demo_dir), "--kv-device-gb", "0.02", "--port", "0"]
    assert main([*args, "--device", "cpu", "--blas", "cublaslt"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ds4pool: error:") and "needs a CUDA device" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(120)  # broken, the server would start and serve
def test_a_triton_backend_off_cuda_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, demo_dir
) -> None:
    """`--attention-backend triton*` where there is no CUDA device: one line, exit 1."""
    from ds4pool.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setenv("DS4POOL_CACHE", str(demo_dir.parent))
    args = ["serve", "--model", str(demo_dir), "--kv-device-gb", "0.02", "--port", "0"]
    for backend in ("triton", "triton-split", "triton-small"):
        assert main([*args, "--attention-backend", backend]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ds4pool: error:") and f"the {backend} attention" in err, err
        assert len(err.strip().splitlines()) == 1, err
