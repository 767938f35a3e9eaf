"""CUDA graphs captured ahead of use, as far as a CPU can check them: which shapes the plan
holds, what a step that misses does, and that the dummy inputs a capture runs over touch
only the layout's scratch block (the decode forward runs eagerly here over them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.model.cuda_graphs import GraphKey, StepGraphs, default_buckets
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.mixed_batch import CONTEXT, QUERY_START, SLOTS, MixedBatch
from ds4pool.model.runner import ModelRunner


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def graphs_for(runner: ModelRunner, mode: str = "ahead", max_chunk: int = 128) -> StepGraphs:
    """A StepGraphs over a CPU runner's buffers (the runner builds none off CUDA)."""
    cfg = runner.loaded.config
    mixed = MixedBatch(
        runner.layout,
        runner.batch.max_rows,
        max_chunk,
        runner.max_blocks_per_seq,
        runner.device,
        runner.backend.index_dtype,
        cfg.sliding_window,
    )
    return StepGraphs(
        runner.model,
        runner.kv_caches,
        runner.batch,
        default_buckets(runner.batch.max_rows),
        cfg.vocab_size,
        runner.loaded.dtype,
        mixed,
        lambda chunk, width: 1,
        mode,
    )


def test_the_plan_covers_every_reachable_shape_up_to_the_pools_capacity(
    loaded: LoadedModel,
) -> None:
    runner = ModelRunner(loaded, num_blocks=300, max_decode_batch=8)
    g = graphs_for(runner)
    assert g.widths == [64, 256, 1024, 2048]  # the demo's 32k context in 16-token blocks
    plan = g.plan()
    # no context outgrows 300 blocks: widths past the first bucket >= 300 cannot be reached
    assert sorted({k.width for k in plan}) == [64, 256, 1024]
    assert sorted({k.chunk for k in plan}) == [0, 32, 64, 128]  # decode + chunk buckets
    assert sorted({k.bucket for k in plan}) == [1, 2, 4, 8]
    assert len(plan) == len(set(plan)) == 3 * 4 * 4
    # narrow tables first, decode before mixed within a width
    assert plan[0] == GraphKey(64, 0, 1) and plan[-1] == GraphKey(1024, 128, 8)
    assert [k.width for k in plan] == sorted(k.width for k in plan)
    # every step shape maps onto a planned key
    for decodes, chunk, ctx in ((3, 0, 17), (8, 0, 300 * 16), (5, 100, 2000), (0, 9, 40)):
        bucket = g.bucket_for(max(decodes, 1))
        assert bucket is not None
        if chunk:
            shape = g.mixed_shape(decodes, chunk)
            assert shape is not None and g.mixed_key(shape, ctx) in plan
        else:
            assert g.decode_key(bucket, ctx) in plan


def test_a_miss_runs_eagerly_and_is_captured_first_when_idle(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, num_blocks=300, max_decode_batch=8)
    ahead, lazy = graphs_for(runner, "ahead"), graphs_for(runner, "lazy")
    key = GraphKey(256, 64, 4)
    assert lazy.ready(key)  # lazy captures on the spot
    ahead._pending = {GraphKey(64, 0, 1): None}
    assert not ahead.ready(key) and not ahead.ready(key)
    assert ahead.eager_misses == 2
    assert list(ahead._pending) == [key, GraphKey(64, 0, 1)]  # the miss goes first, once


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [c.clone() for c in runner.kv_caches]


