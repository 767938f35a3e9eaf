"""Where a decode step's time goes: whole step vs CUDA-graph replay vs the host, and the
kernels inside (torch.profiler sees the kernels of graph replays through CUPTI).

    python bench/profile_decode.py --model random:llama3-8b --batch 1 64
    python bench/profile_decode.py --batch 8 --mixed 128 512 --mixed-ctx 8192 16384
    python bench/profile_decode.py --batch 24 --prompt-len 3000 --mixed 243 --mixed-ctx 2900 \
        --mixed-chunks 1 8     # a burst of 8 resumed prompts of the agents workload
    python bench/profile_decode.py ... --backend triton-split   # decode rows: decode kernel

Prints per batch size: step ms (runner.step, incl. input upload, sampling and the one
readback), replay ms (the graph alone, CUDA events), kernels per step and the top kernels
by device time. Mixed steps also print their timeline's idle time (inside the steps, from
the first kernel to the last) and its longest gaps; --trace DIR keeps the chrome traces.
With --mixed, also mixed steps: the batch's decoders next to one prompt
chunk (or --mixed-chunks of them) of each size whose cached context ends at each --mixed-ctx
(a mixed-step CUDA graph where one chunk fits the graphs' buckets, else eager;
--no-cuda-graphs for eager);
host-bound when the step takes longer than its kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.kv.blocks import BlockPool, BlockTable  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--mixed", type=int, nargs="*", default=[], help="prompt chunk sizes")
    ap.add_argument("--mixed-ctx", type=int, nargs="+", default=[8192])
    ap.add_argument(
        "--mixed-chunks",
        type=int,
        nargs="+",
        default=[1],
        help="prompt chunks in a mixed step, each count in turn (several: eager unless "
        "--graph-chunks covers them, as the agents' bursts)",
    )
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--graph-chunks",
        type=int,
        default=1,
        help="a mixed step of up to N chunks replays a graph (the runner's max_graph_chunks; "
        "ds4pool serve --graph-chunks)",
    )
    ap.add_argument(
        "--graph-chunk-tokens",
        type=int,
        default=512,
        help="the most prompt tokens of a graphed mixed step (max_graph_chunk; the engine "
        "uses min(--max-prefill-tokens, 2048))",
    )
    ap.add_argument("--trace", help="directory for each mixed step's chrome trace (timeline)")
    ap.add_argument(
        "--prefill-launch",
        choices=["device", "default", "deep"],
        default="device",
        help="the Triton prefill launch: the device's choice (prefill_launch), or force "
        "DEFAULT_PREFILL (64-key tiles, 2 stages) / DEEP_PREFILL (128-key, 3 stages) for an A/B",
    )
    ap.add_argument(
        "--backend",
        default="triton",
        help="attention backend (triton-split: mixed steps' decode rows in the decode kernel; "
        "triton-small: on 16-row tiles of the prefill kernel)",
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    loaded = load_model(args.model, device, torch.bfloat16)
    per_seq = -(-(args.prompt_len + 64) // 16)
    long_blocks = -(-(max(args.mixed_ctx) + max(args.mixed, default=0)) // 16) if args.mixed else 0
    long_blocks *= max(args.mixed_chunks)
    blocks = per_seq * max(args.batch) + long_blocks + 1
    runner = ModelRunner(
        loaded,
        num_blocks=blocks,
        backend=args.backend,
        cuda_graphs=not args.no_cuda_graphs,
        max_graph_chunk=args.graph_chunk_tokens,
        max_graph_chunks=args.graph_chunks,
    )
    if args.prefill_launch != "device":  # before any graph is captured
        from dataclasses import replace

        from ds4pool.model.kernels import triton_attention as ta

        launch = ta.DEEP_PREFILL if args.prefill_launch == "deep" else ta.DEFAULT_PREFILL
        # forced, but with triton-small's small tile kept
        small_m = runner.backend.prefill_launch.small_m  # type: ignore[union-attr]
        runner.backend.prefill_launch = replace(launch, small_m=small_m)  # type: ignore[union-attr]
    print(f"prefill launch: {getattr(runner.backend, 'prefill_launch', None)}")
    for b in args.batch:
        pool = BlockPool(runner.num_blocks)
        tables = [BlockTable(16) for _ in range(b)]
        for t in tables:
            t.ensure(pool, args.prompt_len + 40)
        n = args.prompt_len

        def seqs(n: int, tables: list[BlockTable] = tables) -> list[SeqInput]:
            return [
                SeqInput([7], n, t.blocks, seq_id=i + 1, table_epoch=t.epoch)
                for i, t in enumerate(tables)
            ]

        for _ in range(3):
            runner.step(seqs(n))
            n += 1
        steps = []
        for _ in range(20):
            t0 = time.perf_counter()
            runner.step(seqs(n))
            steps.append((time.perf_counter() - t0) * 1e3)
            n += 1
        graphs = runner.graphs
        replay = []
        if graphs is not None:
            bucket = graphs.bucket_for(b)
            assert bucket is not None
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                graphs.replay(bucket, n)
                end.record()
                end.synchronize()
                replay.append(start.elapsed_time(end))
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runner.step(seqs(n))
                n += 1
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        kernels = sum(e.count for e in events) / 3
        print(f"\n## batch {b}: step {statistics.median(steps):.2f} ms, ", end="")
        if replay:
            print(f"graph replay {statistics.median(replay):.2f} ms, ", end="")
        print(f"{kernels:.0f} kernels per step")
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        print("| kernel | calls/step | µs/step |")
        print("|---|---:|---:|")
        for e in events[: args.top]:
            print(f"| {e.key[:90]} | {e.count / 3:.0f} | {e.device_time_total / 3:.0f} |")
        for chunk in args.mixed:
            for ctx in args.mixed_ctx:
                for count in args.mixed_chunks:
                    profile_mixed(runner, pool, seqs(n), chunk, ctx, args.top, count, args.trace)
        for t in tables:
            t.release(pool)


def kernel_table(prof: profile, steps: int, top: int) -> tuple[float, float]:
    """Prints the top kernels; returns (kernels, device ms) per step."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / steps
    device_ms = sum(e.device_time_total for e in events) / steps / 1e3
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    print("| kernel | calls/step | µs/step |")
    print("|---|---:|---:|")
    for e in events[:top]:
        print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.device_time_total / steps:.0f} |")
    return kernels, device_ms


