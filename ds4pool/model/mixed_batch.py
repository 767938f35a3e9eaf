"""The persistent input batch of mixed steps: decode rows plus one to K prompt chunks,
padded to a (decode bucket, chunk-token bucket) shape that a CUDA graph can be captured for.

A mixed step of B decoding sequences and k <= K chunks of C_1..C_k prompt tokens (C their
sum) is laid out on a flat token axis of Bb + Cb tokens (Bb, Cb: the buckets >= B, C) and
Bb + K + 1 sequences:

    tokens [0, Bb)            decode rows: row j is the j-th decoding sequence (one token);
                              rows [B, Bb) are padding (context 0, nothing attended)
    tokens [Bb, Bb + C)       the chunks back to back: chunk i is sequence Bb + i, positions
                              [n_i, n_i + C_i) after its n_i cached tokens; sequences
                              Bb + k .. Bb + K - 1 are empty chunk rows (no token, context 0)
    tokens [Bb + C, Bb + Cb)  padding: sequence Bb + K with context 0

K is fixed when the batch is made (`max_chunks`; 1: the one-chunk layout), so a graph
captured with one chunk replays any step of up to K chunks of its shape: the kernels' grids
depend on the sequence count and the buckets only, and an empty chunk row's programs exit at
once. Padding tokens are id 0 at position 0 and write their K/V to the layout's scratch slot;
sequences with context 0 see no key, so attention writes zeros for them and nothing real
reads their rows. `logit_rows` [Bb + K] lists the token indices whose logits the step needs,
in the order of the step's sampled sequences (the rest point at token 0), so the LM head
runs on a fixed number of rows and logits[:R] are the R sampled rows in order.

Buffers (all device, written from one pinned staging copy per step, plus block-table diffs):

    tok  [4, T]  int64: ids, positions, slots, logit_rows (first Bb + K entries)
    seqs [2, S + 1] index dtype: context lengths (first Bb + K + 1), query starts (+1)
    tables [S, max_blocks]: `TableRows` (diff upload keyed by seq_id and table epoch)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.device import host_ints
from ds4pool.model.input_batch import DecodeRow, TableRows, stage_decode_rows
from ds4pool.model.kv_layout import KVLayout

IDS, POSITIONS, SLOTS, LOGIT_ROWS = range(4)
CONTEXT, QUERY_START = range(2)


@dataclass(frozen=True)
class ChunkRow:
    """One of the step's prompt chunks: token ids after `num_computed` cached tokens."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    seq_id: int | None = None
    table_epoch: int = 0


@dataclass(frozen=True)
class MixedShape:
    bucket: int  # decode rows, padded
    chunk_bucket: int  # the chunks' tokens together, padded

    @property
    def num_tokens(self) -> int:
        return self.bucket + self.chunk_bucket


