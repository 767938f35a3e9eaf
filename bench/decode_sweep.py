"""The paged decode kernel's launch sweep, run by `python3 bench/attn_kernels.py --sweep`.

Llama-3-8B shapes (H=32, H_kv=8, D=128, bf16, blocks of 16 as the pool uses), batch 1 / 8 /
32 / 64 at contexts 160 / 1000 / 3072 / 8192, each over a block table as wide as the decode
graph's width bucket for it (model/cuda_graphs.width_buckets) and split as the backend splits
it (`decode_partition_size`, short rows by the launch's short_piece). A launch is timed as a
CUDA graph of n back-to-back decodes (its reduce included) over n distinct regions of one
cache, >= 200 MB of KV in all so the L2 cache holds none of it, as in a decode step where
the weights evict it between layers; the best of 3 timings of 5 replays, in µs a launch.

Rounds (kernels/triton_decode_configs.py lists the candidates): 1. every block_n x num_warps
on the short contexts (all rows <= SHORT_CONTEXT); 2. num_stages and short-row pieces for the
SWEEP_FINALISTS best (geometric mean over the short shapes); 3. the finalists' best and the
default under every num_stages on the long contexts. The table shares block_n, num_warps and
short_piece across all shapes (batched == solo, see the table's module), so the emitted table
is the candidate of the best geometric mean over all shapes, each shape at its best stages.
Every output is compared with the default launch's (rel. error < 1e-2, the bf16 tolerance of
attn_kernels' checks) and, on the short shapes, bit for bit (the "bits" column); the default
itself is compared with a float32 attention over the gathered context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from ds4pool.model.attention_triton import decode_partition_size
from ds4pool.model.cuda_graphs import width_buckets
from ds4pool.model.kernels import triton_attention as ta
from ds4pool.model.kernels import triton_decode_configs as tdc

H, H_KV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 64)
CONTEXTS = (160, 1000, 3072, 8192)
MAX_BLOCKS = 131072 // BS  # the table widths a 128k-token model's graphs use
REGION_BYTES = 200e6  # KV read per graph replay, well past the H200's 50 MB of L2
SWEEP_FINALISTS = 3
TOLERANCE = 1e-2


@dataclass
class Shape:
    batch: int
    context: int
    width: int  # table width, tokens
    tables: list[torch.Tensor]  # n x [batch, width // BS] int32: distinct blocks per region
    lens: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor

    @property
    def short(self) -> bool:
        return self.context <= ta.SHORT_CONTEXT

    @property
    def label(self) -> str:
        return f"B={self.batch} ctx={self.context} width={self.width}"


@dataclass
class Timing:
    us: float  # per launch; inf when it failed to compile or run
    out: torch.Tensor | None  # region 0's output


def graph_width(context: int) -> int:
    blocks = -(-context // BS)
    return next(w for w in width_buckets(MAX_BLOCKS) if w >= blocks) * BS


def regions(batch: int, context: int) -> int:
    return max(4, min(256, math.ceil(REGION_BYTES / (batch * context * H_KV * D * 4))))


def make_shapes(batches: list[int], contexts: list[int]) -> tuple[torch.Tensor, list[Shape]]:
    blocks = max(regions(b, c) * b * -(-c // BS) for b in batches for c in contexts)
    cache = torch.randn(2, blocks + 1, BS, H_KV, D, dtype=DTYPE, device="cuda")
    shapes = []
    for b in batches:
        for c in contexts:
            nb, width = -(-c // BS), graph_width(c)
            perm = torch.randperm(blocks, device="cuda").to(torch.int32)  # shuffled blocks
            tables = []
            for i in range(regions(b, c)):
                t = torch.zeros(b, width // BS, dtype=torch.int32, device="cuda")
                t[:, :nb] = perm[i * b * nb : (i + 1) * b * nb].view(b, nb)
                tables.append(t)
            lens = torch.full((b,), c, dtype=torch.int32, device="cuda")
            q = torch.randn(b, H, D, dtype=DTYPE, device="cuda")
            shapes.append(Shape(b, c, width, tables, lens, q, torch.empty_like(q)))
    return cache, shapes


def decode_call(cache: torch.Tensor, s: Shape, launch: ta.DecodeLaunch, i: int) -> Callable:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    part = decode_partition_size(s.batch, H_KV, s.width, sms, ta.SHORT_CONTEXT, launch.block_n)
    return partial(
        ta.paged_decode, s.q, cache[0], cache[1], s.tables[i], s.lens, D**-0.5, s.out,
        partition_size=part, launch=launch, short_context=ta.SHORT_CONTEXT,
    )  # fmt: skip


def time_launch(cache: torch.Tensor, s: Shape, launch: ta.DecodeLaunch) -> Timing:
    calls = [decode_call(cache, s, launch, i) for i in range(len(s.tables))]
    try:
        calls[0]()  # compiles outside the capture
        torch.cuda.synchronize()
        out = s.out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        best = math.inf
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / (5 * len(calls)))
        return Timing(best, out)
    except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: skip this launch
        print(f"#   skipped {launch} at {s.label}: {type(exc).__name__}", flush=True)
        torch.cuda.synchronize()
        return Timing(math.inf, None)


def reference(cache: torch.Tensor, s: Shape) -> torch.Tensor:
    """float32 attention of region 0 over its gathered context."""
    nb = -(-s.context // BS)
    k, v = (cache[j][s.tables[0][:, :nb].long()].flatten(1, 2)[:, : s.context].float()
            for j in (0, 1))  # fmt: skip  # [B, ctx, H_kv, D]
    q = s.q.float().view(s.batch, H_KV, H // H_KV, D)
    p = torch.softmax(torch.einsum("bhgd,bthd->bhgt", q, k) * D**-0.5, -1)
    return torch.einsum("bhgt,bthd->bhgd", p, v).reshape(s.batch, H, D)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


class Sweep:
    """Timings by (shape index, launch), each checked against the default's output."""

    def __init__(self, cache: torch.Tensor, shapes: list[Shape], budget_s: float) -> None:
        self.cache, self.shapes, self.budget_s = cache, shapes, budget_s
        self.times: dict[tuple[int, ta.DecodeLaunch], Timing] = {}
        self.failures: list[str] = []
        self.skipped = 0  # launches not timed because the time budget ran out
        self.t0 = time.perf_counter()

    def run(self, launches: list[ta.DecodeLaunch], which: list[int], what: str) -> None:
        for i in which:
            for launch in launches:
                self.time(i, launch)
        print(f"# {what}: {len(launches)} launches x {len(which)} shapes, "
              f"{time.perf_counter() - self.t0:.0f} s so far", flush=True)  # fmt: skip

    def time(self, i: int, launch: ta.DecodeLaunch) -> float:
        if (i, launch) not in self.times:
            late = time.perf_counter() - self.t0 > self.budget_s
            if late and launch != ta.DEFAULT_DECODE:  # past the budget: untimed, never chosen
                self.skipped += 1
                return math.inf
            s = self.shapes[i]
            t = self.times[(i, launch)] = time_launch(self.cache, s, launch)
            base = self.times.get((i, ta.DEFAULT_DECODE))
            ref = reference(self.cache, s) if base is None else base.out
            if t.out is not None and ref is not None and rel(t.out, ref) >= TOLERANCE:
                self.failures.append(f"{launch} at {s.label}: rel err {rel(t.out, ref):.1e}")
                t.us = math.inf  # a wrong launch never wins
        return self.times[(i, launch)].us

    def ratio(self, i: int, launch: ta.DecodeLaunch) -> float:
        """log(µs / default µs) of the best measured num_stages of this launch's arithmetic."""
        same = [t.us for (j, x), t in self.times.items() if j == i and same_arithmetic(x, launch)]
        return math.log(min(same, default=math.inf) / self.time(i, ta.DEFAULT_DECODE))

    def score(self, launch: ta.DecodeLaunch, which: list[int]) -> float:
        return sum(self.ratio(i, launch) for i in which) / len(which)

    def bits(self, i: int, launch: ta.DecodeLaunch) -> str:
        t, base = self.times.get((i, launch)), self.times.get((i, ta.DEFAULT_DECODE))
        if not self.shapes[i].short or t is None or t.out is None or base is None:
            return "-"
        return "=" if torch.equal(t.out, base.out) else "≠"


