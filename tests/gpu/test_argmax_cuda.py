"""Greedy decoding's argmax kernel (model/kernels/triton_argmax.py) on the GPU: torch.argmax's
ids on vocabularies of real size (ties, NaN, -inf rows), eagerly and in CUDA-graph replays,
and the sampler taking it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("vocab", [128256, 151936, 8192, 1000])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_kernel_gives_torch_argmax(vocab: int, rows: int) -> None:
    from ds4pool.model.kernels.triton_argmax import ArgmaxWorkspace, argmax_rows

    gen = torch.Generator(device=CUDA).manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, device=CUDA, generator=gen).to(torch.bfloat16).float()
    x[0, [vocab - 1, vocab // 2]] = 1e4  # ties across chunks: the first wins
    if rows > 1:
        x[1] = float("-inf")
        x[-1, [3, vocab - 2]] = float("nan")
    ws = ArgmaxWorkspace(CUDA)
    assert argmax_rows(x, ws).tolist() == x.argmax(dim=-1).tolist()
    out = torch.empty(rows, dtype=torch.int64, device=CUDA)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(argmax_rows(x, ws))
    for _ in range(2):
        x[0, 5] = float(x[0].max()) + 1  # a new maximum between replays
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == x.argmax(dim=-1).tolist()
    assert int(ws.counters.abs().sum()) == 0


def test_the_sampler_takes_it_for_greedy_rows() -> None:
    from ds4pool.model.sampler import Sampler, SamplingParams

    sampler = Sampler(CUDA)
    logits = torch.randn(3, 50000, device=CUDA)
    params = [SamplingParams(temperature=0.0)] * 3
    got = sampler.sample(logits, params, [0, 0, 0], [[], [], []])
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert sampler._argmax_ws is not None
