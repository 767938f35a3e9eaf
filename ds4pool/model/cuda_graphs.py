"""CUDA graphs of the decode forward, one per batch-size bucket.

A decode step of B sequences runs the graph of the smallest bucket >= B: the whole model
forward plus the LM head, reading the input batch's persistent buffers (ids, positions,
slots, context lengths, block tables) and writing logits into a static buffer. Rows
[B, bucket) are padding (see input_batch.py). Replaying a graph costs one launch instead
of ~15 kernels × layers of Python dispatch; prompt chunks and mixed steps run eagerly.

All graphs share one memory pool; they are captured largest first so smaller ones reuse
its blocks. Capture happens once, at start-up (a few seconds for an 8B model).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ds4pool.model.input_batch import InputBatch

log = logging.getLogger(__name__)


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
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch = batch
        self.buckets = sorted(buckets)
        assert self.buckets and self.buckets[-1] <= batch.max_rows
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = self.batch.metadata(bucket, None)
        hidden = self.model(self.batch.input_ids[:bucket], self.kv_caches, meta)
        return self.model.compute_logits(hidden)  # [bucket, V]

    @torch.inference_mode()
    def capture(self) -> None:
        # Padding inputs everywhere: every row writes the scratch slot, context 0.
        rows = self.batch.max_rows
        self.batch.tokens.zero_()
        self.batch.tokens[2].fill_(self.batch.layout.scratch_slot)
        self.batch.context_lens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._forward(min(rows, self.buckets[-1]))
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of `bucket` over the current buffers; logits [bucket, V] (static:
        valid until the next replay)."""
        self._graphs[bucket].replay()
        return self._logits[bucket]
