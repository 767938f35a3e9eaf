"""The CUDA fast path end to end: the Triton backend with CUDA graphs against the torch
reference backend (the oracle), on whole models.

- bf16 logits of paged decode steps: the fast path's error against the fp32 reference is
  within the bf16 tolerance and no worse than the bf16 torch reference's own (x1.25);
- greedy tokens: over 1,024 teacher-forced decode positions (every runner fed the fp32
  reference's tokens, so one early flip cannot cascade) the fast path's argmax equals the
  bf16 torch reference's at >= 99% of positions where bf16 itself tracks fp32 that well
  (random:100m); on the demo model, whose near-tied logits bf16 rounding flips often, it
  may not flip more positions away from fp32 than the bf16 reference does (2% slack);
- CUDA-graph replay (padded buckets, several table widths) == eager Triton decode; mixed
  steps' graphs as close to the fp32 reference as their eager run (`assert_as_close_to_fp32`);
- batched == solo through graphs.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")


@pytest.fixture(scope="module", params=["demo", "random:100m"])
def loaded32(request: pytest.FixtureRequest, demo_dir: Path) -> LoadedModel:
    spec = str(demo_dir) if request.param == "demo" else request.param
    return load_model(spec, torch.device("cuda"), torch.float32)


@pytest.fixture(scope="module")
def loaded(loaded32: LoadedModel) -> LoadedModel:
    """The same weights in bf16 (random presets draw per dtype, so convert, don't reload)."""
    model = copy.deepcopy(loaded32.model).to(torch.bfloat16)
    return dataclasses.replace(loaded32, model=model, dtype=torch.bfloat16)


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


def worst_error(truth: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(truth, got))


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    # position k+1 of each row: the argmax after the same k forced tokens
    same = sum(int(x == y) for ra, rb in zip(a, b) for x, y in zip(ra[1:], rb[1:]))
    return same, sum(len(r) - 1 for r in a)


def test_triton_graphs_match_the_torch_reference(
    loaded32: LoadedModel, loaded: LoadedModel
) -> None:
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 5, 300, 33)]
    steps = 256  # x 4 sequences = 1,024 decode positions
    truth_tokens, truth = decode_trace(runner(loaded32, "torch", False), prompts, None, steps)
    ref_tokens, ref = decode_trace(runner(loaded, "torch", False), prompts, truth_tokens, steps)
    fast = runner(loaded, "triton", graphs=True)
    assert fast.graphs is not None
    fast_tokens, got = decode_trace(fast, prompts, truth_tokens, steps)
    ref_err, fast_err = worst_error(truth, ref), worst_error(truth, got)
    first = worst_error(truth[:16], got[:16])
    same, total = agreement(ref_tokens, fast_tokens)
    ref_fp32, _ = agreement(truth_tokens, ref_tokens)
    fast_fp32, _ = agreement(truth_tokens, fast_tokens)
    print(
        f"\n{loaded.name}: max rel |Δlogit| vs fp32 over {steps} steps: torch bf16 "
        f"{ref_err:.2e}, triton+graphs bf16 {fast_err:.2e} (first 16 steps {first:.2e}); "
        f"greedy agreement: triton vs torch bf16 {same}/{total}, torch bf16 vs fp32 "
        f"{ref_fp32}/{total}, triton vs fp32 {fast_fp32}/{total}"
    )
    # The stated bf16 tolerance (5e-2) is checked on the fidelity configs by test_fidelity,
    # whose CUDA runs take this path. Over a long trace of a random model bf16 KV drifts from
    # fp32 for any implementation: the fast path may not drift more than the reference.
    assert first <= 1.25 * worst_error(truth[:16], ref[:16]) + 1e-3, first
    assert fast_err <= 1.25 * ref_err + 1e-3, (fast_err, ref_err)
    if ref_fp32 >= 0.99 * total:  # where bf16 itself tracks fp32: >= 99% identical tokens
        assert same >= 0.99 * total
    else:  # a model whose greedy choices bf16 rounding flips: no more flips than the reference
        assert fast_fp32 >= ref_fp32 - 0.02 * total, (fast_fp32, ref_fp32)


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
    # the prompts (<= 512 tokens) prefill through mixed-step graphs padded to their chunk
    # bucket, the eager runner's unpadded: other GEMM tilings, so bf16 KV differs by rounding
    for a, b in zip(e_logits, g_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * float(a.abs().max()))
    solo = [decode_trace(graphed, [p], [t], 12)[1] for p, t in zip(prompts, e_tokens)]
    for i, per_seq in enumerate(solo):
        for k, row in enumerate(per_seq):
            scale = float(row.abs().max())
            torch.testing.assert_close(g_logits[k][i], row[0], rtol=0, atol=1e-2 * scale)


