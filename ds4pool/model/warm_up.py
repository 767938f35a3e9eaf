"""Eager-step warm-up: the kernel variants of steps that run without a CUDA graph, compiled
at start-up rather than inside a step while agents wait.

Triton compiles a kernel once per specialisation of its launch: the constexprs (tile rows
picked from the step's longest query, SPLIT where a short query meets a long context, a
decode launch's num_stages by batch and table width) and, for plain int and pointer
arguments, whether a value is 1 or divisible by 16 and whether a pointer is 16-byte aligned.
The graphs captured ahead (model/cuda_graphs.py) compile what decode steps and single-chunk
mixed steps use. A step that runs eagerly (several prompt chunks, a chunk longer than the
graphs', a shape whose graph is not captured yet) can need a variant no graph had, and its
first compile then lands inside that step: run L (docs/BENCHMARKS.md) had steps of 0.3 and
1.1-1.2 s where the same shape took 65 ms. Triton keeps compiled kernels on disk, so a
restart loads them (milliseconds); the first start on a machine compiles them here.

`eager_shapes` is a grid over what picks a variant, one step per class:
- the longest query of the step: 2, then 2^j + 1 tokens up to 129 (a tile's rows are the
  next power of two of query x group, capped at 128: these cross every such boundary for
  groups of 1 to 16 heads), and the longest chunk the scheduler sends;
- the context: none, then 1,024 tokens x 4^k up to the model's length (the decode kernel's
  launch table and the split-K rules change at 1,024 / 4,096 / 16,384 tokens; graph widths
  grow x4 the same way), and the model's length itself;
- decode rows beside the chunk: 0, 1, 3, 15 and the most a step may have, so that the rows
  sampled (the LM head's rows) are 1, 2, 4, 16 and the most: the skinny GEMM's row buckets
  (kernels/triton_linear_configs.py: 1, up to 4, up to 16) and past them; the split backend
  runs the decode rows through the decode kernel, whose launch depends on the batch.
Every row of these steps reads and writes only the KV layout's scratch block (its table lists
that block again and again), so no session's KV is touched, and a warm-up step needs no free
block. tests/unit/test_triton_variants.py replays serving-like eager steps after the warm-up
with Triton's own specialisation rule and fails on any variant the warm-up did not compile.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_QUERIES = (2, 3, 5, 9, 17, 33, 65, 129)  # 2, then 2^j + 1: every tile-rows boundary
DECODE_ROWS = (0, 1, 3, 15)  # beside the chunk: 1, 2, 4, 16 rows sampled
FIRST_LONG_CONTEXT = 1024  # the decode kernel's SHORT_CONTEXT; split-K starts there


@dataclass(frozen=True)
class WarmShape:
    """One warm-up step: a prompt chunk of `chunk` new tokens after `context` cached ones,
    and `decode_rows` rows of one token each at the same context."""

    chunk: int
    context: int
    decode_rows: int


@dataclass(frozen=True)
class WarmUpReport:
    steps: int  # warm-up steps run
    seconds: float
    left: int  # steps of the grid not run (the time bound)


def eager_shapes(max_len: int, max_chunk: int, max_rows: int) -> list[WarmShape]:
    """The grid above for a model of `max_len` positions, prompt chunks of up to `max_chunk`
    tokens and steps of up to `max_rows` rows; shortest work first."""
    chunks = sorted({q for q in TILE_QUERIES if q <= max_chunk} | {max(2, max_chunk)})
    chunks = [q for q in chunks if q < max_len]
    shapes = []
    for q in chunks:
        contexts, c = {0}, FIRST_LONG_CONTEXT
        while c + q <= max_len:
            contexts.add(c)
            c *= 4
        contexts.add(max_len - q)  # the widest table
        for context in sorted(contexts):
            for rows in sorted({r for r in DECODE_ROWS if r < max_rows} | {max_rows - 1}):
                shapes.append(WarmShape(q, context, rows))
    shapes.sort(key=lambda s: (s.chunk + s.decode_rows, s.context))
    return shapes
