"""Host time per decode step: what the worker does around the forward, split by phase.

    python bench/host_step.py                              # tiny model on CPU, N = 16 32 64
    python bench/host_step.py --profile 64                 # + cProfile of the N = 64 steps
    python bench/host_step.py --model random:llama3-8b --device cuda --dtype bfloat16 \
        --overlap off on ahead                             # the H200 comparison
    python bench/host_step.py --wave --batch 32 64 --clock thread   # a wave of resumed turns

The real Scheduler + SessionPool + ModelRunner + Worker of an Engine, driven step by step
from this thread (the engine's worker thread is stopped), so every phase can be timed and
profiled. The default model is tiny (1 layer, hidden 64, the demo tokenizer's 1,024 ids):
its forward is nearly free on CPU, what is left is the host's per-step work. N sessions
share a --context - 64 token prefix (prefilled once, then shared) plus 64 tokens of their
own, and decode greedily with ignore_eos; only steps where all N rows decode are counted.

Columns (ms per step, mean over the counted steps):
  schedule   Scheduler.schedule: pick rows, reserve blocks, build the SeqInputs;
  prep       the runner's host prep: validate + the input batch load (DecodeRow lists,
             staging, table diffs);
  forward    the rest of the runner's step (the forward and the sampler; on CPU also host);
  advance    the writeback the next schedule needs: counts, token append, grammar, EOS,
             max_tokens (Scheduler.advance);
  settle     the rest of it: detokenize, stop strings, stream push, lease.offer, observer
             (Scheduler.settle; with --overlap on it runs while the device runs the next
             step, so it is not in `host`);
  host       the worker's ds4pool_step_host_seconds: the host time the device idles
             (planning + writeback; with overlap, advance + schedule before the launch);
  step       wall time per step; tok/s = N / step.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.engine import Engine, EngineConfig  # noqa: E402
from ds4pool.model import demo  # noqa: E402
from ds4pool.model.config import ModelConfig  # noqa: E402
from ds4pool.model.loader import LoadedModel, build_empty, load_model  # noqa: E402
from ds4pool.model.tokenizer import Tokenizer  # noqa: E402
from ds4pool.sched.request import Request  # noqa: E402

OWN_TOKENS = 64  # tokens of each session's prompt past the shared prefix

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}


def tiny_model(device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """1 layer, hidden 64, with the demo tokenizer: a forward that costs next to nothing."""
    demo_dir = demo.ensure_demo_model()
    tokenizer = Tokenizer.from_dir(demo_dir)
    hf = {**demo.DEMO_CONFIG, **TINY, "vocab_size": tokenizer.vocab_size}
    hf["eos_token_id"] = list(tokenizer.eos_token_ids)
    cfg = ModelConfig.from_hf(hf)
    model = build_empty(cfg, device, dtype)
    demo.init_random_(model, demo.DEMO_SEED, demo.DEMO_INIT_STD)
    return LoadedModel(model, cfg, tokenizer, "tiny", None, device, dtype, "tiny-host-step")


@dataclass
class Phases:
    """Seconds per phase of the step being recorded, then of all counted steps."""

    clock: Callable[[], float] = time.perf_counter
    current: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    counted: int = 0

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t = self.clock()
            try:
                return fn(*args, **kw)
            finally:
                self.current[name] = self.current.get(name, 0.0) + self.clock() - t

        return wrapper

    def close_step(self, count: bool) -> None:
        if count:
            for k, v in self.current.items():
                self.totals[k] = self.totals.get(k, 0.0) + v
            self.counted += 1
        self.current = {}

    def ms(self, name: str) -> float:
        return 1e3 * self.totals.get(name, 0.0) / max(1, self.counted)


def instrument(e: Engine, phases: Phases) -> None:
    sched, runner = e.scheduler, e.scheduler.runner
    # process = advance + settle (the synchronous loop calls both through these attributes)
    for name in ("schedule", "advance", "settle"):
        setattr(sched, name, phases.timed(name, getattr(sched, name)))
    # a step built ahead (overlap ahead) is a schedule too
    sched.schedule_ahead = phases.timed("schedule", sched.schedule_ahead)  # type: ignore[method-assign]
    for name in ("launch", "wait"):
        setattr(runner, name, phases.timed("runner", getattr(runner, name)))
    runner.validate = phases.timed("prep", runner.validate)  # type: ignore[method-assign]
    runner.batch.load = phases.timed("prep", runner.batch.load)  # type: ignore[method-assign]
    observer_step = sched.observer.step

    def on_step(batch: int, tokens: int, seconds: float, host: float = 0.0) -> None:
        phases.current["host"] = phases.current.get("host", 0.0) + host
        observer_step(batch, tokens, seconds, host)

    sched.observer.step = on_step  # type: ignore[method-assign]


def run(
    loaded: LoadedModel, args: argparse.Namespace, n: int, overlap: str, profile: bool
) -> dict[str, float]:
    cfg = EngineConfig(
        model=loaded.name,
        kv_device_gb=args.kv_gb,
        max_batch_size=max(args.batch),
        max_batch_tokens=max(4096, args.context),
        max_prefill_tokens=max(4096, args.context),  # every own tail in one step
        max_prefill_cost=0,
        cuda_graphs=args.cuda_graphs,
        graph_capture_s=0.0,
        **({"overlap": overlap} if overlap != "default" else {}),
    )
    e = Engine(cfg, loaded=loaded)
    e.worker.stop()  # this thread drives the steps (timing and cProfile see them all)
    worker, sched = e.worker, e.scheduler
    vocab = min(loaded.tokenizer.vocab_size, loaded.config.vocab_size)
    prefix = [4 + (i * 7919) % (vocab - 4) for i in range(args.context - OWN_TOKENS)]
    streams = []
    for i in range(n):
        if i == 1:  # the first session has computed the prefix: the others share it
            while sched.running and sched.running[0].num_pending > 1:
                worker.step_once()
        own = [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(OWN_TOKENS)]
        req = Request(
            session_id=f"h{n}-{i}",
            prompt_ids=prefix + own,
            max_tokens=args.warmup + args.steps,
            ignore_eos=True,
        )
        streams.append(sched.submit(req))
        if i == 0:
            worker.step_once()
    phases = Phases(time.thread_time if args.clock == "thread" else time.perf_counter)
    instrument(e, phases)
    prof = cProfile.Profile() if profile else None
    wall = 0.0
    decoded = 0
    while sched.has_work() or getattr(worker, "in_flight", False):
        t = time.perf_counter()
        decoding = len(sched.running) == n and all(s.num_pending == 1 for s in sched.running)
        count = (
            decoding
            and decoded >= args.warmup
            # none ends in this turn (with overlap the results lag a turn behind)
            and all(s.max_tokens - len(s.output_ids) >= 3 for s in sched.running)
        )
        if count and prof is not None:
            prof.enable()
        worker.step_once()
        if prof is not None:
            prof.disable()
        # no device sync here: with overlap a turn returns with the next step in flight, and
        # the next turn's wait is where its time shows (the sum over turns is the wall time)
        if count:
            wall += time.perf_counter() - t
        decoded += decoding
        phases.close_step(count)
    for s in streams:
        _, ids, final = s.collect(timeout=60)
        assert final.error is None and len(ids) == args.warmup + args.steps, final
    e.close()
    del e, worker, sched  # its device KV goes before the next run allocates its own
    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    if prof is not None and phases.counted:
        print(f"\n## cProfile, N = {n}, {phases.counted} decode steps, overlap {overlap}\n")
        # the host's share: the forward's torch calls are not what this bench is about
        host_code = r"ds4pool/(sched|kv|api)|input_batch|tokenizer|runner"
        pstats.Stats(prof).sort_stats("cumulative").print_stats(host_code, 30)
    steps = max(1, phases.counted)
    runner_ms = phases.ms("runner")
    return {
        "schedule": phases.ms("schedule"),
        "prep": phases.ms("prep"),
        "forward": runner_ms - phases.ms("prep"),
        "advance": phases.ms("advance"),
        "settle": phases.ms("settle"),
        "host": phases.ms("host"),
        "step": 1e3 * wall / steps,
        "tok/s": n * steps / wall if wall else 0.0,
        "steps": phases.counted,
    }


def run_wave(loaded: LoadedModel, args: argparse.Namespace, n: int, profile: bool) -> dict:
    """N sessions on one shared prefix end a turn, then all resume at once with
    --wave-tokens new tokens each (the agents' waves, docs/BENCHMARKS.md run K): the phases
    of the steps that carry their prompt chunks, per step."""
    cfg = EngineConfig(
        model=loaded.name,
        kv_device_gb=args.kv_gb,
        max_batch_size=max(args.batch),
        cuda_graphs=args.cuda_graphs,
        graph_capture_s=0.0,
        prefill_burst=8,
    )
    e = Engine(cfg, loaded=loaded)
    e.worker.stop()
    worker, sched = e.worker, e.scheduler
    step = worker.step_once
    vocab = min(loaded.tokenizer.vocab_size, loaded.config.vocab_size)
    prefix = [4 + (i * 7919) % (vocab - 4) for i in range(args.context - OWN_TOKENS)]

    def turn(prompts: list[list[int]], gen: int) -> list[list[int]]:
        streams = [
            sched.submit(
                Request(session_id=f"w{n}-{i}", prompt_ids=p, max_tokens=gen, ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ]
        while sched.has_work() or getattr(worker, "in_flight", False):
            if prof is not None and gen == 1:
                prof.enable()
            step()
            if prof is not None:
                prof.disable()
            if gen == 1:  # the wave: count every step
                phases.close_step(True)
        outs = []
        for s in streams:
            _, ids, final = s.collect(timeout=60)
            assert final.error is None, final
            outs.append(ids)
        return outs

    prof = None
    firsts = [
        prefix + [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(OWN_TOKENS)] for i in range(n)
    ]
    outs = turn(firsts, 16)
    phases = Phases(time.thread_time if args.clock == "thread" else time.perf_counter)
    instrument(e, phases)
    prof = cProfile.Profile() if profile else None
    resumed = [
        p + o + [4 + (i * 37 + j * 11) % (vocab - 4) for j in range(args.wave_tokens)]
        for i, (p, o) in enumerate(zip(firsts, outs))
    ]
    t = time.perf_counter()
    turn(resumed, 1)
    wall = time.perf_counter() - t
    e.close()
    gc.collect()
    if prof is not None:
        print(f"\n## cProfile, a wave of N = {n}\n")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_filter, 30)
    steps = max(1, phases.counted)
    return {
        "steps": phases.counted,
        "schedule": phases.ms("schedule"),
        "advance": phases.ms("advance"),
        "settle": phases.ms("settle"),
        "host": phases.ms("host"),
        "wave": wall * 1e3,
        "per step": wall * 1e3 / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, or a load_model spec")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--context", type=int, default=3072, help="prompt tokens per session")
    ap.add_argument("--steps", type=int, default=48, help="decode steps counted")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before counting")
    ap.add_argument(
        "--overlap", nargs="+", default=["default"], help="off / on / ahead per run (default: auto)"
    )
    ap.add_argument("--cuda-graphs", default="lazy", help="eager, lazy (default), ahead")
    ap.add_argument("--kv-gb", type=float, default=None, help="device KV (default 2 GB CPU)")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "thread"],
        help="phases in wall time, or in this thread's CPU time (steadier on a busy machine; "
        "host and step stay wall time)",
    )
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="cProfile these N")
    ap.add_argument(
        "--profile-filter",
        default=r"ds4pool/(sched|kv|api)",
        help="--wave: the profile's rows whose file matches this (e.g. 'ds4pool/model|triton' "
        "for the launch's host side)",
    )
    ap.add_argument(
        "--wave",
        action="store_true",
        help="instead: N resumed turns arriving at once (a wave), the host phases of its steps",
    )
    ap.add_argument("--wave-tokens", type=int, default=241, help="--wave: new tokens a turn")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    loaded = (
        tiny_model(device, dtype) if args.model == "tiny" else load_model(args.model, device, dtype)
    )
    if args.kv_gb is None:
        per_token = loaded.config.kv_bytes_per_token(dtype.itemsize)
        need = max(args.batch) * (args.context + args.warmup + args.steps + 64) * per_token
        args.kv_gb = 1.5 * need / 2**30 + 0.01
    print(
        f"# host_step: model {args.model} on {device} {args.dtype}, context {args.context}, "
        f"{args.steps} counted decode steps after {args.warmup}, phases in {args.clock} time; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    if args.wave:
        cols = ["steps", "schedule", "advance", "settle", "host", "per step", "wave"]
        print("\n| N | " + " | ".join(cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for n in args.batch:
            r = run_wave(loaded, args, n, n in args.profile)
            cells = [f"{r[c]}" if c == "steps" else f"{r[c]:.3f}" for c in cols]
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
        return
    cols = ["schedule", "prep", "forward", "advance", "settle", "host", "step", "tok/s"]
    print("\n| overlap | N | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for overlap in args.overlap:
        for n in args.batch:
            r = run(loaded, args, n, overlap, n in args.profile)
            cells = [f"{r[c]:.0f}" if c == "tok/s" else f"{r[c]:.3f}" for c in cols]
            print(f"| {overlap} | {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
