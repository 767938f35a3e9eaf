"""How many prompt tokens a step may take next to decoders: a cap by work, not only tokens.

A prompt chunk's cost grows with its context: every chunk token runs the layer's GEMMs
(the same work at any position) and attends to all the keys before it (work that grows with
the position). In token-equivalents (one unit = one token's GEMMs), token p costs

    1 + (p + 1) / K        K = context_scale: keys whose attention costs one token's GEMMs

so a chunk of n tokens after `start` cached ones costs

    n + (n * start + n * (n + 1) / 2) / K

While other sequences decode, a step's prompt chunks share `budget` token-equivalents (on
top of `max_prefill_tokens`, which stays the token bound): a decoder's inter-token latency is
the step's length, and a 512-token chunk at a 16k context costs ~5x what it costs at 2k
(docs/BENCHMARKS.md, "Chunked prefill next to decoders"). A chunk is rounded down to one of
`chunk_sizes` (the runner's CUDA-graph chunk buckets) unless it is the prompt's last: a chunk
between two buckets would be padded up to the larger one and cost it (only a step's first
chunk: a step with several runs eagerly, unpadded; with `--graph-chunks` > 1 such a step
replays a graph too, its chunks' tokens padded together to one bucket, which this rounding
does not model).

On a compute-bound device the budget is also relative to the step's decode work
(`decode_ratio`, 0 = off): while D sequences decode at contexts c_i, the prompt work is at
most max(min_chunk, decode_ratio * decode_row * sum(1 + c_i / K)), so a mixed step costs at
most ~(1 + decode_ratio) x the decode step it joins. `decode_row` is what one decode row costs
in prompt token-equivalents on that device: on CPU a decode row reads its whole context's KV
for one query while a chunk's queries share it, and a 16-decoder step at 3k contexts took as
long as ~8.5 modelled units per row (bench/prefill_cap.py, docs/BENCHMARKS.md). Off by
default on every device (RATIO_DEFAULTS says why); the scheduler asks `step_budget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Defaults per device type: (context_scale K, budget). CUDA: fitted to the H200 profile of
# random:llama3-8b bf16 next to 8 decoders (a ~6 ms decode step; a 256 chunk 11.8 ms at a 2k
# context, 19.1 ms at 16k; a 512 chunk ~16 ms at 2k, ~28 ms at 16k). 640: 512-token chunks up
# to a ~0.8k context, 256 up to ~6k, 128 up to ~16k. The H200's bench/sched.py part 2 (16k
# prompt next to 8 decoders, session 21, docs/BENCHMARKS.md) put the decoders' ITL p99 during
# the prefill at 3.6x their p50 before with 896, 2.8x and 2.9x with 640 (long-prompt TTFT
# 1.10x), 2.5x twice with 448 (TTFT 1.54x): 640 is the largest measured cap within issue 10's
# 3x. An agent's new turn (a few hundred tokens) stays one chunk up to a ~6k context.
# CPU: the demo model on 2 cores (bench/prefill_cap.py, docs/BENCHMARKS.md: a 256-token
# chunk's CPU time grows 1.8x from a 256 to a 4k context, 3x to 12k, K ~ 4k as on the H200);
# the budget keeps the 64-token cap up to a ~2.9k context (512 / 896, CUDA's earlier cap:
# measured, not better at full size, docs/BENCHMARKS.md "CPU prefill next to 16 decoders").
# MPS: the CPU's scaled to its 128 cap.
DEFAULTS: dict[str, tuple[int, int]] = {
    "cuda": (4096, 640),
    "cpu": (4096, 112),
    "mps": (4096, 224),
}
# Per device type: (decode_ratio, decode_row). decode_row on CPU: 8, from bench/prefill_cap.py
# (16 decoders at 3k contexts: a 403 ms decode step, 27.7 modelled units; a 64-token chunk,
# 110 units, adds 187 ms). The ratio is off by default everywhere: on CPU, measured on the
# 16-agent workload (docs/BENCHMARKS.md, "CPU prefill next to 16 decoders"), 0.5
# did not lower the ITL (the 16-row decode step itself is most of it) and starved prompts
# whenever few sequences decoded while many waited (resumed TTFT 10x, tok/s -26%). CUDA: a
# chunk of hundreds of tokens costs a decode step little; the absolute budget is the bound.
RATIO_DEFAULTS: dict[str, tuple[float, float]] = {
    "cuda": (0.0, 1.0),
    "cpu": (0.0, 8.0),
    "mps": (0.0, 1.0),
}


@dataclass(frozen=True)
class PrefillCost:
    context_scale: int  # K: keys per chunk token that cost as much as its GEMMs
    budget: int  # token-equivalents of prompt work per step while others decode
    chunk_sizes: tuple[int, ...] = ()  # sizes that run unpadded, ascending; () = any
    min_chunk: int = 16  # a step's first chunk takes at least this much (progress)
    decode_ratio: float = 0.0  # prompt work <= this x the decoders' work; 0: no relative cap
    decode_row: float = 1.0  # one decode row's cost in prompt token-equivalents (device)

    def __post_init__(self) -> None:
        if self.context_scale < 1 or self.budget < 1:
            raise ValueError("prefill cost scale and budget must be >= 1")
        if self.decode_ratio < 0 or self.decode_row <= 0:
            raise ValueError("decode_ratio must be >= 0 and decode_row > 0")
        assert list(self.chunk_sizes) == sorted(self.chunk_sizes), self.chunk_sizes

    def step_budget(self, decoder_contexts: list[int]) -> float:
        """Prompt work for a step next to decoders whose KV holds these many tokens: the
        absolute budget, lowered to decode_ratio x their work (not below min_chunk's cost at
        no context: chunk() still lets a first chunk of min_chunk through at any context)."""
        if not self.decode_ratio or not decoder_contexts:
            return float(self.budget)
        work = self.decode_row * sum(self.cost(c, 1) for c in decoder_contexts)
        return min(float(self.budget), max(self.cost(0, self.min_chunk), self.decode_ratio * work))

    def cost(self, start: int, n: int) -> float:
        """Token-equivalents of tokens [start, start + n) of a prompt."""
        return n + (n * start + n * (n + 1) / 2) / self.context_scale

    def fit(self, start: int, work: float) -> int:
        """The most tokens after `start` whose cost is <= work (solves the quadratic)."""
        if work <= 0:
            return 0
        k = self.context_scale
        b = 1 + (start + 0.5) / k  # cost(n) = n * b + n^2 / (2K)
        n = int(k * (math.sqrt(b * b + 2 * work / k) - b))
        while n > 0 and self.cost(start, n) > work:  # float rounding at the boundary
            n -= 1
        return n

    def chunk(self, start: int, pending: int, work: float, first: bool) -> int:
        """Prompt tokens to take after `start` (of `pending`, already within the token
        budgets) with `work` token-equivalents left. `first`: no other chunk in the step yet;
        it is rounded down to a chunk size and takes at least min_chunk (the smallest size)
        so that a prompt at a huge context still advances. A later chunk takes what fits, as
        it is: a step of several chunks runs eagerly, unpadded."""
        n = self.fit(start, work)
        if n >= pending:
            return pending
        if not first:
            return n
        sizes = [s for s in self.chunk_sizes if s <= n]
        if sizes:
            n = sizes[-1]
        floor = min(pending, max(self.min_chunk, self.chunk_sizes[0] if self.chunk_sizes else 0))
        return max(n, floor)
