"""Scheduler benchmark: continuous batching vs the serialized baseline, and chunked prefill.

    python bench/sched.py                                   # random:100m on CPU, CPU sizes
    python bench/sched.py --model random:llama3-8b --device cuda
    python bench/sched.py --quick                           # smoke run, small sizes

The engine is driven in-process (no HTTP): `Engine.submit(Request)` returns a stream,
and one pre-started consumer thread per request timestamps each event as it arrives
(`time.perf_counter()`), as a streaming client would. Each event carries the tokens of
one step. The model is loaded once and shared by every engine; each configuration gets
its own Engine (own KV pool, scheduler and worker thread). Prompts are random token ids
from a seeded RNG (exact lengths, ids in [4, min(tokenizer vocab, model vocab))), decoding
is greedy with `ignore_eos`, so every request generates exactly the asked number of tokens
and every configuration runs the identical workload.

Part 1, batched vs serialized. For each concurrency level N, N sessions each submit one
request (a --prompt-len prompt, --gen-len generated tokens) all at once (submit() does not
block). The same N prompts run, back to back, on three engines:
  - batched:      continuous batching, coalesce window 0;
  - coalesce:     the same with a --coalesce-us window (the worker waits that long after
                  waking from idle, so a burst of arrivals shares its first step);
  - serialized:   `no_batching=True`, one request at a time and one live KV session, as
                  ds4-server does.
  gen tok/s = all generated tokens / (last token's arrival - first submission).
  TTFT = first token's arrival - that request's submission. ITL = gaps between a
  request's consecutive tokens. p99 of N <= 32 samples is close to the max.
  "steps" = forward steps the worker ran for the level. Sessions are dropped after each
  level, so every level starts from an empty pool.

Part 2, chunked prefill. --decoders sessions decode; once each has emitted a few tokens, one
--long-prompt prompt arrives (1 generated token). The decoders' inter-token gaps that
overlap the long prompt's prefill (submission → its first token) are reported, with
max_batch_tokens at --max-batch-tokens (default 2048: the prompt is prefilled in chunks,
one chunk per step next to the decodes) and at a large value (no chunking: one step
computes the whole prompt while the decoders wait), and at --max-batch-tokens with each
--max-prefill-tokens cap (prompt tokens per step while someone decodes; the first row has
the cap at max_batch_tokens, i.e. none) and each --max-prefill-cost (the work cap,
sched/prefill_cost.py; 0 = off; the first and last rows have none) and each
--itl-budget-factor (sched/step_time.py: the work cap lowered to what keeps a mixed step
within that x a decode step, from measured step times; 0 = off; --no-baselines drops the
first and last rows). "before" is the
decoders' ITL before the long prompt arrived; "long TTFT" is what chunking costs the long
prompt itself. "graphs" counts the CUDA graphs captured, and the steps run eagerly for want
of one, while the long prompt was prefilled (--cuda-graphs ahead captures at engine
start-up: each engine logs the count, seconds and memory).

CPU defaults are smaller than the GPU ones so the whole run fits in a few minutes on two
cores (see DEVICE_DEFAULTS); the header prints the sizes actually used.
"""

from __future__ import annotations

import argparse
import gc
import queue
import random
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.engine import PREFILL_TOKENS, Engine, EngineConfig  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.device import select_device, select_dtype  # noqa: E402
from ds4pool.model.loader import LoadedModel, load_model  # noqa: E402
from ds4pool.model.sampler import SamplingParams  # noqa: E402
from ds4pool.sched.prefill_cost import DEFAULTS as PREFILL_COST  # noqa: E402
from ds4pool.sched.request import Request, RequestStream  # noqa: E402
from ds4pool.sched.step_time import FACTOR_DEFAULTS  # noqa: E402

TENANT = "bench"
GREEDY = SamplingParams(temperature=0.0)
TIMEOUT_S = 1800.0
# (prompt_len, gen_len, long_prompt) when not given on the command line
DEVICE_DEFAULTS = {"cuda": (256, 64, 16384), "cpu": (128, 32, 8192)}
QUICK = (32, 8, 1024)
GB = 1 << 30


# ------------------------------------------------------------------ timing a request


