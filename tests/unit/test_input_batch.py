"""The persistent decode input batch: block tables on the device follow the sequences'
tables exactly, while only the changed block ids are uploaded."""

from __future__ import annotations

import random

import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.input_batch import DecodeRow, InputBatch
from ds4pool.model.kv_layout import KVLayout

BS = 4


def make_batch(rows: int = 4, max_blocks: int = 32) -> InputBatch:
    layout = KVLayout(2, 64, BS, 2, 8, torch.float32)
    return InputBatch(layout, rows, max_blocks, torch.device("cpu"), torch.int32, None)


def check(batch: InputBatch, tables: list[BlockTable], positions: list[int]) -> None:
    for i, (t, p) in enumerate(zip(tables, positions)):
        n = len(t.blocks)
        assert batch.tables[i, :n].tolist() == t.blocks, i
        assert int(batch.tokens[1, i]) == p
        assert int(batch.tokens[2, i]) == t.blocks[p // BS] * BS + p % BS
        assert int(batch.context_lens[i]) == p + 1


def rows_of(tables: list[BlockTable], positions: list[int], ids: list[int]) -> list[DecodeRow]:
    return [
        DecodeRow(7, p, list(t.blocks), seq_id=s, table_epoch=t.epoch)
        for t, p, s in zip(tables, positions, ids)
    ]


def test_growing_tables_upload_only_new_blocks() -> None:
    pool = BlockPool(64)
    batch = make_batch()
    tables = [BlockTable(BS) for _ in range(3)]
    positions = [5, 9, 2]
    for t, p in zip(tables, positions):
        t.ensure(pool, p + 1)
    batch.load(rows_of(tables, positions, [1, 2, 3]), 4)
    check(batch, tables, positions)
    first = batch.uploaded_block_ids
    assert first == sum(len(t.blocks) for t in tables)
    for _ in range(20):  # decode 20 tokens each: one new block every BS steps
        positions = [p + 1 for p in positions]
        for t, p in zip(tables, positions):
            t.ensure(pool, p + 1)
        batch.load(rows_of(tables, positions, [1, 2, 3]), 4)
        check(batch, tables, positions)
    grown = sum(len(t.blocks) for t in tables) - first
    assert batch.uploaded_block_ids == first + grown  # no block id sent twice


def test_truncation_rows_moving_and_anonymous_rows_are_rewritten() -> None:
    rng = random.Random(0)
    pool = BlockPool(64)
    batch = make_batch()
    tables = [BlockTable(BS) for _ in range(4)]
    positions = [rng.randrange(1, 40) for _ in tables]
    ids = [1, 2, 3, 4]
    for t, p in zip(tables, positions):
        t.ensure(pool, p + 1)
    batch.load(rows_of(tables, positions, ids), 4)
    for _ in range(30):
        action = rng.choice(["truncate", "shuffle", "grow", "drop"])
        if action == "truncate":  # rollback / preemption: blocks freed and reallocated
            i = rng.randrange(len(tables))
            keep = rng.randrange(0, positions[i])
            tables[i].truncate(pool, keep)
            other = BlockTable(BS)
            other.ensure(pool, 8)  # someone else takes the freed ids meanwhile
            tables[i].ensure(pool, positions[i] + 1)
        elif action == "shuffle":  # the scheduler's order changed: rows move
            order = list(range(len(tables)))
            rng.shuffle(order)
            tables = [tables[j] for j in order]
            positions = [positions[j] for j in order]
            ids = [ids[j] for j in order]
        elif action == "drop" and len(tables) > 1:
            j = rng.randrange(len(tables))
            del tables[j], positions[j], ids[j]
        positions = [p + 1 for p in positions]
        for t, p in zip(tables, positions):
            t.ensure(pool, p + 1)
        batch.load(rows_of(tables, positions, ids), 4)
        check(batch, tables, positions)
    # rows without identity are rewritten every time and stay exact
    anon = [DecodeRow(3, p, list(t.blocks)) for t, p in zip(tables, positions)]
    batch.load(anon, 4)
    check(batch, tables, positions)


def test_padding_rows_write_the_scratch_slot_with_no_context() -> None:
    pool = BlockPool(64)
    batch = make_batch()
    t = BlockTable(BS)
    t.ensure(pool, 3)
    batch.load([DecodeRow(5, 2, list(t.blocks), 1, t.epoch)], 4)
    assert batch.tokens[2, 1:4].tolist() == [batch.layout.scratch_slot] * 3
    assert batch.context_lens[1:4].tolist() == [0, 0, 0]
    assert batch.layout.scratch_slot == 64 * BS  # past every pool block


def test_mixed_batch_lays_out_decodes_chunk_and_padding() -> None:
    """The mixed-graph layout: decode rows, padded rows (context 0, scratch slot), the chunk
    as sequence `bucket`, a padding sequence of context 0; logit rows in the sampled order;
    the real tokens' positions and slots are what build_metadata computes."""
    from ds4pool.model.attention import build_metadata
    from ds4pool.model.mixed_batch import ChunkRow, MixedBatch, MixedShape, chunk_buckets

    layout = KVLayout(2, 64, BS, 2, 8, torch.float32)
    mixed = MixedBatch(layout, 8, 64, 32, torch.device("cpu"), torch.int32, None)
    pool = BlockPool(64)
    tables = [BlockTable(BS) for _ in range(3)]
    for t, n in zip(tables, [6, 10, 21]):
        t.ensure(pool, n)
    decodes = rows_of(tables[:2], [5, 9], [1, 2])
    chunk = ChunkRow(list(range(11, 18)), 14, list(tables[2].blocks), seq_id=3)
    shape = MixedShape(bucket=4, chunk_bucket=32)
    # sampled: the chunk's last token, then decode row 1 (decode row 0 is not sampled)
    assert mixed.load(decodes, [chunk], [2, 1], shape) == 21
    ref = build_metadata(
        [1, 1, 7], [6, 10, 21], [t.blocks for t in tables], BS, torch.device("cpu")
    )
    meta = mixed.metadata(shape, width=8, partitions=2)
    real = [0, 1] + list(range(4, 11))  # token indices of the real tokens
    assert meta.positions[real].tolist() == ref.positions.tolist()
    assert meta.slot_mapping[real].tolist() == ref.slot_mapping.tolist()
    pads = [2, 3] + list(range(11, 36))
    assert set(meta.slot_mapping[pads].tolist()) == {layout.scratch_slot}
    assert meta.positions[pads].tolist() == [0] * len(pads)
    assert mixed.input_ids[4:11].tolist() == list(range(11, 18))
    assert meta.context_lens.tolist() == [6, 10, 0, 0, 21, 0]
    assert meta.query_start.tolist() == [0, 1, 2, 3, 4, 11, 36]
    assert meta.max_query_len == 32 and meta.prefill_partitions == 2 and not meta.decode_only
    # decode rows, padding included, lead: a backend may attend them with its decode kernel
    assert meta.lead_decode_rows == 4 and ref.lead_decode_rows == 2
    lead = [build_metadata(q, [9] * len(q), [[0] * 9] * len(q), BS, torch.device("cpu"))
            for q in ([1, 5, 1], [1, 1, 1], [3, 1])]  # fmt: skip
    assert [m.lead_decode_rows for m in lead] == [1, 0, 0]  # decode-only: no split to make
    assert meta.block_tables.shape == (6, 8)
    assert meta.block_tables[4, :6].tolist() == tables[2].blocks
    assert mixed.logit_rows(shape).tolist() == [10, 1, 0, 0, 0]
    sent = mixed.table_rows.uploaded_block_ids
    mixed.load(rows_of(tables[:2], [5, 9], [1, 2]), [chunk], [], shape)  # same tables again
    assert mixed.table_rows.uploaded_block_ids == sent  # nothing re-sent
    assert chunk_buckets(512) == [32, 64, 128, 256, 512]
    assert chunk_buckets(300) == [32, 64, 128, 256, 300]
    assert chunk_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    fine = [32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert chunk_buckets(2048, several=True) == fine
    assert chunk_buckets(1000, several=True) == [32, 64, 128, 256, 512, 768, 1000]


def test_mixed_batch_lays_out_several_chunks_and_empty_chunk_rows() -> None:
    """Up to K chunks back to back after the decode rows (sequences bucket.. bucket + k - 1),
    empty chunk rows up to K (no token, context 0), then the padding sequence; a chunk's
    last token is its logit row; positions and slots as build_metadata computes them."""
    from ds4pool.model.attention import build_metadata
    from ds4pool.model.mixed_batch import ChunkRow, MixedBatch, MixedShape

    layout = KVLayout(2, 64, BS, 2, 8, torch.float32)
    mixed = MixedBatch(layout, 8, 64, 32, torch.device("cpu"), torch.int32, None, max_chunks=4)
    pool = BlockPool(64)
    tables = [BlockTable(BS) for _ in range(4)]
    for t, n in zip(tables, [6, 10, 21, 40]):
        t.ensure(pool, n)
    decodes = rows_of(tables[:2], [5, 9], [1, 2])
    chunks = [
        ChunkRow(list(range(11, 18)), 14, list(tables[2].blocks), seq_id=3),
        ChunkRow(list(range(30, 42)), 28, list(tables[3].blocks), seq_id=4),
    ]
    shape = MixedShape(bucket=4, chunk_bucket=32)
    # sampled: the second chunk, decode row 0, the first chunk
    assert mixed.load(decodes, chunks, [3, 0, 2], shape) == 40
    ref = build_metadata(
        [1, 1, 7, 12], [6, 10, 21, 40], [t.blocks for t in tables], BS, torch.device("cpu")
    )
    meta = mixed.metadata(shape, width=16, partitions=1)
    real = [0, 1] + list(range(4, 23))
    assert meta.positions[real].tolist() == ref.positions.tolist()
    assert meta.slot_mapping[real].tolist() == ref.slot_mapping.tolist()
    assert set(meta.slot_mapping[[2, 3, *range(23, 36)]].tolist()) == {layout.scratch_slot}
    assert mixed.input_ids[4:23].tolist() == list(range(11, 18)) + list(range(30, 42))
    # 4 decode rows, chunks at 4 and 5, empty chunk rows 6 and 7, the padding sequence 8
    assert meta.context_lens.tolist() == [6, 10, 0, 0, 21, 40, 0, 0, 0]
    assert meta.query_start.tolist() == [0, 1, 2, 3, 4, 11, 23, 23, 23, 36]
    assert meta.block_tables.shape == (9, 16)
    assert meta.block_tables[5, : len(tables[3].blocks)].tolist() == tables[3].blocks
    assert mixed.logit_rows(shape).tolist() == [22, 0, 10, 0, 0, 0, 0, 0]
    # one chunk next time: the second chunk's row is forgotten, not left to be attended
    assert mixed.load(decodes, chunks[:1], [2], shape) == 21
    meta = mixed.metadata(shape, width=16, partitions=1)
    assert meta.context_lens.tolist() == [6, 10, 0, 0, 21, 0, 0, 0, 0]
    assert meta.query_start.tolist() == [0, 1, 2, 3, 4, 11, 11, 11, 11, 36]


def test_host_ints_gives_torch_tensors_values_and_dtypes() -> None:
    """device.host_ints (numpy's list conversion) builds what torch.tensor() would: flat and
    nested lists, int64 and int32 (block tables), empty ones; an id past int32 is an error."""
    import pytest

    from ds4pool.model.device import host_ints

    for values in ([3, 0, 2**40], [[1, 2, 3], [4, 5, 6]], [], [[], []]):
        got, want = host_ints(values), torch.tensor(values, dtype=torch.int64)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    tables = [[7, 8, 0], [9, 0, 0]]
    assert torch.equal(host_ints(tables, torch.int32), torch.tensor(tables, dtype=torch.int32))
    assert host_ints(tables, torch.int32).dtype == torch.int32
    with pytest.raises(OverflowError):
        host_ints([2**31], torch.int32)


def test_slot_tensor_is_slots_on_the_device() -> None:
    """KVLayout.slot_tensor (restores, snapshots, copy-on-write) equals the list `slots`
    builds, for ranges that start and end inside blocks, empty ones included."""
    layout = KVLayout(2, 64, 4, 2, 8, torch.float32)
    blocks = [9, 3, 40, 7, 21]
    for start, end in ((0, 20), (0, 1), (5, 18), (4, 8), (7, 7), (19, 20)):
        got = layout.slot_tensor(blocks, start, end, torch.device("cpu"))
        assert got.dtype == torch.int64
        assert got.tolist() == layout.slots(blocks, start, end), (start, end)
