"""CUDA graphs of step forwards: decode steps per (batch-size bucket, table-width bucket),
mixed steps (decodes + one prompt chunk) per (batch bucket, chunk bucket, width bucket).

A decode step of B sequences whose longest context spans W blocks runs the graph of the
smallest batch bucket >= B and width bucket >= W: the whole model forward plus the LM
head, reading the input batch's persistent buffers (ids, positions, slots, context
lengths, block tables [:, :width]) and writing logits into one static buffer. Rows
[B, bucket) are padding (see input_batch.py). The width bucket bounds the decode kernel's
grid (its split-K partitions follow the table width), so short contexts do not pay for
the model's maximum. Replaying a graph costs one launch instead of ~15 kernels × layers
of Python dispatch (15-30 ms per step for an 8B model on the H200's host).

A mixed step of B decodes and one chunk of C <= max_chunk prompt tokens runs the graph of
(bucket >= B, chunk bucket >= C, width) over `MixedBatch`'s buffers (see mixed_batch.py):
the same forward over Bb + Cb tokens with the prefill kernel's split-K factor fixed by the
shape, and the LM head over the Bb + 1 rows it lists. Steps with several chunks, or a chunk
past max_chunk, run eagerly.

Graphs are captured on first use of their shape (tens of ms each) and share one memory
pool: their temporaries are dead after each replay and their output is copied into the
static logits buffer, which lives outside the pool, so any replay order is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ds4pool.model.input_batch import InputBatch
from ds4pool.model.mixed_batch import MixedBatch, MixedShape, chunk_buckets

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


class StepGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: Sequence[torch.Tensor],
        batch: InputBatch,
        buckets: Sequence[int],
        vocab_size: int,
        dtype: torch.dtype,
        mixed: MixedBatch | None = None,
        mixed_partitions: Callable[[int, int], int] | None = None,
    ) -> None:
        """`mixed_partitions(chunk_bucket, width_tokens)`: the prefill kernel's fixed split-K
        factor for a mixed shape (from the attention backend)."""
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch = batch
        self.buckets = sorted(buckets)
        self.widths = width_buckets(batch.max_blocks)
        assert self.buckets and self.buckets[-1] <= batch.max_rows
        self.mixed = mixed
        self.mixed_partitions = mixed_partitions
        self.chunks = chunk_buckets(mixed.max_chunk) if mixed is not None else []
        self._graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None
        rows = batch.max_rows + (1 if mixed is not None else 0)
        self._logits = torch.empty((rows, vocab_size), dtype=dtype, device=batch.device)
        self.captures = 0

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def mixed_shape(self, decodes: int, chunk: int) -> MixedShape | None:
        """The padded shape of a step of `decodes` decodes and one `chunk`-token chunk, or
        None if it has no graph (no mixed batch, or the chunk is too long)."""
        if self.mixed is None or chunk > self.mixed.max_chunk or decodes > self.mixed.max_rows:
            return None
        bucket = self.bucket_for(max(decodes, 1))
        if bucket is None:
            return None
        return MixedShape(bucket, next(c for c in self.chunks if c >= chunk))

    def width_for(self, max_context: int) -> int:
        blocks = -(-max_context // self.batch.layout.block_size)
        return next(w for w in self.widths if w >= blocks)

    def _forward(self, bucket: int, width: int) -> None:
        meta = self.batch.metadata(bucket, None, width)
        hidden = self.model(self.batch.input_ids[:bucket], self.kv_caches, meta)
        self._logits[:bucket].copy_(self.model.compute_logits(hidden))  # [bucket, V]

    def _forward_mixed(self, shape: MixedShape, width: int) -> None:
        mixed, parts = self.mixed, self.mixed_partitions
        assert mixed is not None and parts is not None
        bs = self.batch.layout.block_size
        meta = mixed.metadata(shape, width, parts(shape.chunk_bucket, width * bs))
        hidden = self.model(mixed.input_ids[: shape.num_tokens], self.kv_caches, meta)
        rows = mixed.logit_rows(shape)
        self._logits[: shape.bucket + 1].copy_(self.model.compute_logits(hidden[rows]))

    def _capture(self, forward: Callable[[], None], what: str) -> torch.cuda.CUDAGraph:
        # The buffers hold this step's real inputs; warm-up and capture run the forward on
        # them twice more, which rewrites the same K/V at the same slots (idempotent).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            forward()
        self._pool = graph.pool()
        self.captures += 1
        log.debug("captured a CUDA graph: %s", what)
        return graph

    def replay(self, bucket: int, max_context: int) -> torch.Tensor:
        """Run the decode graph of (bucket, width for max_context) over the current buffers;
        logits [bucket, V] (static: valid until the next replay)."""
        width = self.width_for(max_context)
        key = (bucket, width)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(
                lambda: self._forward(bucket, width), f"decode batch {bucket}, width {width}"
            )
        graph.replay()
        return self._logits[:bucket]

    def replay_mixed(self, shape: MixedShape, max_context: int) -> torch.Tensor:
        """Run the mixed graph of (shape, width for max_context) over the mixed batch's
        buffers; logits [bucket + 1, V], row j = the j-th sampled row the batch was loaded
        with (static: valid until the next replay)."""
        width = self.width_for(max_context)
        key = (shape.bucket, shape.chunk_bucket, width)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(
                lambda: self._forward_mixed(shape, width),
                f"mixed batch {shape.bucket} + chunk {shape.chunk_bucket}, width {width}",
            )
        graph.replay()
        return self._logits[: shape.bucket + 1]
