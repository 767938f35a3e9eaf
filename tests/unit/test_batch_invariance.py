"""One ragged batch must give each sequence the same result as running it alone (dense,
mixture-of-experts and latent-attention models: a token's experts depend on it alone, not on
its batch)."""

from __future__ import annotations

import pytest
import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.runner import ModelRunner, SeqInput
from tests.hf_models import tiny_runner

BLOCK = 8


@pytest.fixture(scope="module", params=["llama", "qwen3-moe", "deepseek-v3"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    return tiny_runner(300, seed=3, block_size=BLOCK, arch=request.param)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(runner: ModelRunner, pool: BlockPool, seqs: list[tuple[list[int], int, BlockTable]]):
    for tokens, start, table in seqs:
        table.ensure(pool, start + len(tokens))
    out = runner.step(
        [SeqInput(tokens, start, table.blocks) for tokens, start, table in seqs],
        return_logits=True,
    )
    assert out.logits is not None
    return out.logits


def test_ragged_prefill_batch_equals_solo_runs(runner: ModelRunner) -> None:
    pool = BlockPool(runner.num_blocks)
    prompts = [ids(n, seed=n) for n in (5, 17, 33, 50)]
    solo = []
    for p in prompts:
        table = BlockTable(BLOCK)
        solo.append(run(runner, pool, [(p, 0, table)])[0])
        table.release(pool)
    tables = [BlockTable(BLOCK) for _ in prompts]
    batched = run(runner, pool, [(p, 0, t) for p, t in zip(prompts, tables)])
    for i in range(len(prompts)):
        assert (batched[i] - solo[i]).abs().max().item() < 1e-5

    # ...and the decode step after it, all four together vs each alone
    nxt = [int(row.argmax()) for row in batched]
    together = run(runner, pool, [([t], len(p), tb) for t, p, tb in zip(nxt, prompts, tables)])
    for i, (t, p, tb) in enumerate(zip(nxt, prompts, tables)):
        alone = run(runner, pool, [([t], len(p), tb)])[0]
        assert (together[i] - alone).abs().max().item() < 1e-5
    for t in tables:
        t.release(pool)
    pool.check_integrity()
    assert pool.num_used == 0


def test_prefill_chunk_mixed_with_decodes_equals_separate_runs(runner: ModelRunner) -> None:
    pool = BlockPool(runner.num_blocks)
    a, b, c = ids(40, 1), ids(23, 2), ids(61, 3)
    ta, tb, tc = BlockTable(BLOCK), BlockTable(BLOCK), BlockTable(BLOCK)
    run(runner, pool, [(a, 0, ta)])
    run(runner, pool, [(b, 0, tb)])
    run(runner, pool, [(c[:30], 0, tc)])  # first chunk of c's prompt
    # one step: decode for a and b, the second chunk of c's prompt
    mixed = run(runner, pool, [([7], 40, ta), (c[30:], 30, tc), ([9], 23, tb)])
    # the same work as three separate steps, re-writing the same KV slots
    sep_a = run(runner, pool, [([7], 40, ta)])[0]
    sep_c = run(runner, pool, [(c[30:], 30, tc)])[0]
    sep_b = run(runner, pool, [([9], 23, tb)])[0]
    for got, want in ((mixed[0], sep_a), (mixed[1], sep_c), (mixed[2], sep_b)):
        assert (got - want).abs().max().item() < 1e-5
    # and chunked prefill of c equals prefilling it whole
    whole_table = BlockTable(BLOCK)
    whole = run(runner, pool, [(c, 0, whole_table)])[0]
    assert (whole - sep_c).abs().max().item() < 1e-4
    for t in (ta, tb, tc, whole_table):
        t.release(pool)
    pool.check_integrity()


def test_packed_cpu_linears_make_decode_rows_bitwise_batch_invariant() -> None:
    """With oneDNN's packed weights a decode row's logits are the same bits alone as inside
    a batch of eight (MKL's F.linear changes its blocking with the row count). The rows'
    contexts are of one length: ragged ones are padded to the decode group's longest, which
    changes the fused CPU attention kernel's tiling and so its rounding (attention_cpu.py
    promises no more than that; on an AVX-512 Xeon it shows, on the EPYC it did not)."""
    from ds4pool.model.cpu_linear import PackedLinear, pack_cpu_linears, select_cpu_linear

    cpu = torch.device("cpu")
    if select_cpu_linear("auto", cpu, torch.float32) != "onednn":
        pytest.skip("no oneDNN linear in this torch build")
    runner = tiny_runner(300, seed=5, block_size=BLOCK)
    runner.model.fuse_projections()
    assert pack_cpu_linears(runner.model, "onednn", cpu, torch.float32) == "onednn"
    assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    pool = BlockPool(runner.num_blocks)
    prompts = [ids(29, seed=40 + i) for i in range(8)]
    tables = [BlockTable(BLOCK) for _ in prompts]
    for p, t in zip(prompts, tables):
        run(runner, pool, [(p, 0, t)])
    nxt = ids(len(prompts), seed=99)
    together = run(runner, pool, [([t], len(p), tb) for t, p, tb in zip(nxt, prompts, tables)])
    for i, (t, p, tb) in enumerate(zip(nxt, prompts, tables)):
        alone = run(runner, pool, [([t], len(p), tb)])[0]
        assert torch.equal(together[i], alone), f"row {i}: {(together[i] - alone).abs().max()}"
    for t in tables:
        t.release(pool)