def idle_gaps(
    kernels: list[tuple[float, float, str]], top: int
) -> tuple[float, float, list[tuple[float, str, str]]]:
    """Device kernels as (start, end, name) in µs -> (span from the first kernel's start to
    the last one's end, the time inside it no kernel ran, the `top` longest gaps as
    (µs, kernel before, kernel after))."""
    if not kernels:
        return 0.0, 0.0, []
    kernels = sorted(kernels)
    idle, gaps, end, before = 0.0, [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            idle += start - end
            gaps.append((start - end, before, name))
        if stop >= end:
            end, before = stop, name
    gaps.sort(key=lambda g: g[0], reverse=True)
    return end - kernels[0][0], idle, gaps[:top]


def gap_table(prof: profile, steps: int, top: int) -> None:
    """Where the device waited inside the profiled steps (the largest gap is usually the one
    between two steps: the sampled tokens' readback and the next step's host preparation)."""
    kernels = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    ]
    span, idle, gaps = idle_gaps(kernels, top)
    print(
        f"timeline: {span / steps / 1e3:.2f} ms per step from first to last kernel, "
        f"{idle / steps / 1e3:.2f} ms of it idle"
    )
    print("| gap µs | after kernel | before kernel |")
    print("|---:|---|---|")
    for gap, before, after in gaps:
        print(f"| {gap:.0f} | {before[:50]} | {after[:50]} |")


def profile_mixed(
    runner: ModelRunner,
    pool: BlockPool,
    decoders: list[SeqInput],
    chunk: int,
    ctx: int,
    top: int,
    count: int = 1,
    trace: str | None = None,
) -> None:
    """One mixed step: the decoders plus `count` prompt chunks of `chunk` tokens at `ctx`
    (a mixed-step graph where it fits: one chunk, or up to --graph-chunks; else eager)."""
    tables = [BlockTable(16) for _ in range(count)]
    for table in tables:
        table.ensure(pool, ctx + chunk)
    ids = [(7 * i) % runner.loaded.config.vocab_size for i in range(chunk)]
    step = [*decoders, *(SeqInput(ids, ctx, t.blocks, sample=False) for t in tables)]
    for _ in range(2):
        runner.step(step)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(step)
        times.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            runner.step(step)
    what = f"a {chunk}-token chunk" if count == 1 else f"{count} chunks of {chunk} tokens"
    how = "eager" if runner.launches_eagerly(step) else "graph replay"
    print(f"\n## mixed: {len(decoders)} decoders + {what} at context {ctx} ({how})")
    kernels, device_ms = kernel_table(prof, 2, top)
    gap_table(prof, 2, top)
    if trace:
        prof.export_chrome_trace(f"{trace}/mixed_{len(decoders)}_{count}x{chunk}.json")
    host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print("| host op | calls/step | self µs/step |")
    print("|---|---:|---:|")
    for e in host[:top]:
        print(f"| {e.key[:60]} | {e.count / 2:.0f} | {e.self_cpu_time_total / 2:.0f} |")
    print(
        f"step {statistics.median(times):.2f} ms, kernels {device_ms:.2f} ms "
        f"({kernels:.0f} per step)"
    )
    for table in tables:
        table.release(pool)


if __name__ == "__main__":
    main()
