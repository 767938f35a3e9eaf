"""The start-up eager warm-up (ModelRunner.warm_up_eager) touches no session's KV: every row
of its steps reads and writes the layout's scratch block only, so it may run after sessions'
blocks hold KV and steps after it compute the same tokens."""

from __future__ import annotations

import logging

import pytest
import torch

from ds4pool.model.runner import SeqInput
from ds4pool.model.warm_up import eager_shapes
from tests.hf_models import tiny_runner


def test_the_warm_up_writes_only_the_scratch_block_and_changes_no_result() -> None:
    r = tiny_runner(vocab=97, seed=3, block_size=16)
    prompt = SeqInput([5, 9, 13, 2, 40, 41, 7, 3, 88, 60, 1, 4, 6, 8, 10, 12, 14], 0, [0, 1])
    first = r.step([prompt]).sampled
    before = [c.clone() for c in r.kv_caches]
    report = r.warm_up_eager(max_chunk=64, max_seconds=600)
    shapes = eager_shapes(r.max_model_len, 64, r.batch.max_rows)
    assert report.steps == len(shapes) > 20 and report.left == 0
    scratch = r.layout.num_blocks
    for old, new in zip(before, r.kv_caches):
        # [2, N + 1, bs, H, D] (token-major) or [2, N + 1, H, bs, D]: blocks on dim 1
        assert torch.equal(old[:, :scratch], new[:, :scratch]), "a session block changed"
        assert not torch.equal(old[:, scratch], new[:, scratch]), "the warm-up wrote nothing"
    # the session goes on as if no warm-up had run
    nxt = SeqInput([first[0]], 17, [0, 1, 2])
    assert r.step([nxt]).sampled[0] is not None
    again = tiny_runner(vocab=97, seed=3, block_size=16)
    assert again.step([prompt]).sampled == first
    assert again.step([nxt]).sampled == r.step([nxt]).sampled


def test_the_time_bound_leaves_the_rest_out() -> None:
    r = tiny_runner(vocab=97, seed=3, block_size=16)
    report = r.warm_up_eager(max_chunk=64, max_seconds=0.0)
    total = len(eager_shapes(r.max_model_len, 64, r.batch.max_rows))
    assert report.steps <= 1 and report.steps + report.left == total  # the log says how many


def test_a_failing_step_ends_the_warm_up_with_a_warning_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = tiny_runner(vocab=97, seed=3, block_size=16)
    launch, calls = r.launch, []

    def failing(*args: object, **kw: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (as a long context's scores)")
        return launch(*args, **kw)  # type: ignore[arg-type]

    r.launch = failing  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="ds4pool.model.runner"):
        report = r.warm_up_eager(max_chunk=64, max_seconds=600)
    assert report.steps == 2 and report.left == len(eager_shapes(256, 64, r.batch.max_rows)) - 2
    assert "eager warm-up stopped at WarmShape" in caplog.text and "out of memory" in caplog.text
    r.launch = launch  # type: ignore[method-assign]
    assert r.step([SeqInput([5, 9, 13], 0, [0])]).sampled[0] is not None  # serving goes on


def test_contexts_stop_at_what_the_pool_holds() -> None:
    """No warm-up step at a context the KV pool could never hold for a request."""
    r = tiny_runner(vocab=97, seed=3, block_size=16)  # 128 blocks of 16: 2,048 tokens
    r.max_model_len = 100_000  # as a long-context model's
    shapes = []
    real = r.launch

    def record(seqs: list[SeqInput], *a: object, **kw: object) -> object:
        shapes.append(max(s.context_len for s in seqs))
        return real(seqs, *a, **kw)  # type: ignore[arg-type]

    r.launch = record  # type: ignore[method-assign]
    r.warm_up_eager(max_chunk=64, max_seconds=600)
    assert max(shapes) == 128 * 16
