"""The L2 prefetch beside a small decode step's attention (kernels/triton_prefetch.py,
TritonOps.prefetch_begin / _end): it changes no result, in eager steps and CUDA-graph
replays, its kernel never writes its sink, and the captured decode graph does run it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ds4pool.model.loader import load_model
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_fast_path_cuda import decode_trace

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")


def test_the_kernel_loads_without_writing() -> None:
    from ds4pool.model.kernels.triton_prefetch import prefetch_l2

    w = torch.randn(1000, 72, device=CUDA).to(torch.bfloat16)
    sink = torch.zeros(1024, dtype=torch.int32, device=CUDA)
    before = w.clone()
    prefetch_l2(w, sink)
    torch.cuda.synchronize()
    assert int(sink.abs().sum()) == 0 and torch.equal(w, before)


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_with_and_without_the_prefetch_is_the_same_bits(graphs: bool) -> None:
    loaded32 = load_model("random:100m", CUDA, torch.float32)
    loaded = dataclasses.replace(
        loaded32, model=copy.deepcopy(loaded32.model).to(torch.bfloat16), dtype=torch.bfloat16
    )
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (50, 17)]
    traces = {}
    for on in (True, False):
        r = ModelRunner(loaded, num_blocks=256, backend="triton", cuda_graphs=graphs)
        r.model.ops.prefetch = on
        for batch in (prompts[:1], prompts):  # 1 and 2 rows: both prefetch
            traces[on, len(batch)] = decode_trace(r, batch, None, 6)
        if on:
            assert r.model.ops._side, "a decode step started the side stream"
            sink = next(iter(r.model.ops._side.values()))[1]
            assert int(sink.abs().sum()) == 0
    for rows in (1, 2):
        (tok_on, logits_on), (tok_off, logits_off) = traces[True, rows], traces[False, rows]
        assert tok_on == tok_off
        assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))


def test_the_captured_decode_graph_runs_the_prefetch() -> None:
    """One prefetch a layer in every decode step (graph replays included), none in the
    prefill."""
    from torch.profiler import ProfilerActivity, profile

    loaded = load_model("random:100m", CUDA, torch.bfloat16)
    r = ModelRunner(loaded, num_blocks=64, backend="triton", cuda_graphs=True)
    decode_trace(r, [list(range(1, 33))], None, 4)  # warm-up and capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_trace(r, [list(range(1, 33))], None, 3)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("_prefetch_kernel" in n for n in names) == 3 * loaded.config.num_layers