def same_arithmetic(a: ta.DecodeLaunch, b: ta.DecodeLaunch) -> bool:
    return (a.block_n, a.num_warps, a.short_piece) == (b.block_n, b.num_warps, b.short_piece)


def sweep(
    batches: list[int], contexts: list[int], budget_s: float
) -> tuple[Sweep, ta.DecodeLaunch]:
    """The three rounds; returns the sweep and the chosen arithmetic (at default stages)."""
    cache, shapes = make_shapes(batches, contexts)
    sw = Sweep(cache, shapes, budget_s)
    short = [i for i, s in enumerate(shapes) if s.short]
    long = [i for i, s in enumerate(shapes) if not s.short]
    every = list(range(len(shapes)))
    sw.run([ta.DEFAULT_DECODE], every, "default launch and its float32 check")
    sw.run(tdc.sweep_shapes(), short, "round 1, block_n x num_warps on short contexts")
    ranked = sorted(tdc.sweep_shapes(), key=lambda x: sw.score(x, short))
    finalists = ranked[:SWEEP_FINALISTS]
    tried = [x for f in finalists for x in tdc.sweep_schedules(f) + tdc.sweep_pieces(f)]
    sw.run(tried, short, "round 2, stages and short-row pieces of the finalists")
    pieces = sorted({*finalists, *tried}, key=lambda x: sw.score(x, short))
    arith = [replace(x, num_stages=tdc.SWEEP_BASE_STAGES) for x in pieces]
    best = list(dict.fromkeys(arith))[:SWEEP_FINALISTS]  # distinct arithmetics, best first
    if ta.DEFAULT_DECODE not in best:
        best.append(ta.DEFAULT_DECODE)
    for x in best:  # stage variants also on short shapes, so each arithmetic is complete
        sw.run(tdc.sweep_schedules(x), long, f"round 3, {x} on long contexts")
        sw.run(tdc.sweep_schedules(x), short, f"round 3, {x} stages on short contexts")
    chosen = min(best, key=lambda x: sw.score(x, every))
    return sw, chosen