@pytest.mark.parametrize("model", ["demo", "random:deepseek-v3-tiny"])
def test_dummy_decode_inputs_write_only_the_scratch_block(loaded: LoadedModel, model: str) -> None:
    if model != "demo":  # latent attention: one plane, the MLA decode path
        loaded = load_model(model, torch.device("cpu"), torch.float32)
    runner = ModelRunner(loaded, num_blocks=64, max_decode_batch=8)
    for c in runner.kv_caches:
        c.normal_()  # sessions' KV: any change shows
    g = graphs_for(runner)
    before = snapshot(runner)
    scratch = runner.layout.num_blocks
    for key in (GraphKey(64, 0, 8), GraphKey(2048, 0, 4)):
        g.load_dummy(key)
        g._forward(key.bucket, key.width)  # what the warm-up runs and the graph records
        assert torch.isfinite(g._logits[: key.bucket]).all()
    for old, new in zip(before, runner.kv_caches):
        assert torch.equal(old[:, :scratch], new[:, :scratch])  # every session block as it was
        assert not torch.equal(old[:, scratch], new[:, scratch])  # the forward did write


def test_dummy_mixed_inputs_address_only_the_scratch_block(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, num_blocks=64, max_decode_batch=8)
    g = graphs_for(runner, max_chunk=128)
    layout, mixed = runner.layout, g.mixed
    assert mixed is not None
    bs, scratch = layout.block_size, layout.num_blocks
    key = GraphKey(256, 128, 8)
    g.load_dummy(key)
    t, s = key.bucket + key.chunk, key.bucket + 2
    slots = mixed.tok[SLOTS, :t]
    assert ((slots >= scratch * bs) & (slots < (scratch + 1) * bs)).all()
    ctx = mixed.seqs[CONTEXT, :s].tolist()
    assert ctx == [1] * key.bucket + [key.chunk, 0]
    starts = mixed.seqs[QUERY_START, : s + 1].tolist()
    assert starts[-1] == t
    tables = mixed.table_rows.tables
    for row, n in enumerate(ctx):  # the blocks each sequence's context reads
        assert (tables[row, : -(-n // bs)] == scratch).all()


def test_a_gathering_backends_wide_keys_get_no_graph(loaded: LoadedModel) -> None:
    # the torch MLA reference gathers bucket x width tokens of latent per layer: past its
    # bound a decode step runs eagerly, in either mode, and the plan leaves the key out
    runner = ModelRunner(loaded, num_blocks=300, max_decode_batch=8)
    g = graphs_for(runner)
    g.max_gather_tokens = 4 * 256 * runner.block_size  # bucket 4 at width 256 just fits
    plan = g.plan()
    assert GraphKey(256, 0, 4) in plan and GraphKey(256, 0, 8) not in plan
    assert GraphKey(1024, 0, 1) in plan and GraphKey(1024, 0, 2) not in plan
    assert not g.ready(GraphKey(256, 0, 8)) and g.eager_misses == 0 and not g._pending
    lazy = graphs_for(runner, "lazy")
    lazy.max_gather_tokens = g.max_gather_tokens
    assert not lazy.ready(GraphKey(256, 0, 8)) and lazy.ready(GraphKey(256, 0, 4))


def test_deepseek_v3_decode_is_graphable_where_its_experts_run_sync_free() -> None:
    from ds4pool.model.attention_mla import TorchMLAAttention

    mla = load_model("random:deepseek-v3-tiny", torch.device("cpu"), torch.float32)
    moe = [m for m in mla.model.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert moe and not mla.model.supports_cuda_graphs  # CPU: the per-expert loop syncs
    for m in moe:
        m.impl = "grouped_mm"  # what CUDA bf16 picks
    assert mla.model.supports_cuda_graphs
    assert TorchMLAAttention.supports_cuda_graphs and TorchMLAAttention.graph_gather_tokens
    # no mixed-step graphs for the reference: its prompt chunks are sliced by host lists
    assert not hasattr(TorchMLAAttention, "graph_prefill_partitions")
    # the Triton backend runs prompt chunks on the reference too, but gathers no context in
    # decode: decode graphs at any width
    from ds4pool.model.attention_mla_triton import TritonMLAAttention

    assert TritonMLAAttention.supports_cuda_graphs
    assert not hasattr(TritonMLAAttention, "graph_prefill_partitions")
    assert not hasattr(TritonMLAAttention, "graph_gather_tokens")
