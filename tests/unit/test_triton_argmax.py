"""Greedy decoding's argmax kernel (model/kernels/triton_argmax.py) under Triton's CPU
interpreter: torch.argmax's ids on rows a sampler meets (random, ties across and within
chunks, NaN, +inf, all -inf, a last chunk that is mostly padding), the counters left zero.

The cases run in one child interpreter (this file as a script), one JSON line each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

CASES = ["random", "ties", "nan", "inf", "all_neg_inf", "ragged_last_chunk", "bf16"]


def run_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.kernels.triton_argmax import ArgmaxWorkspace, argmax_rows

    g = torch.Generator().manual_seed(len(name))
    rows, n, block = 5, 1000, 128  # 8 chunks a row, the last of 104 logits
    x = torch.randn(rows, n, generator=g)
    if name == "ties":  # the maximum in two chunks and twice in one: the first index wins
        x[0, [700, 130, 140]] = 9.0
        x[1, :] = 1.0
        x[2, [5, 6]] = 7.0
    elif name == "nan":  # NaN is larger than everything, even +inf: its first index
        x[0, [900, 300]] = float("nan")
        x[1, 10] = float("inf")
        x[1, 999] = float("nan")
    elif name == "inf":
        x[0, [50, 600]] = float("inf")
        x[1, :] = float("-inf")
        x[1, 333] = -1e30
    elif name == "all_neg_inf":
        x[:] = float("-inf")
    elif name == "ragged_last_chunk":
        n = 2 * block + 1
        x = torch.randn(rows, n, generator=g)
        x[3, -1] = 50.0
    elif name == "bf16":
        x = x.to(torch.bfloat16)
        x[4, [17, 18]] = 30.0
    ws = ArgmaxWorkspace(torch.device("cpu"), 16)
    got = argmax_rows(x, ws, block)
    strided = torch.cat([x, x], dim=1)[:, :n]  # rows with a stride wider than V
    return {
        "name": name,
        "got": got.tolist(),
        "want": x.argmax(dim=-1).tolist(),
        "strided": argmax_rows(strided, ws, block).tolist(),
        "dtype": str(got.dtype),
        "counters_zero": int(ws.counters.abs().sum()) == 0,
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return interpreter_results(__file__, timeout=300)


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_gives_torch_argmax(results: dict[str, dict[str, Any]], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["got"] == r["want"] == r["strided"], r
    assert r["dtype"] == "torch.int64" and r["counters_zero"], r


if __name__ == "__main__":
    print_cases(CASES, run_case)
