"""On the GPU: after the eager warm-up, serving-like eager steps (tests/unit/
test_triton_variants.py's) make Triton compile nothing: Triton's jit cache hook, called for
each kernel variant a process has not built yet, stays silent while they run. No CUDA graphs
here (they would compile variants of their own): the warm-up alone must cover eager steps.
The CPU test checks the same with the launches recorded; this one with Triton's own cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds4pool.model.runner import ModelRunner

pytestmark = pytest.mark.cuda
triton = pytest.importorskip("triton")

from tests.unit import test_triton_variants as variants  # noqa: E402


@pytest.mark.parametrize(
    "kind", ["triton", "triton-split", "triton-small", "triton-mla", "triton-moe"]
)
def test_serving_steps_compile_nothing_after_the_warm_up(kind: str) -> None:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        pytest.skip("this triton has no jit cache hook")
    loaded = variants.loaded_model(kind, torch.device("cuda"))
    r = ModelRunner(
        loaded,
        num_blocks=variants.NUM_BLOCKS,
        block_size=variants.BS,
        backend=kind if kind in ("triton-split", "triton-small") else "triton",
        cuda_graphs="eager",  # every step eager: the warm-up alone must cover them
        max_decode_batch=variants.MAX_ROWS,
    )
    report = r.warm_up_eager(variants.MAX_CHUNK, 600)
    assert report.left == 0
    compiled: list[str] = []

    def hook(*args: Any, **kw: Any) -> bool:
        compiled.append(str(kw.get("repr", kw.get("key", args))))
        return False  # compile as usual

    old, runtime.jit_cache_hook = runtime.jit_cache_hook, hook
    try:
        for label, seqs in variants.serving_steps(seed=1, max_len=r.max_model_len):
            before = len(compiled)
            r.step(seqs)
            if len(compiled) > before:
                compiled.append(f"  ^ in {label}")  # which step needed them
    finally:
        runtime.jit_cache_hook = old
    assert compiled == [], "\n".join(compiled)