def test_a_graphed_decode_step_syncs_only_at_the_readback(loaded: LoadedModel) -> None:
    """Input upload (pinned, block-table diffs), graph replay and sampling never wait for
    the device; the caller's one readback of the sampled ids is the step's only sync."""
    r = runner(loaded, "triton", graphs=True)
    pool = BlockPool(r.num_blocks)
    tables = [BlockTable(r.block_size) for _ in range(3)]
    for i, t in enumerate(tables):
        t.ensure(pool, 40)
        r.step([SeqInput(list(range(1, 31 + i)), 0, t.blocks)])

    def seqs(n: int) -> list[SeqInput]:
        return [
            SeqInput([5], n + i, t.blocks, seq_id=i + 1, table_epoch=t.epoch)
            for i, t in enumerate(tables)
        ]

    r.step(seqs(30))  # captures the graph of this shape
    batch = seqs(31)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = r._decode_logits(batch).float()
        ids = r.sampler.sample(logits, [s.sampling for s in batch], [0, 0, 0], [(), (), ()])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(ids.tolist()) == 3


def mixed_trace(r: ModelRunner, vocab: int) -> list[torch.Tensor]:
    """Steps of 3 decoders next to one prompt's chunks (9, 40, 130 and 200 tokens, the last
    one sampled), then 2 decoders + a 1-token-past-a-bucket chunk; logits of every step."""
    gen = torch.Generator().manual_seed(5)
    pool = BlockPool(r.num_blocks)
    dec_lens = [30, 700, 5]
    dec = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in dec_lens]
    tables = [BlockTable(r.block_size) for _ in dec]
    pos = list(dec_lens)
    for p, t in zip(dec, tables):
        t.ensure(pool, len(p) + 64)
        r.step([SeqInput(p, 0, t.blocks)])
    long = torch.randint(0, vocab, (9 + 40 + 130 + 200 + 65,), generator=gen).tolist()
    lt = BlockTable(r.block_size)
    lt.ensure(pool, len(long))
    out, done, k = [], 0, 0
    for c in (9, 40, 130, 200, 65):
        n_dec = 3 if c != 65 else 2
        seqs = [
            SeqInput([7 + k], pos[i], tables[i].blocks, seq_id=i + 1, table_epoch=tables[i].epoch)
            for i in range(n_dec)
        ]
        last = done + c == len(long)
        chunk = SeqInput(long[done : done + c], done, lt.blocks, sample=last, seq_id=99)
        seqs.insert(1, chunk)  # the chunk between decode rows: the logits keep seqs' order
        res = r.step(seqs, return_logits=True)
        assert res.logits is not None and res.logits.shape[0] == n_dec + int(last)
        out.append(res.logits.clone())
        pos = [p + 1 for p in pos]
        done, k = done + c, k + 1
    return out


def assert_as_close_to_fp32(
    ref32: list[torch.Tensor], eager: list[torch.Tensor], graphed: list[torch.Tensor]
) -> None:
    """Each step's graphed bf16 logits are as close to the fp32 reference's as the eager
    bf16 ones are (x1.25, plus 1% of the logit scale). Not a fixed tolerance between the two
    bf16 runs: on the demo model bf16's own error reaches ~18% of the logit scale, and two
    runs that pad and split differently part by more than 2% of it at a few logits (an H100,
    session 41: 0.117 where 0.112 was allowed, 2 of 3,072) — while a replay fault (a wrong
    row, stale KV) is off by the logits' own size."""
    for k, (r, a, b) in enumerate(zip(ref32, eager, graphed, strict=True)):
        err_eager, err_graphed = worst_error([r], [a]), worst_error([r], [b])  # / the scale
        assert err_graphed <= 1.25 * err_eager + 1e-2, (k, err_graphed, err_eager)


def test_mixed_step_graphs_equal_eager(loaded32: LoadedModel, loaded: LoadedModel) -> None:
    """Decodes + one chunk replay a mixed-step graph (padded to its buckets, split-K fixed by
    the shape) and agree with the same steps run eagerly."""
    vocab = loaded.config.vocab_size
    ref32 = mixed_trace(runner(loaded32, "torch", graphs=False), vocab)
    eager = mixed_trace(runner(loaded, "triton", graphs=False), vocab)
    graphed_runner = runner(loaded, "triton", graphs=True)
    assert graphed_runner.mixed is not None
    graphed = mixed_trace(graphed_runner, vocab)
    assert graphed_runner.graphs is not None
    mixed_keys = [key for key in graphed_runner.graphs.keys if key.mixed]
    assert len(mixed_keys) >= 4, mixed_keys  # chunk buckets 32, 64, 256 (x2: 130 and 200)
    assert_as_close_to_fp32(ref32, eager, graphed)