@dataclass
class Trace:
    """Arrival times of one request's token-bearing events."""

    submitted: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def gaps(self) -> list[tuple[float, float]]:
        return list(zip(self.times, self.times[1:]))


def _consume(jobs: queue.SimpleQueue) -> None:
    stream, trace = jobs.get()
    try:
        for ev in stream:
            now = time.perf_counter()
            if ev.token_ids:
                trace.times.append(now)
                trace.tokens += len(ev.token_ids)
            if ev.finished:
                trace.finish, trace.error = ev.finish_reason, ev.error
    finally:
        trace.done.set()


def start_consumers(n: int) -> queue.SimpleQueue:
    """n threads, each waiting for one (stream, trace) to consume: started before the
    burst so that no event waits for a thread to be created."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(n):
        threading.Thread(target=_consume, args=(jobs,), daemon=True).start()
    return jobs


def submit_all(
    engine: Engine, prompts: list[list[int]], gen: int, tag: str
) -> tuple[list[Trace], list[RequestStream]]:
    jobs = start_consumers(len(prompts))
    traces, streams = [], []
    for i, ids in enumerate(prompts):
        req = Request(
            tenant=TENANT,
            session_id=f"{tag}-{i}",
            prompt_ids=ids,
            sampling=GREEDY,
            max_tokens=gen,
            ignore_eos=True,
        )
        t = time.perf_counter()
        stream = engine.submit(req)
        trace = Trace(t)
        jobs.put((stream, trace))
        traces.append(trace)
        streams.append(stream)
    return traces, streams


def wait_all(traces: list[Trace], expect: str | None = None) -> None:
    for tr in traces:
        if not tr.done.wait(TIMEOUT_S):
            raise TimeoutError("a request did not finish in time")
        if tr.error or (expect and tr.finish != expect):
            raise RuntimeError(f"request ended with {tr.finish!r}: {tr.error}")


def drop_sessions(engine: Engine, tag: str, n: int) -> None:
    for i in range(n):
        engine.pool.drop(TENANT, f"{tag}-{i}")


# ------------------------------------------------------------------ statistics, formatting


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(seconds: float) -> str:
    v = seconds * 1e3
    if v != v:  # nan
        return "–"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


# ------------------------------------------------------------------ engines


def make_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def make_engine(loaded: LoadedModel, args: argparse.Namespace, **overrides: object) -> Engine:
    kw: dict = dict(
        model=args.model,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        kv_device_gb=args.kv_gb,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        cuda_graphs=args.cuda_graphs,
    )
    kw.update(overrides)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**kw), loaded=loaded)
    cap = engine.graph_capture
    if cap is not None:
        log(
            f"engine start-up {time.perf_counter() - t0:.1f} s: {cap.captured} CUDA graphs "
            f"captured in {cap.seconds:.1f} s, {cap.graph_bytes / 2**20:.0f} MiB, "
            f"{cap.pending} left for idle time"
        )
    # warm-up: first-call costs (allocator, kernels, lazy init) stay out of the timings
    prompts = make_prompts(12345, 2, args.prompt_len, args.vocab)
    traces, _ = submit_all(engine, prompts, 4, "warm")
    wait_all(traces, "length")
    drop_sessions(engine, "warm", len(prompts))
    return engine


@contextmanager
def engines(loaded: LoadedModel, args: argparse.Namespace, configs: dict[str, dict]) -> Iterator:
    made: dict[str, Engine] = {}
    try:
        for name, overrides in configs.items():
            made[name] = make_engine(loaded, args, **overrides)
        yield made
    finally:
        for engine in made.values():
            engine.close()
        made.clear()
        gc.collect()
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ part 1


@dataclass
class LevelResult:
    sessions: int
    wall: float
    tokens: int
    ttft: list[float]
    itl: list[float]
    steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall


def run_level(engine: Engine, prompts: list[list[int]], gen: int, tag: str) -> LevelResult:
    steps0 = engine.worker.steps
    traces, _ = submit_all(engine, prompts, gen, tag)
    wait_all(traces, "length")
    steps = engine.worker.steps - steps0
    drop_sessions(engine, tag, len(prompts))
    assert all(tr.tokens == gen for tr in traces), "a request generated a different count"
    start = min(tr.submitted for tr in traces)
    end = max(tr.times[-1] for tr in traces)
    return LevelResult(
        sessions=len(prompts),
        wall=end - start,
        tokens=sum(tr.tokens for tr in traces),
        ttft=[tr.times[0] - tr.submitted for tr in traces],
        itl=[b - a for tr in traces for a, b in tr.gaps()],
        steps=steps,
    )


def part1(loaded: LoadedModel, args: argparse.Namespace) -> None:
    configs = {
        "batched": {"coalesce_us": 0},
        f"batched, coalesce {args.coalesce_us} µs": {"coalesce_us": args.coalesce_us},
        "serialized (no_batching)": {"no_batching": True},
    }
    results: dict[str, dict[int, LevelResult]] = {name: {} for name in configs}
    with engines(loaded, args, configs) as made:
        for i, n in enumerate(args.concurrency):
            prompts = make_prompts(args.seed + n, n, args.prompt_len, args.vocab)
            order = list(made)
            for name in order[i % len(order) :] + order[: i % len(order)]:  # rotate the order
                engine = made[name]
                res = run_level(engine, prompts, args.gen_len, f"c{n}")
                results[name][n] = res
                log(f"{n:3d} sessions  {name:32s} {res.tok_s:9.1f} tok/s  {res.wall:7.2f} s")
    print_part1(results, args)


def print_part1(results: dict[str, dict[int, LevelResult]], args: argparse.Namespace) -> None:
    names = list(results)
    print(f"\n### Aggregate throughput ({args.prompt_len}-token prompts, {args.gen_len} generated)")
    print()
    print(
        f"| sessions | {names[0]} tok/s | {names[1]} tok/s | {names[2]} tok/s "
        f"| × batched / serialized | × coalesce / serialized |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        b, c, s = (results[name][n].tok_s for name in names)
        print(f"| {n} | {b:,.1f} | {c:,.1f} | {s:,.1f} | {b / s:.2f}× | {c / s:.2f}× |")
    print("\n### Latency per configuration (ms)\n")
    print(
        "| sessions | mode | wall s | gen tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | steps |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        for name in names:
            r = results[name][n]
            print(
                f"| {n} | {name} | {r.wall:.2f} | {r.tok_s:,.1f} | {ms(percentile(r.ttft, 50))} "
                f"| {ms(percentile(r.ttft, 99))} | {ms(percentile(r.itl, 50))} "
                f"| {ms(percentile(r.itl, 99))} | {r.steps} |"
            )


# ------------------------------------------------------------------ part 2


@dataclass
class PrefillResult:
    max_batch_tokens: int
    max_prefill_tokens: int
    max_prefill_cost: int  # 0: no work cap
    itl_budget_factor: float  # 0: off
    long_ttft: float
    steps: int  # worker steps between the long prompt's submission and its first token
    during: list[float]  # decoder gaps overlapping the long prompt's prefill
    before: list[float]  # decoder gaps before it arrived
    tokens: float  # tokens per decoder while the long prompt was prefilled
    captures: int  # CUDA graphs captured during the prefill
    eager_misses: int  # steps run eagerly for want of a captured graph (ahead mode)


def graph_counts(engine: Engine) -> tuple[int, int]:
    g = engine.runner.graphs
    return (g.captures, g.eager_misses) if g is not None else (0, 0)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.perf_counter() + TIMEOUT_S
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.001)


def run_prefill(engine: Engine, args: argparse.Namespace) -> PrefillResult:
    prompts = make_prompts(args.seed + 1000, args.decoders, args.prompt_len, args.vocab)
    traces, streams = submit_all(engine, prompts, args.decoder_tokens, "dec")
    wait_until(lambda: all(len(tr.times) >= 4 for tr in traces), "the decoders to start")
    long_ids = make_prompts(args.seed + 2000, 1, args.long_prompt, args.vocab)[0]
    steps0 = engine.worker.steps
    captures0, misses0 = graph_counts(engine)
    t_long = time.perf_counter()
    stream = engine.submit(
        Request(TENANT, "long", prompt_ids=long_ids, sampling=GREEDY, max_tokens=1)
    )
    first = stream.get(TIMEOUT_S)
    t_first = time.perf_counter()
    steps = engine.worker.steps - steps0
    captures, misses = graph_counts(engine)
    if first.error or not first.token_ids:
        raise RuntimeError(f"long prompt ended with {first.finish_reason!r}: {first.error}")
    # let every decoder close the gap that spans the end of the prefill, then stop them
    wait_until(lambda: all(tr.times[-1] > t_first for tr in traces), "the decoders' next token")
    for s in streams:
        s.cancel()
    wait_all(traces, "cancelled")
    drop_sessions(engine, "dec", len(prompts))
    engine.pool.drop(TENANT, "long")
    gaps = [g for tr in traces for g in tr.gaps()]
    return PrefillResult(
        max_batch_tokens=engine.cfg.max_batch_tokens,
        max_prefill_tokens=engine.scheduler.cfg.max_prefill_tokens,
        max_prefill_cost=cost.budget if (cost := engine.scheduler.cfg.prefill_cost) else 0,
        itl_budget_factor=engine.scheduler.cfg.itl_budget_factor,
        long_ttft=t_first - t_long,
        steps=steps,
        during=[b - a for a, b in gaps if b > t_long and a < t_first],
        before=[b - a for a, b in gaps if b <= t_long],
        tokens=sum(t_long < t <= t_first for tr in traces for t in tr.times) / len(traces),
        captures=captures - captures0,
        eager_misses=misses - misses0,
    )


def part2(loaded: LoadedModel, args: argparse.Namespace) -> None:
    big = max(args.no_chunk_tokens, args.long_prompt + args.decoders)
    mbt = args.max_batch_tokens
    # (max_batch_tokens, max_prefill_tokens, max_prefill_cost, itl_budget_factor): chunks of
    # the whole budget (no prefill cap), each cap x work cap x factor asked for, no chunking
    configs = [] if args.no_baselines else [(mbt, mbt, 0, 0.0)]
    configs += [
        (mbt, cap, cost, f)
        for cap in args.max_prefill_tokens
        for cost in args.max_prefill_cost
        for f in args.itl_budget_factor
    ]
    configs += [] if args.no_baselines else [(big, big, 0, 0.0)]
    results = []
    for tokens, cap, cost, factor in configs:
        # one engine at a time: the long prompt's activations are the largest allocation
        over = {
            "max_batch_tokens": tokens,
            "max_prefill_tokens": cap,
            "max_prefill_cost": cost,
            "itl_budget_factor": factor,
        }
        with engines(loaded, args, {"x": over}) as made:
            res = run_prefill(made["x"], args)
        results.append(res)
        log(
            f"max_batch_tokens {tokens:6d}, max_prefill_tokens {cap:6d}, max_prefill_cost "
            f"{cost:5d}, itl_budget_factor {factor:g}: long TTFT {res.long_ttft:.2f} s, "
            f"{res.steps} steps"
        )
    print(
        f"\n### Decoders' inter-token latency during a {args.long_prompt}-token prefill "
        f"({args.decoders} decoders, {args.prompt_len}-token prompts; ms)\n"
    )
    print(
        "| max_batch_tokens | max_prefill_tokens | max_prefill_cost | itl_budget_factor "
        "| long prompt TTFT "
        "| steps during prefill | ITL p50 during | ITL p99 during | ITL max during "
        "| tokens per decoder during | ITL p50 before | p99 during / p50 before "
        "| graphs captured / eager misses during |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        before = percentile(r.before, 50)
        print(
            f"| {r.max_batch_tokens} | {r.max_prefill_tokens} | {r.max_prefill_cost or 'off'} "
            f"| {f'{r.itl_budget_factor:g}' if r.itl_budget_factor else 'off'} "
            f"| {ms(r.long_ttft)} | {r.steps} "
            f"| {ms(percentile(r.during, 50))} | {ms(percentile(r.during, 99))} "
            f"| {ms(max(r.during))} | {r.tokens:.1f} | {ms(before)} "
            f"| {percentile(r.during, 99) / before:.1f}× | {r.captures} / {r.eager_misses} |"
        )


# ------------------------------------------------------------------ main


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:100m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--prompt-len", type=int, help="default: 256 on CUDA, 128 elsewhere")
    ap.add_argument("--gen-len", type=int, help="default: 64 on CUDA, 32 elsewhere")
    ap.add_argument("--long-prompt", type=int, help="default: 16384 on CUDA, 8192 elsewhere")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--decoder-tokens", type=int, default=512, help="max_tokens of a decoder")
    ap.add_argument("--coalesce-us", type=int, default=2000)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        nargs="+",
        help="part 2: prefill caps to compare (default: 512 on CUDA, 64 on CPU)",
    )
    ap.add_argument(
        "--max-prefill-cost",
        type=int,
        nargs="+",
        help="part 2: work caps to compare, 0 = off (default: 640 on CUDA, 112 on CPU)",
    )
    ap.add_argument(
        "--itl-budget-factor",
        type=float,
        nargs="+",
        help="part 2: ITL budget factors to compare, 0 = off (default: the device's, "
        "sched/step_time.py FACTOR_DEFAULTS)",
    )
    ap.add_argument(
        "--no-baselines",
        action="store_true",
        help="part 2: only the rows asked for (no 'no prefill cap' and 'no chunking' rows)",
    )
    ap.add_argument(
        "--cuda-graphs",
        choices=["ahead", "lazy", "eager"],
        default="ahead",
        help="CUDA graphs: captured at engine start-up (ahead), on first use, or none",
    )
    ap.add_argument("--no-chunk-tokens", type=int, default=32768)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--kv-gb", type=float, help="device KV pool per engine (default: sized)")
    ap.add_argument("--parts", type=int, nargs="+", choices=[1, 2], default=[1, 2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    return ap.parse_args()


def resolve(args: argparse.Namespace, loaded: LoadedModel) -> None:
    """Fill in device-dependent defaults and size the KV pool for the workload."""
    kind = "cuda" if loaded.device.type == "cuda" else "cpu"
    prompt, gen, long = DEVICE_DEFAULTS[kind]
    if args.quick:
        prompt, gen, long = QUICK
        args.concurrency = [1, 4]
        args.decoders = min(args.decoders, 4)
        args.max_batch_tokens = 256
    args.prompt_len = args.prompt_len or prompt
    args.max_prefill_tokens = args.max_prefill_tokens or [PREFILL_TOKENS[kind]]
    args.max_prefill_cost = args.max_prefill_cost or [PREFILL_COST[kind][1]]
    args.itl_budget_factor = args.itl_budget_factor or [FACTOR_DEFAULTS[kind]]
    args.gen_len = args.gen_len or gen
    args.long_prompt = args.long_prompt or long
    args.vocab = min(loaded.tokenizer.vocab_size, loaded.config.vocab_size)
    if args.kv_gb is None:
        per_token = loaded.config.kv_bytes_per_token(loaded.dtype.itemsize)
        tokens = max(
            max(args.concurrency) * (args.prompt_len + args.gen_len + 16),
            args.decoders * (args.prompt_len + args.decoder_tokens + 16) + args.long_prompt,
        )
        args.kv_gb = max(0.25, round(2 * tokens * per_token / GB, 2))


def header(args: argparse.Namespace, loaded: LoadedModel) -> None:
    dev = loaded.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    print(
        f"# {args.model} on {dev} ({name}), {str(loaded.dtype).removeprefix('torch.')}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{datetime.now().isoformat(timespec='seconds')}"
    )
    print(f"# command: python {shlex.join(sys.argv)}")
    print(
        f"# prompt {args.prompt_len}, generated {args.gen_len}, concurrency "
        f"{' '.join(map(str, args.concurrency))}, long prompt {args.long_prompt}, "
        f"decoders {args.decoders}, max_batch_tokens {args.max_batch_tokens}, "
        f"max_batch_size {args.max_batch_size}, KV pool {args.kv_gb} GB per engine"
    )


def main() -> None:
    args = parse_args()
    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    loaded = load_model(args.model, device, dtype)
    resolve(args, loaded)
    header(args, loaded)
    t0 = time.perf_counter()
    if 1 in args.parts:
        part1(loaded, args)
    if 2 in args.parts:
        part2(loaded, args)
    print(f"\n# total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