class MixedBatch:
    def __init__(
        self,
        layout: KVLayout,
        max_rows: int,
        max_chunk: int,
        max_blocks_per_seq: int,
        device: torch.device,
        index_dtype: torch.dtype,
        sliding_window: int | None,
        max_chunks: int = 1,
    ) -> None:
        """`max_chunk`: the most prompt tokens of a step (all its chunks); `max_chunks`: the
        most chunks (K above)."""
        assert max_chunks >= 1, max_chunks
        self.layout = layout
        self.max_rows = max_rows
        self.max_chunk = max_chunk
        self.max_chunks = max_chunks
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.sliding_window = sliding_window
        tokens, seqs = max_rows + max_chunk, max_rows + max_chunks + 1
        pin = device.type == "cuda"
        self.tok = torch.zeros((4, tokens), dtype=torch.int64, device=device)
        self._tok_host = torch.zeros((4, tokens), dtype=torch.int64, pin_memory=pin)
        self.seqs = torch.zeros((2, seqs + 1), dtype=index_dtype, device=device)
        self._seqs_host = torch.zeros((2, seqs + 1), dtype=index_dtype, pin_memory=pin)
        self.table_rows = TableRows(seqs, max_blocks_per_seq, device, index_dtype)

    def num_seqs(self, shape: MixedShape) -> int:
        return shape.bucket + self.max_chunks + 1

    def load(
        self,
        decodes: Sequence[DecodeRow],
        chunks: Sequence[ChunkRow],
        sampled: Sequence[int],
        shape: MixedShape,
    ) -> int:
        """Fill the buffers for `shape`; returns the step's largest context.

        `sampled` lists, in order, which rows need logits: j < len(decodes) is decode row j,
        j == len(decodes) + i is chunk i's last token."""
        b, k = len(decodes), len(chunks)
        c = sum(len(ch.token_ids) for ch in chunks)
        bb, cb, kk = shape.bucket, shape.chunk_bucket, self.max_chunks
        assert 0 <= b <= bb <= self.max_rows and 0 < c <= cb <= self.max_chunk, (b, bb, c, cb)
        assert 0 < k <= kk and len(sampled) <= bb + kk, (k, kk, len(sampled))
        bs, scratch = self.layout.block_size, self.layout.scratch_slot
        ids, pos, slots, ctx = stage_decode_rows(decodes, self.table_rows, bs)
        for j in range(b, bb):
            self.table_rows.forget(j)
        ids += [0] * (bb - b)
        pos += [0] * (bb - b)
        slots += [scratch] * (bb - b)
        ctx += [0] * (bb - b)
        starts = list(range(bb + 1))
        lasts = []  # token index of each chunk's last token
        for i, chunk in enumerate(chunks):
            table = chunk.block_table[: self.max_blocks]
            start, n = chunk.num_computed, len(chunk.token_ids)
            ids += list(chunk.token_ids)
            pos += list(range(start, start + n))
            slots += self.layout.slots(table, start, start + n)
            ctx.append(start + n)
            self.table_rows.stage(bb + i, table, chunk.seq_id, chunk.table_epoch)
            starts.append(starts[-1] + n)
            lasts.append(starts[-1] - 1)
        ctx += [0] * (kk - k)  # the empty chunk rows: no token, no context
        starts += [starts[-1]] * (kk - k)
        for i in range(k, kk + 1):  # and the padding sequence's
            self.table_rows.forget(bb + i)
        pad = cb - c
        ids += [0] * pad
        pos += [0] * pad
        slots += [scratch] * pad
        ctx.append(0)
        t = bb + cb
        starts.append(t)
        rows = [j if j < b else lasts[j - b] for j in sampled]
        rows += [0] * (t - len(rows))
        self._tok_host[:, :t] = host_ints([ids, pos, slots, rows])
        self.tok[:, :t].copy_(self._tok_host[:, :t], non_blocking=True)
        n_seqs = self.num_seqs(shape)
        self._seqs_host[CONTEXT, :n_seqs] = host_ints(ctx, self.seqs.dtype)
        self._seqs_host[QUERY_START, : n_seqs + 1] = host_ints(starts, self.seqs.dtype)
        self.seqs[:, : n_seqs + 1].copy_(self._seqs_host[:, : n_seqs + 1], non_blocking=True)
        self.table_rows.upload()
        return max(ctx)

    def metadata(self, shape: MixedShape, width: int, partitions: int) -> AttentionMetadata:
        """Metadata over the buffers for `shape` and the first `width` block columns; the
        prefill kernel's split-K factor is fixed (`partitions`), as a captured graph needs."""
        t, s = shape.num_tokens, self.num_seqs(shape)
        empty = self.tok[IDS, :0]
        return AttentionMetadata(
            positions=self.tok[POSITIONS, :t],
            slot_mapping=self.tok[SLOTS, :t],
            block_tables=self.table_rows.tables[:s, :width],
            context_lens=self.seqs[CONTEXT, :s],
            decode_rows=empty,
            decode_tokens=empty,
            max_decode_blocks=max(1, width),
            prefills=(),
            block_size=self.layout.block_size,
            sliding_window=self.sliding_window,
            query_start=self.seqs[QUERY_START, : s + 1],
            max_query_len=shape.chunk_bucket,
            decode_only=False,
            prefill_partitions=partitions,
            lead_decode_rows=shape.bucket,
        )

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tok[IDS]

    def logit_rows(self, shape: MixedShape) -> torch.Tensor:  # [Bb + K] int64
        return self.tok[LOGIT_ROWS, : shape.bucket + self.max_chunks]


FINE_STEP = 256  # several-chunk graphs: buckets every this many tokens past 512


def chunk_buckets(max_chunk: int, several: bool = False) -> list[int]:
    """Chunk sizes 32, 64, 128, ... (×2) up to max_chunk (padding costs < 2× the chunk).
    `several` (graphs of several chunks): every FINE_STEP tokens past 512 instead, since the
    scheduler rounds only a step's first chunk to a bucket and the chunks' total would
    otherwise pad up to ~2x (5 agents' turns of ~243 tokens: 1,215 → 2,048; now → 1,280)."""
    sizes, c = [], 32
    while c < max_chunk:
        sizes.append(c)
        c = c + FINE_STEP if several and c >= 512 else c * 2
    return [*sizes, max_chunk]