@pytest.mark.parametrize("backend", ["triton-split", "triton-small"])
@pytest.mark.parametrize("graphs", [False, True])
def test_split_decode_rows_equal_the_one_launch_path(
    loaded32: LoadedModel, loaded: LoadedModel, graphs: bool, backend: str
) -> None:
    """The triton-split backend (a mixed step's leading decode rows through the decode
    kernel, its chunk through the prefill kernel past them) and triton-small (the decode rows
    on 16-row tiles of the one prefill launch) are as close to the fp32 logits as one prefill
    launch over every row on its 128-row tiles, eagerly (one leading row: the chunk comes
    second) and in mixed-step graphs (every decode row of the bucket leads)."""
    vocab = loaded.config.vocab_size
    ref32 = mixed_trace(runner(loaded32, "torch", graphs=False), vocab)
    one = mixed_trace(runner(loaded, "triton", graphs=False), vocab)
    other = runner(loaded, backend, graphs=graphs)
    if backend == "triton-split":
        assert getattr(other.backend, "split_decode_rows", False)
    else:
        assert other.backend.prefill_launch.small_m == 16  # type: ignore[union-attr]
    assert_as_close_to_fp32(ref32, one, mixed_trace(other, vocab))


def chunks_trace(r: ModelRunner, vocab: int) -> list[torch.Tensor]:
    """Steps of 2 decoders beside 1 to 3 prompts' chunks at once (the prompts at different
    cached lengths, the chunk between the decode rows, some chunks sampled); logits of each."""
    gen = torch.Generator().manual_seed(9)
    pool = BlockPool(r.num_blocks)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    dec = [ids(n) for n in (40, 300)]
    tables = [BlockTable(r.block_size) for _ in range(5)]
    for p, t in zip(dec, tables):
        t.ensure(pool, len(p) + 8)
        r.step([SeqInput(p, 0, t.blocks)])
    prompts = [ids(n) for n in (500, 90, 260)]
    for p, t in zip(prompts, tables[2:]):
        t.ensure(pool, len(p))
    done, pos, out = [0, 0, 0], [40, 300], []
    # (chunk tokens per prompt, 0: not in this step): several chunks, one, three, two
    for k, sizes in enumerate([(100, 50, 0), (0, 40, 0), (200, 0, 120), (200, 0, 140)]):
        seqs = [
            SeqInput([5 + k], pos[i], tables[i].blocks, seq_id=i + 1, table_epoch=0)
            for i in range(2)
        ]
        for j, c in enumerate(sizes):
            if c:
                p = prompts[j]
                last = done[j] + c == len(p)
                chunk = SeqInput(p[done[j] : done[j] + c], done[j], tables[2 + j].blocks,
                                 sample=last or j == 0, seq_id=10 + j)  # fmt: skip
                seqs.insert(1, chunk)
                done[j] += c
        res = r.step(seqs, return_logits=True)
        assert res.logits is not None
        out.append(res.logits.clone())
        pos = [p + 1 for p in pos]
    assert done == [len(p) for p in prompts]
    return out


def test_several_chunk_steps_replay_graphs_equal_to_eager(
    loaded32: LoadedModel, loaded: LoadedModel
) -> None:
    """With max_graph_chunks 4 a step of decodes and 2-3 prompt chunks replays a mixed-step
    graph (captured with one chunk; the other chunk rows empty) and gives the eager logits."""
    vocab = loaded.config.vocab_size
    ref32 = chunks_trace(runner(loaded32, "torch", graphs=False), vocab)
    eager = chunks_trace(runner(loaded, "triton", graphs=False), vocab)
    r = ModelRunner(loaded, num_blocks=1024, backend="triton", max_graph_chunks=4)
    graphed = chunks_trace(r, vocab)
    assert r.graphs is not None and r.graphs.eager_misses == 0
    assert not r.launches_eagerly(
        [SeqInput([1, 2], 0, [0]), SeqInput([3], 5, [1]), SeqInput([4, 5, 6], 0, [2])]
    )
    assert_as_close_to_fp32(ref32, eager, graphed)
