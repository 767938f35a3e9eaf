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
