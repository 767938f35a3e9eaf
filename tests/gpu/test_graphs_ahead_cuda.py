"""CUDA graphs captured at start-up: a 16k-token prompt prefilled next to decoders, in the
chunks the work cap picks, replays graphs captured ahead (no capture, no eager step while it
runs) and gives the eager path's logits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.sched.prefill_cost import DEFAULTS, PrefillCost
from ds4pool.sched.request import Request

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")

LONG = 16384


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cuda"), torch.float32)


def prefill_trace(r: ModelRunner, chunks: list[int], vocab: int) -> list[torch.Tensor]:
    """4 decoders (teacher-forced) next to a LONG-token prompt's chunks; logits per step."""
    gen = torch.Generator().manual_seed(11)
    pool = BlockPool(r.num_blocks)
    dec_lens = [30, 200, 700, 5]
    tables = [BlockTable(r.block_size) for _ in dec_lens]
    for n, t in zip(dec_lens, tables):
        t.ensure(pool, n + len(chunks) + 1)
        r.step([SeqInput(torch.randint(0, vocab, (n,), generator=gen).tolist(), 0, t.blocks)])
    long = torch.randint(0, vocab, (LONG,), generator=gen).tolist()
    lt = BlockTable(r.block_size)
    lt.ensure(pool, LONG)
    out, done = [], 0
    for k, c in enumerate(chunks):
        seqs = [
            SeqInput([7 + k % 50], n + k, t.blocks, seq_id=i + 1, table_epoch=t.epoch)
            for i, (n, t) in enumerate(zip(dec_lens, tables))
        ]
        last = done + c == LONG
        seqs.append(SeqInput(long[done : done + c], done, lt.blocks, sample=last, seq_id=99))
        res = r.step(seqs, return_logits=True)
        assert res.logits is not None
        out.append(res.logits.clone())
        done += c
    assert done == LONG
    return out


def test_a_16k_prefill_next_to_decoders_replays_graphs_captured_ahead(
    loaded: LoadedModel,
) -> None:
    vocab = loaded.config.vocab_size
    graphed = ModelRunner(loaded, num_blocks=2048, max_decode_batch=8, cuda_graphs="ahead")
    report = graphed.capture_graphs(600.0)
    g = graphed.graphs
    assert report is not None and g is not None
    assert report.pending == 0 and report.captured == len(g.plan()) == g.captures
    mib = report.graph_bytes / 2**20
    print(f"\ncaptured {report.captured} graphs in {report.seconds:.1f} s, {mib:.0f} MiB")
    scale, budget = DEFAULTS["cuda"]
    cost = PrefillCost(scale, budget, graphed.graph_chunk_sizes)
    chunks, start = [], 0
    while start < LONG:
        chunks.append(cost.chunk(start, min(512, LONG - start), budget, first=True))
        start += chunks[-1]
    assert chunks[0] == 512 and chunks[-2] == 128  # the work cap shrinks them as it goes
    got = prefill_trace(graphed, chunks, vocab)
    assert g.captures == report.captured, "a step captured a graph"
    assert g.eager_misses == 0, "a step ran eagerly for want of a graph"
    eager = ModelRunner(loaded, num_blocks=2048, max_decode_batch=8, cuda_graphs="eager")
    want = prefill_trace(eager, chunks, vocab)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-3 * float(a.abs().max()))


def test_the_engine_captures_at_start_up_and_not_while_serving(loaded: LoadedModel) -> None:
    e = Engine(EngineConfig(kv_device_gb=0.5, max_batch_size=8), loaded=loaded)
    steps: list[tuple[int, int]] = []
    e.scheduler.observer.step = lambda b, n, *_: steps.append((b, n))  # type: ignore[method-assign]
    try:
        report, g = e.graph_capture, e.runner.graphs
        assert report is not None and g is not None and report.pending == 0
        captures = g.captures
        rng = random.Random(4)
        vocab = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
        ids = lambda n: [rng.randrange(4, vocab) for _ in range(n)]  # noqa: E731
        decoders = [
            e.submit(
                Request(
                    session_id=f"d{i}", prompt_ids=ids(40 + 9 * i), max_tokens=400, ignore_eos=True
                )
            )
            for i in range(4)
        ]
        for d in decoders:
            d.get(timeout=120)  # all four decode
        _, _, final = e.submit(
            Request(session_id="long", prompt_ids=ids(LONG), max_tokens=4, ignore_eos=True)
        ).collect(timeout=600)
        assert final.error is None
        for d in decoders:
            assert d.collect(timeout=600)[2].error is None
        assert g.captures == captures and g.eager_misses == 0
        assert sum(1 for b, n in steps if b == 5 and n > 5) >= 50  # mixed steps
    finally:
        e.close()


def decode_trace(r: ModelRunner, vocab: int, forced: list[list[int]] | None) -> tuple:
    """3 prompts prefilled, then 12 batched decode steps (fed `forced` tokens if given)."""
    gen = torch.Generator().manual_seed(2)
    pool = BlockPool(r.num_blocks)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (20, 300, 7)]
    tables = [BlockTable(r.block_size) for _ in prompts]
    tokens: list[list[int]] = []
    for p, t in zip(prompts, tables):
        t.ensure(pool, len(p) + 13)
        tokens.append([r.step([SeqInput(p, 0, t.blocks)]).sampled[0]])
    logits = []
    for k in range(12):
        seqs = [
            SeqInput(
                [forced[i][k] if forced else tokens[i][k]],
                len(p) + k,
                t.blocks,
                seq_id=i + 1,
                table_epoch=t.epoch,
            )
            for i, (p, t) in enumerate(zip(prompts, tables))
        ]
        out = r.step(seqs, return_logits=True)
        assert out.logits is not None
        logits.append(out.logits.clone())
        for i, tok in enumerate(out.sampled):
            tokens[i].append(tok)
    return tokens, logits


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_decode_steps_replay_graphs_equal_to_eager(backend: str) -> None:
    """DeepSeek-V3's latent attention (the torch reference, the Triton kernel) decodes through
    CUDA graphs: bf16, the MoE layers on the grouped path."""
    loaded = load_model("random:deepseek-v3-tiny", torch.device("cuda"), torch.bfloat16)
    vocab = loaded.config.vocab_size
    eager = ModelRunner(
        loaded, num_blocks=256, max_decode_batch=8, backend=backend, cuda_graphs="eager"
    )
    assert eager.backend.name == f"{backend}-mla"
    e_tokens, e_logits = decode_trace(eager, vocab, None)
    del eager
    graphed = ModelRunner(
        loaded, num_blocks=256, max_decode_batch=8, backend=backend, cuda_graphs="ahead"
    )
    report = graphed.capture_graphs(300.0)
    assert graphed.graphs is not None and graphed.mixed is None  # decode graphs only
    assert report is not None and report.pending == 0 and report.captured >= 4
    _, g_logits = decode_trace(graphed, vocab, e_tokens)
    assert graphed.graphs.captures == report.captured and graphed.graphs.eager_misses == 0
    for a, b in zip(e_logits, g_logits):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-2 * float(a.abs().max()))
