"""The Triton grouped-GEMM kernel of the MoE layers under Triton's CPU interpreter, against the
per-expert reference loop in float64.

TRITON_INTERPRET=1 must be set before the kernel is decorated, so the cases run in one child
interpreter (this file run as a script) that prints one JSON line each; the parent asserts per
case. Skipped where triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interpreter import interpreter_results, print_cases

# name → (tokens, experts, top-k, hidden, expert width, dtype): widths that are not
# multiples of the 64-wide tiles, experts nobody chose, tiles that end mid-expert
CASES: dict[str, tuple[int, int, int, int, int, str]] = {
    "decode_one_token": (1, 8, 2, 48, 40, "float32"),
    "ragged_groups": (37, 8, 3, 80, 72, "float32"),
    "many_experts_few_tokens": (5, 64, 4, 64, 32, "float32"),
    "tall_tiles": (140, 4, 2, 32, 96, "float32"),  # ~70 rows per expert: 64-row tiles
    "fp16": (20, 16, 4, 64, 32, "float16"),
}


def _run_case(name: str) -> dict:
    import torch

    from ds4pool.model.experts import grouped_experts, looped_experts
    from ds4pool.model.kernels.triton_moe import tile_table
    from ds4pool.model.routers import route_softmax_topk

    tokens, e, k, h, i, dtype = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    down = torch.randn(e, h, i, generator=gen) * i**-0.5
    x = torch.randn(tokens, h, generator=gen)
    weights, ids = route_softmax_topk(torch.randn(tokens, e, generator=gen), k, True)
    truth = looped_experts(x.double(), weights, ids, gate_up.double(), down.double())
    dt = getattr(torch, dtype)
    got = grouped_experts(
        x.to(dt), weights, ids, gate_up.to(dt), down.to(dt), gemm="triton"
    ).double()
    counts = torch.bincount(ids.flatten(), minlength=e).int()
    expert, first, _ = tile_table(counts, 64, 16)
    tiles = [(int(a), int(b)) for a, b in zip(expert, first) if a >= 0]
    want_tiles = [
        (ex, start + j)
        for ex, (start, n) in enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist()))
        for j in range(0, n, 16)
    ]
    return {
        "name": name,
        "rel": float((got - truth).abs().max() / truth.abs().max()),
        "tolerance": 1e-5 if dtype == "float32" else 3e-3,
        "tiles_ok": tiles == want_tiles,
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_grouped_gemm_matches_the_reference(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["tiles_ok"], "a tile straddles two experts, or an expert's rows are not covered"
    assert r["rel"] < r["tolerance"], r


if __name__ == "__main__":
    print_cases(CASES, _run_case)
