"""The persistent input batch of decode steps: per-row inputs kept on the device.

A decode step has one token per sequence. Row i of the step is sequence i of the batch;
its inputs live in preallocated device buffers that a CUDA graph can read, so a step
uploads only what changed since the last one:

    tokens  [4, R] int64   rows: input id, position, slot, context length
    tables  [R, max_blocks] int32   block tables (row-major, padded with 0)

`tokens` is rewritten each step (4 × B ints: one pinned host → device copy, from one of two
staging buffers in turn, so a step launched ahead never rewrites the one the step before it
may still be copying from; `feed` then puts that step's sampled ids in the ids row on the
device). Block tables
are updated by diffs (`TableRows`): a row that held the same sequence (`seq_id`) under the
same block table epoch last step gets only the block ids past the ones it has (usually
none, one every block_size steps); any other row is rewritten. The diffs of all rows go up
as one [3, K] tensor (row, column, id) and land with one scatter. `MixedBatch`
(mixed_batch.py) keeps the same for steps of decodes plus one prompt chunk.

Rows [B, bucket) of a CUDA-graph bucket are padding: token 0 at position 0, writing its
K/V to the layout's scratch slot, context length 0 (attention writes zeros).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.device import host_ints, upload
from ds4pool.model.kv_layout import KVLayout

IDS, POSITIONS, SLOTS, CONTEXT = range(4)


@dataclass
class _Row:
    seq_id: int
    epoch: int
    num_blocks: int  # block ids of the table already on the device


@dataclass(slots=True)
class DecodeRow:
    """What the input batch needs of one decoding sequence (ids and counts); a value, not
    frozen for the same reason as SeqInput (one per row per step)."""

    token_id: int
    position: int  # = number of tokens already in the cache
    block_table: Sequence[int]
    seq_id: int | None = None  # None: no identity, the row is rewritten every step
    table_epoch: int = 0


class TableRows:
    """Block tables kept on the device, [R, max_blocks], updated by diffs.

    A row that held the same sequence (`seq_id`) under the same table epoch last time gets
    only the block ids past the ones it has; any other row is rewritten. `stage` collects a
    step's diffs, `upload` sends them as one [3, K] tensor (row, column, id) and one scatter.
    """

    def __init__(
        self, rows: int, max_blocks: int, device: torch.device, index_dtype: torch.dtype
    ) -> None:
        self.max_blocks = max_blocks
        self.device = device
        self.tables = torch.zeros((rows, max_blocks), dtype=index_dtype, device=device)
        self._rows: list[_Row | None] = [None] * rows
        self._diff: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.uploaded_block_ids = 0  # counts diffs sent (tests and benchmarks read it)

    def stage(self, i: int, table: Sequence[int], seq_id: int | None, epoch: int) -> None:
        have = self._rows[i]
        start = 0
        if (
            have is not None
            and seq_id is not None
            and have.seq_id == seq_id
            and have.epoch == epoch
            and have.num_blocks <= len(table)
        ):
            start = have.num_blocks
            if start == len(table):  # the usual decode step: nothing new, nothing to record
                return
        new = table[start:]
        if new:
            rows, cols, vals = self._diff
            rows.extend([i] * len(new))
            cols.extend(range(start, len(table)))
            vals.extend(new)
        self._rows[i] = None if seq_id is None else _Row(seq_id, epoch, len(table))

    def forget(self, i: int) -> None:
        """Row i holds no tracked sequence (padding: its table is never read)."""
        self._rows[i] = None

    def upload(self) -> None:
        rows, cols, vals = self._diff
        if vals:
            # pinned: a pageable copy would wait for every queued kernel (the step before,
            # still running when this one is launched ahead)
            diff = upload(host_ints([rows, cols, vals]), self.device)
            self.tables[diff[0], diff[1]] = diff[2].to(self.tables.dtype)
            self.uploaded_block_ids += len(vals)
        self._diff = ([], [], [])


def stage_decode_rows(
    rows: Sequence[DecodeRow], table_rows: TableRows, block_size: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(ids, positions, slots, context lengths) of decode rows 0..len(rows)-1, their block
    tables staged as diffs in `table_rows`."""
    ids, pos, slots, ctx = [], [], [], []
    for i, r in enumerate(rows):
        table = r.block_table
        if len(table) > table_rows.max_blocks:  # blocks past the context: unused (no copy
            table = table[: table_rows.max_blocks]  # of every table every step otherwise)
        ids.append(r.token_id)
        pos.append(r.position)
        slots.append(table[r.position // block_size] * block_size + r.position % block_size)
        ctx.append(r.position + 1)
        table_rows.stage(i, table, r.seq_id, r.table_epoch)
    return ids, pos, slots, ctx


class InputBatch:
    def __init__(
        self,
        layout: KVLayout,
        max_rows: int,
        max_blocks_per_seq: int,
        device: torch.device,
        index_dtype: torch.dtype,
        sliding_window: int | None,
    ) -> None:
        self.layout = layout
        self.max_rows = max_rows
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.sliding_window = sliding_window
        pin = device.type == "cuda"
        self.tokens = torch.zeros((4, max_rows), dtype=torch.int64, device=device)
        self._staging = [
            torch.zeros((4, max_rows), dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        self.table_rows = TableRows(max_rows, max_blocks_per_seq, device, index_dtype)
        self.context_lens = torch.zeros(max_rows, dtype=index_dtype, device=device)
        self.arange = torch.arange(max_rows, dtype=torch.int64, device=device)

    @property
    def tables(self) -> torch.Tensor:  # [R, max_blocks]
        return self.table_rows.tables

    @property
    def uploaded_block_ids(self) -> int:
        return self.table_rows.uploaded_block_ids

    def load(self, rows: Sequence[DecodeRow], bucket: int) -> int:
        """Put `rows` in rows [0, len(rows)), pad to `bucket`; returns the largest context."""
        n = len(rows)
        assert 0 < n <= bucket <= self.max_rows, (n, bucket, self.max_rows)
        bs = self.layout.block_size
        host = self._staging[self._flip]
        self._flip ^= 1
        ids, pos, slots, ctx = stage_decode_rows(rows, self.table_rows, bs)
        pad = bucket - n
        ids += [0] * pad
        pos += [0] * pad
        slots += [self.layout.scratch_slot] * pad
        ctx += [0] * pad
        # array + frombuffer: half the host time of torch.tensor() on four lists of ints
        flat = array("q", ids)
        for column in (pos, slots, ctx):
            flat.extend(column)
        host[:, :bucket].copy_(torch.frombuffer(flat, dtype=torch.int64).view(4, bucket))
        self.tokens[:, :bucket].copy_(host[:, :bucket], non_blocking=True)
        self.context_lens[:bucket].copy_(self.tokens[CONTEXT, :bucket])
        self.table_rows.upload()
        for i in range(n, bucket):
            self.table_rows.forget(i)  # padding rows' tables are never read (context 0)
        return max(ctx[:n])

    def feed(self, rows: list[int], sources: list[int], sampled: torch.Tensor) -> None:
        """Input ids of `rows` from a step's sampled ids on the device: row rows[j] gets
        sampled[sources[j]] (after `load`, whose upload wrote placeholders there)."""
        ids = self.tokens[IDS]
        m = len(rows)
        if rows[-1] == m - 1 and sources == rows:  # the steady case: the same rows in order
            ids[:m].copy_(sampled[:m])
            return
        index = upload(host_ints([rows, sources]), self.device)
        ids.index_copy_(0, index[0], sampled.index_select(0, index[1]))

    def metadata(
        self, bucket: int, max_context: int | None, width: int | None = None
    ) -> AttentionMetadata:
        """Decode metadata over rows [0, bucket) of the buffers and the first `width` block
        columns (default: enough for `max_context`, the step's largest context)."""
        bs = self.layout.block_size
        if width is None:
            assert max_context is not None
            width = -(-max_context // bs)
        rows = self.arange[:bucket]
        return AttentionMetadata(
            positions=self.tokens[POSITIONS, :bucket],
            slot_mapping=self.tokens[SLOTS, :bucket],
            block_tables=self.tables[:bucket, :width],
            context_lens=self.context_lens[:bucket],
            decode_rows=rows,
            decode_tokens=rows,
            max_decode_blocks=max(1, width),
            prefills=(),
            block_size=bs,
            sliding_window=self.sliding_window,
            query_start=None,
            max_query_len=1,
            decode_only=True,
        )

    @property
    def input_ids(self) -> torch.Tensor:  # [R] int64
        return self.tokens[IDS]
