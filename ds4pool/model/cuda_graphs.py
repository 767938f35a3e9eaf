"""CUDA graphs of the decode forward, one per (batch-size bucket, table-width bucket).

A decode step of B sequences whose longest context spans W blocks runs the graph of the
smallest batch bucket >= B and width bucket >= W: the whole model forward plus the LM
head, reading the input batch's persistent buffers (ids, positions, slots, context
lengths, block tables [:, :width]) and writing logits into one static buffer. Rows
[B, bucket) are padding (see input_batch.py). The width bucket bounds the decode kernel's
grid (its split-K partitions follow the table width), so short contexts do not pay for
the model's maximum. Replaying a graph costs one launch instead of ~15 kernels × layers
of Python dispatch; prompt chunks and mixed steps run eagerly.

Graphs are captured on first use of their shape (tens of ms each) and share one memory
pool: their temporaries are dead after each replay and their output is copied into the
static logits buffer, which lives outside the pool, so any replay order is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ds4pool.model.input_batch import InputBatch

log = logging.getLogger(__name__)


def width_buckets(max_blocks: int) -> list[int]:
    """Table widths 64, 256, 1024, ... blocks (×4), capped by the model's maximum."""
    widths, w = [], 64
    while w < max_blocks:
        widths.append(w)
        w *= 4
    return [*widths, max_blocks]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (padding costs at most 7 rows past 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: Sequence[torch.Tensor],
        batch: InputBatch,
        buckets: Sequence[int],
        vocab_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch = batch
        self.buckets = sorted(buckets)
        self.widths = width_buckets(batch.max_blocks)
        assert self.buckets and self.buckets[-1] <= batch.max_rows
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None
        self._logits = torch.empty((batch.max_rows, vocab_size), dtype=dtype, device=batch.device)
        self.captures = 0

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def width_for(self, max_context: int) -> int:
        blocks = -(-max_context // self.batch.layout.block_size)
        return next(w for w in self.widths if w >= blocks)

    def _forward(self, bucket: int, width: int) -> None:
        meta = self.batch.metadata(bucket, None, width)
        hidden = self.model(self.batch.input_ids[:bucket], self.kv_caches, meta)
        self._logits[:bucket].copy_(self.model.compute_logits(hidden))  # [bucket, V]

    def _capture(self, bucket: int, width: int) -> torch.cuda.CUDAGraph:
        # The buffers hold this step's real inputs; warm-up and capture run the forward on
        # them twice more, which rewrites the same K/V at the same slots (idempotent).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket, width)  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(bucket, width)
        self._pool = graph.pool()
        self.captures += 1
        log.debug("captured a decode CUDA graph: batch %d, width %d blocks", bucket, width)
        return graph

    def replay(self, bucket: int, max_context: int) -> torch.Tensor:
        """Run the graph of (bucket, width for max_context) over the current buffers;
        logits [bucket, V] (static: valid until the next replay)."""
        key = (bucket, self.width_for(max_context))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(*key)
        graph.replay()
        return self._logits[:bucket]