def best_stages(sw: Sweep, arith: ta.DecodeLaunch, which: list[int]) -> int:
    """The num_stages of `arith` with the least total log-time over the shapes `which`."""

    def total(stages: int) -> float:
        return sum(math.log(sw.time(i, replace(arith, num_stages=stages))) for i in which)

    return min(tdc.SWEEP_STAGES, key=total)


def emit_table(sw: Sweep, arith: ta.DecodeLaunch) -> list[str]:
    """`DECODE_TABLE = DecodeTable(...)`: the arithmetic plus stages per (batch, width)."""
    every = list(range(len(sw.shapes)))
    default_stages = best_stages(sw, arith, every)
    gain = math.exp(-sw.score(arith, every))
    lines = [
        f"# {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}, bench/attn_kernels.py "
        f"--sweep: {gain:.2f}x the default launch (geometric mean of {len(every)} shapes)",
        "DECODE_TABLE = DecodeTable(",
        f"    block_n={arith.block_n}, num_warps={arith.num_warps}, "
        f"short_piece={arith.short_piece}, default_stages={default_stages},",
        "    stages=(",
    ]
    keys = sorted({(s.batch, s.width) for s in sw.shapes})
    for b, w in keys:
        which = [i for i, s in enumerate(sw.shapes) if (s.batch, s.width) == (b, w)]
        st = best_stages(sw, arith, which)
        notes = ", ".join(
            f"ctx {sw.shapes[i].context} {sw.time(i, replace(arith, num_stages=st)):.1f} vs "
            f"{sw.time(i, ta.DEFAULT_DECODE):.1f} µs"
            for i in which
        )
        lines.append(f"        ({b}, {w}, {st}),  # {notes}")
    return [*lines, "    ),", ")"]


