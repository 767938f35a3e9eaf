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

When graphs are captured (`mode`):
- "lazy": on first use of a shape, over that step's real inputs (the forward runs twice
  more: tens of ms, seconds for a first Triton compile, in the middle of a request);
- "ahead": `capture_ahead` captures the plan (`plan()`: every decode and mixed key the
  configuration can reach, widths up to the pool's capacity) at start-up, over dummy inputs
  whose every row writes only the layout's scratch block; what a time bound leaves out, and
  any key a step misses, is captured by `capture_pending` between steps when the worker is
  idle, and a step that misses runs eagerly meanwhile (no capture inside a step).
All graphs share one memory pool: their temporaries are dead after each replay and their
output is copied into the static logits buffer, which lives outside the pool, so any replay
order is safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ds4pool.model.input_batch import DecodeRow, InputBatch
from ds4pool.model.mixed_batch import ChunkRow, MixedBatch, MixedShape, chunk_buckets

log = logging.getLogger(__name__)

MODES = ("eager", "lazy", "ahead")


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured shape. Ordered as `plan()` captures: narrow tables first (short contexts
    are the common case), decode before mixed, then by chunk and batch bucket."""

    width: int  # table-width bucket, blocks
    chunk: int  # chunk bucket of a mixed step; 0: decode-only
    bucket: int  # decode rows, padded

    @property
    def mixed(self) -> bool:
        return self.chunk > 0


@dataclass(frozen=True)
class CaptureReport:
    captured: int  # graphs captured by this call
    seconds: float
    graph_bytes: int  # device memory the graphs' pool grew by (reserved)
    pending: int  # keys of the plan left for idle-time capture


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
        mode: str = "lazy",
        max_gather_tokens: int | None = None,
    ) -> None:
        """`mixed_partitions(chunk_bucket, width_tokens)`: the prefill kernel's fixed split-K
        factor for a mixed shape (from the attention backend). `mode`: "lazy" or "ahead".
        `max_gather_tokens`: no graph for a key whose bucket x width (tokens) exceeds it
        (a backend whose decode gathers the padded context; its step runs eagerly)."""
        assert mode in ("lazy", "ahead"), mode
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch = batch
        self.mode = mode
        self.buckets = sorted(buckets)
        self.widths = width_buckets(batch.max_blocks)
        assert self.buckets and self.buckets[-1] <= batch.max_rows
        self.mixed = mixed
        self.mixed_partitions = mixed_partitions
        self.max_gather_tokens = max_gather_tokens
        self.chunks = (
            chunk_buckets(mixed.max_chunk, mixed.max_chunks > 1) if mixed is not None else []
        )
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._pending: dict[GraphKey, None] = {}  # ordered set: misses first, then the plan
        self._pool: tuple[int, int] | None = None
        rows = batch.max_rows + (mixed.max_chunks if mixed is not None else 0)
        self._logits = torch.empty((rows, vocab_size), dtype=dtype, device=batch.device)
        self.captures = 0
        self.eager_misses = 0  # steps run eagerly because their graph was not captured yet

    @property
    def keys(self) -> list[GraphKey]:
        return sorted(self._graphs)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def mixed_shape(self, decodes: int, chunk: int, chunks: int = 1) -> MixedShape | None:
        """The padded shape of a step of `decodes` decodes and `chunks` prompt chunks of
        `chunk` tokens together, or None if it has no graph (no mixed batch, more chunks or
        tokens than it holds)."""
        mixed = self.mixed
        if mixed is None or chunk > mixed.max_chunk or decodes > mixed.max_rows:
            return None
        if chunks > mixed.max_chunks:
            return None
        bucket = self.bucket_for(max(decodes, 1))
        if bucket is None:
            return None
        return MixedShape(bucket, next(c for c in self.chunks if c >= chunk))

    def width_for(self, max_context: int) -> int:
        blocks = -(-max_context // self.batch.layout.block_size)
        return next(w for w in self.widths if w >= blocks)

    def decode_key(self, bucket: int, max_context: int) -> GraphKey:
        return GraphKey(self.width_for(max_context), 0, bucket)

    def mixed_key(self, shape: MixedShape, max_context: int) -> GraphKey:
        return GraphKey(self.width_for(max_context), shape.chunk_bucket, shape.bucket)

    def graphable(self, key: GraphKey) -> bool:
        limit = self.max_gather_tokens
        return limit is None or key.bucket * key.width * self.batch.layout.block_size <= limit

    def ready(self, key: GraphKey) -> bool:
        """Whether a step of this key replays a graph now. Lazy: always (captured on the
        spot). Ahead: only once captured; a miss is queued for `capture_pending`. Never for
        a key past `max_gather_tokens`."""
        if not self.graphable(key):
            return False
        if self.mode == "lazy" or key in self._graphs:
            return True
        self._pending.pop(key, None)
        self._pending = {key: None, **self._pending}  # misses go first
        self.eager_misses += 1
        return False

    def plan(self) -> list[GraphKey]:
        """Every key a step can reach: batch buckets x (decode, chunk buckets) x the width
        buckets a sequence fits in (a context never exceeds the pool's blocks)."""
        pool_blocks = self.batch.layout.num_blocks
        widths = []
        for w in self.widths:
            widths.append(w)
            if w >= pool_blocks:
                break
        chunks = [0, *self.chunks]
        keys = (GraphKey(w, c, b) for w in widths for c in chunks for b in self.buckets)
        return sorted(k for k in keys if self.graphable(k))

    def capture_ahead(self, max_seconds: float) -> CaptureReport:
        """Capture the plan's keys (not captured yet) over dummy inputs, in plan order, until
        `max_seconds` have passed; the rest is queued for `capture_pending`."""
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.batch.device)
        todo = [k for k in self.plan() if k not in self._graphs]
        done = 0
        for key in todo:
            if time.perf_counter() - t0 > max_seconds:
                break
            self._capture_dummy(key)
            done += 1
        for key in todo[done:]:
            self._pending[key] = None
        grown = torch.cuda.memory_reserved(self.batch.device) - reserved
        report = CaptureReport(done, time.perf_counter() - t0, grown, len(self._pending))
        log.info(
            "captured %d CUDA graphs ahead of use in %.1f s (%.0f MiB of graph memory); "
            "%d left for idle time",
            report.captured,
            report.seconds,
            report.graph_bytes / 2**20,
            report.pending,
        )
        return report

    def capture_pending(self) -> bool:
        """Capture one queued key (a step's miss first); True while keys remain. Called
        between steps with no work waiting: it delays a request that arrives meanwhile by one
        capture (tens of ms) at most, never a step."""
        if self._pending:
            key = next(iter(self._pending))
            del self._pending[key]
            if key not in self._graphs:
                self._capture_dummy(key)
        return bool(self._pending)

    def _capture_dummy(self, key: GraphKey) -> None:
        """Load inputs that touch only the scratch block, then capture `key` over them."""
        self.load_dummy(key)
        if key.mixed:
            shape = MixedShape(key.bucket, key.chunk)
            forward = lambda: self._forward_mixed(shape, key.width)  # noqa: E731
        else:
            forward = lambda: self._forward(key.bucket, key.width)  # noqa: E731
        self._graphs[key] = self._capture(forward, key)
        # the loads' pinned staging buffers are rewritten by the next load
        torch.cuda.synchronize(self.batch.device)

    def load_dummy(self, key: GraphKey) -> None:
        """Fill the buffers of `key` with rows that read and write only the scratch block:
        every decode row at position 0 and every chunk token at positions [0, chunk) of a
        table that lists only the scratch block (slots in it), no sequence identity (the next
        real step rewrites these rows' tables whole)."""
        layout = self.batch.layout
        scratch = layout.num_blocks  # block id of the scratch block
        rows = [DecodeRow(0, 0, [scratch]) for _ in range(key.bucket)]
        if not key.mixed:
            self.batch.load(rows, key.bucket)
            return
        assert self.mixed is not None
        blocks = -(-key.chunk // layout.block_size)
        chunk = ChunkRow([0] * key.chunk, 0, [scratch] * blocks)
        shape = MixedShape(key.bucket, key.chunk)
        self.mixed.load(rows, [chunk], list(range(key.bucket + 1)), shape)

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
        self._logits[: rows.shape[0]].copy_(self.model.compute_logits(hidden[rows]))

    def _capture(self, forward: Callable[[], None], key: GraphKey) -> torch.cuda.CUDAGraph:
        # The buffers hold this step's real inputs (lazy) or dummy ones (ahead); warm-up and
        # capture run the forward on them, which rewrites the same K/V at the same slots
        # (idempotent for real inputs; only the scratch block for dummy ones).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the pool's threads (persistence, prefetch) may copy KV while an idle-time
        # capture runs; only this thread's calls must keep off the capturing stream
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            forward()
        self._pool = graph.pool()
        self.captures += 1
        log.debug("captured a CUDA graph: %s", key)
        return graph

    def replay(self, bucket: int, max_context: int) -> torch.Tensor:
        """Run the decode graph of (bucket, width for max_context) over the current buffers
        (captured now if lazy); logits [bucket, V] (static: valid until the next replay)."""
        key = self.decode_key(bucket, max_context)
        graph = self._graphs.get(key)
        if graph is None:
            assert self.mode == "lazy", key
            graph = self._graphs[key] = self._capture(lambda: self._forward(bucket, key.width), key)
        graph.replay()
        return self._logits[:bucket]

    def replay_mixed(self, shape: MixedShape, max_context: int) -> torch.Tensor:
        """Run the mixed graph of (shape, width for max_context) over the mixed batch's
        buffers; logits [bucket + K, V], row j = the j-th sampled row the batch was loaded
        with (static: valid until the next replay)."""
        key = self.mixed_key(shape, max_context)
        graph = self._graphs.get(key)
        if graph is None:
            assert self.mode == "lazy", key
            graph = self._graphs[key] = self._capture(
                lambda: self._forward_mixed(shape, key.width), key
            )
        graph.replay()
        assert self.mixed is not None
        return self._logits[: shape.bucket + self.mixed.max_chunks]
