"""A mixed step of several prompt chunks through the graph path (MixedBatch of up to K
chunks, the forward a captured graph would replay) gives the eager step's logits.

No GPU here, so no capture: the runner's graph path is the production code up to the replay,
and the replay runs `StepGraphs._forward_mixed` eagerly over the same persistent buffers (what
the graph was captured from). The model's Triton kernels (fused ops, prologue, paged
attention) run under Triton's interpreter in a child process (tests/interpreter.py), the
same kernels on both sides; a tiny Llama in float32. tests/gpu/test_fast_path_cuda.py checks
the captured graphs on the device.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

# name: (backend, K, steps); a step is (decode rows' contexts, [(chunk tokens, cached)])
STEPS = [
    ([30, 70], [(9, 0), (40, 12)]),  # two chunks between two decode rows
    ([31, 71], [(50, 9)]),  # one chunk in a graph of up to K
    ([32, 72], [(20, 52), (33, 0), (17, 100)]),  # three
    ([], [(60, 70), (5, 40)]),  # no decode row
]
CASES: dict[str, tuple[str, int]] = {
    "triton_k3": ("triton", 3),
    "triton_split_k4": ("triton-split", 4),
    "triton_small_k3": ("triton-small", 3),  # decode rows on 16-row tiles of the prefill kernel
}


def _runner(kind: str, k: int, graphs: bool) -> Any:
    import torch

    from ds4pool.model.attention_triton import TritonPagedAttention
    from ds4pool.model.cuda_graphs import StepGraphs, default_buckets
    from ds4pool.model.kernels import triton_attention as ta
    from ds4pool.model.mixed_batch import MixedBatch
    from ds4pool.model.runner import ModelRunner
    from tests.hf_models import tiny_loaded

    loaded = tiny_loaded(vocab=61, seed=5)
    attention = TritonPagedAttention(
        split_decode_rows=kind == "triton-split",
        num_sms=4,
        prefill_launch=ta.DEFAULT_PREFILL,
        small_m=16 if kind == "triton-small" else 0,
    )
    r = ModelRunner(
        loaded, num_blocks=96, block_size=16, cuda_graphs=False, max_decode_batch=8,
        kv_head_major=False, attention=attention,
    )  # fmt: skip
    if not graphs:
        return r
    cfg = loaded.config
    r.mixed = MixedBatch(
        r.layout, 8, 128, r.max_blocks_per_seq, r.device, torch.int32, None, max_chunks=k
    )

    def partitions(chunk: int, width_tokens: int) -> int:
        return attention.graph_prefill_partitions(
            chunk, cfg.num_heads, cfg.num_kv_heads, width_tokens
        )

    g = StepGraphs(
        r.model, r.kv_caches, r.batch, default_buckets(8), cfg.vocab_size, loaded.dtype,
        r.mixed, partitions, "lazy",
    )  # fmt: skip

    def replay_mixed(shape: Any, max_context: int) -> Any:  # the forward a graph replays
        g._forward_mixed(shape, g.mixed_key(shape, max_context).width)
        return g._logits[: shape.bucket + k]

    g.replay_mixed = replay_mixed  # type: ignore[method-assign]
    r.graphs = g
    return r


def _trace(r: Any) -> list[Any]:
    """STEPS, each sequence on its own blocks (rows 0-1 the same sequences every step), the
    first chunk sampled or not by turns; the logits of each step."""
    from ds4pool.model.runner import SeqInput

    out = []
    for n, (decodes, chunks) in enumerate(STEPS):
        seqs = [
            SeqInput([3 + i], c - 1, list(range(8 * i, 8 * i + 8)), seq_id=i + 1)
            for i, c in enumerate(decodes)
        ]
        for j, (q, cached) in enumerate(chunks):
            blocks = list(range(32 + 16 * j, 48 + 16 * j))
            ids = [(7 * n + 3 * j + t) % 61 for t in range(q)]
            seqs.insert(1, SeqInput(ids, cached, blocks, sample=(n + j) % 2 == 0))
        res = r.step(seqs, return_logits=True)
        out.append(res.logits.clone())
    return out


def _run_case(name: str) -> dict[str, Any]:
    import torch

    kind, k = CASES[name]
    eager, graphed = _runner(kind, k, False), _runner(kind, k, True)
    assert graphed.mixed is not None
    want, got = _trace(eager), _trace(graphed)
    graph_path = all(
        not graphed.launches_eagerly(_step_inputs(decodes, chunks)) for decodes, chunks in STEPS
    )
    rel = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, got))
    shapes = [tuple(a.shape) for a in want] == [tuple(b.shape) for b in got]
    return {"name": name, "rel": rel, "shapes": shapes, "graph_path": graph_path,
            "finite": all(bool(torch.isfinite(b).all()) for b in got)}  # fmt: skip


def _step_inputs(decodes: list[int], chunks: list[tuple[int, int]]) -> list[Any]:
    from ds4pool.model.runner import SeqInput

    seqs = [SeqInput([1], c - 1, [0] * 8) for c in decodes]
    return seqs + [SeqInput([2] * q, c, [0] * 16) for q, c in chunks]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=400)


@pytest.mark.parametrize("name", list(CASES))
def test_several_chunks_through_the_graph_path_equal_eager(
    results: dict[str, dict], name: str
) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["graph_path"], "a step of <= K chunks took the eager path"
    assert r["shapes"] and r["finite"], r
    assert r["rel"] < 1e-4, r


if __name__ == "__main__":
    print_cases(CASES, _run_case)
