"""The CUDA fast path end to end: the Triton backend with CUDA graphs against the torch
reference backend (the oracle), on whole models.

- logits of a prompt and of paged decode steps within the bf16 tolerance;
- greedy tokens: over 1,024 teacher-forced decode positions (both runners fed the same
  tokens, so one early flip cannot cascade) the argmax agrees at >= 99% of positions;
- CUDA-graph replay (padded buckets, several table widths) == eager Triton decode;
- batched == solo through graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")

BF16_TOL = 5e-2  # max |Δlogit| relative to the logits' scale, as the fidelity tests state


@pytest.fixture(scope="module", params=["demo", "random:100m"])
def loaded(request: pytest.FixtureRequest, demo_dir: Path) -> LoadedModel:
    spec = str(demo_dir) if request.param == "demo" else request.param
    return load_model(spec, torch.device("cuda"), torch.bfloat16)


def runner(loaded: LoadedModel, backend: str, graphs: bool) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=1024, backend=backend, cuda_graphs=graphs)


def decode_trace(
    r: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None, steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill, then `steps` batched decode steps; feeds `forced` tokens if given (teacher
    forcing), else the runner's own greedy tokens. Returns tokens and per-step logits."""
    pool = BlockPool(r.num_blocks)
    tables = [BlockTable(r.block_size) for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits = []
    for i, (p, t) in enumerate(zip(prompts, tables)):
        t.ensure(pool, len(p))
        out = r.step([SeqInput(p, 0, t.blocks)], return_logits=True)
        tokens[i].append(out.sampled[0])
    for k in range(steps):
        seqs = []
        for i, (p, t) in enumerate(zip(prompts, tables)):
            n = len(p) + k
            t.ensure(pool, n + 1)
            feed = forced[i][k] if forced else tokens[i][k]
            seqs.append(SeqInput([feed], n, t.blocks, seq_id=i + 1, table_epoch=t.epoch))
        out = r.step(seqs, return_logits=True)
        assert out.logits is not None
        logits.append(out.logits.clone())
        for i, tok in enumerate(out.sampled):
            tokens[i].append(tok)
    return tokens, logits


def test_triton_graphs_match_the_torch_reference(loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 5, 300, 33)]
    steps = 256  # x 4 sequences = 1,024 decode positions
    ref = runner(loaded, "torch", graphs=False)
    ref_tokens, ref_logits = decode_trace(ref, prompts, None, steps)
    del ref
    fast = runner(loaded, "triton", graphs=True)
    assert fast.graphs is not None
    fast_tokens, fast_logits = decode_trace(fast, prompts, ref_tokens, steps)
    worst = max(
        float((a - b).abs().max() / a.abs().max()) for a, b in zip(ref_logits, fast_logits)
    )
    assert worst < BF16_TOL, worst
    agree = sum(
        int(a == b)
        for ra, fa in zip(ref_tokens, fast_tokens)
        for a, b in zip(ra[1:], fa[1:])  # position k+1: argmax after the same k tokens
    )
    total = sum(len(t) - 1 for t in ref_tokens)
    print(f"\n{loaded.name}: max rel |Δlogit| {worst:.2e}, greedy agreement {agree}/{total}")
    assert agree >= 0.99 * total


def test_graph_replay_equals_eager_triton_and_batched_equals_solo(loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    # 5 sequences: bucket 8 (3 padding rows); one context crosses the 64-block width bucket
    lens = (20, 1100, 7, 64, 300)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    eager = runner(loaded, "triton", graphs=False)
    e_tokens, e_logits = decode_trace(eager, prompts, None, 12)
    del eager
    graphed = runner(loaded, "triton", graphs=True)
    g_tokens, g_logits = decode_trace(graphed, prompts, e_tokens, 12)
    assert graphed.graphs is not None and graphed.graphs.captures >= 1
    for a, b in zip(e_logits, g_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * float(a.abs().max()))
    solo = [decode_trace(graphed, [p], [t], 12)[1] for p, t in zip(prompts, e_tokens)]
    for i, per_seq in enumerate(solo):
        for k, row in enumerate(per_seq):
            scale = float(row.abs().max())
            torch.testing.assert_close(g_logits[k][i], row[0], rtol=0, atol=1e-2 * scale)