def report(sw: Sweep, arith: ta.DecodeLaunch, emit: bool) -> list[str]:
    """Every timing, the free best per shape, bit-equality notes, then (emit) the table."""
    launches = list(dict.fromkeys(x for _, x in sw.times))
    rows = ["| launch (block_n, warps, stages, short_piece) | "
            + " | ".join(f"B{s.batch} c{s.context}" for s in sw.shapes) + " |",
            "|---" * (1 + len(sw.shapes)) + "|"]  # fmt: skip
    for x in launches:
        cells = []
        for i in range(len(sw.shapes)):
            t = sw.times.get((i, x))
            cells.append("" if t is None else f"{t.us:.1f}{sw.bits(i, x)}")
        rows.append(f"| {x.block_n}, {x.num_warps}, {x.num_stages}, {x.short_piece} | "
                    + " | ".join(cells) + " |")  # fmt: skip
    rows += ["", "| shape | default µs | best µs (free) | best launch | table's µs |",
             "|---|---:|---:|---|---:|"]  # fmt: skip
    for i, s in enumerate(sw.shapes):
        mine = [(t.us, x) for (j, x), t in sw.times.items() if j == i]
        us, x = min(mine, key=lambda m: m[0])
        table = min(t.us for (j, y), t in sw.times.items() if j == i and same_arithmetic(y, arith))
        rows.append(f"| {s.label} | {sw.time(i, ta.DEFAULT_DECODE):.1f} | {us:.1f} | {x} | "
                    f"{table:.1f} |")  # fmt: skip
    rows += ["", *neutrality(sw, launches)]
    if sw.skipped:
        rows.append(f"time budget ({sw.budget_s:.0f} s) ran out: {sw.skipped} timings skipped")
    rows += [f"check FAIL {f}" for f in sw.failures] or [
        f"checks: every launch within {TOLERANCE} of the default"
    ]
    if emit:
        rows += ["", "# paste into ds4pool/model/kernels/triton_decode_configs.py:"]
        rows += emit_table(sw, arith)
    return rows


def neutrality(sw: Sweep, launches: list[ta.DecodeLaunch]) -> list[str]:
    """Whether num_warps and num_stages alone change a short row's bits (the default's
    block_n, short rows whole): the table's rule assumes warps do, stages do not."""
    base = ta.DEFAULT_DECODE
    lines = []
    for knob in ("num_warps", "num_stages"):
        others = [
            x for x in launches if x != base and replace(x, **{knob: getattr(base, knob)}) == base
        ]
        marks = {sw.bits(i, x) for x in others for i in range(len(sw.shapes))} - {"-"}
        verdict = "not measured" if not marks else "yes" if marks == {"="} else "no"
        lines.append(f"short rows bit-identical to the default under every other {knob}: {verdict}")
    return lines


def run(quick: bool, emit: bool, budget_s: float) -> int:
    """The sweep, printed; exit code 1 when an output check failed."""
    batches = [1, 64] if quick else list(BATCHES)
    contexts = [160, 3072] if quick else list(CONTEXTS)
    sw, arith = sweep(batches, contexts, budget_s)
    print("\n".join(report(sw, arith, emit)), flush=True)
    print(f"# sweep done in {time.perf_counter() - sw.t0:.0f} s", flush=True)
    return 1 if sw.failures else 0
