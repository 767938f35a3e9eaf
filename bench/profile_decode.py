"""Where a decode step's time goes: whole step vs CUDA-graph replay vs the host, and the
kernels inside (torch.profiler sees the kernels of graph replays through CUPTI).

    python bench/profile_decode.py --model random:llama3-8b --batch 1 64
    python bench/profile_decode.py --batch 8 --mixed 128 512 --mixed-ctx 8192 16384
    python bench/profile_decode.py --batch 24 --prompt-len 3000 --mixed 243 --mixed-ctx 2900 \
        --mixed-chunks 1 8     # a burst of 8 resumed prompts of the agents workload
    python bench/profile_decode.py ... --backend triton-split   # decode rows: decode kernel

Prints per batch size: step ms (runner.step, incl. input upload, sampling and the one
readback), replay ms (the graph alone, CUDA events), kernels per step and the top kernels
by device time. With --mixed, also mixed steps: the batch's decoders next to one prompt
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
        help="prompt chunks in a mixed step, each count in turn (several: eager, as the "
        "agents' bursts)",
    )
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--backend",
        default="triton",
        help="attention backend (triton-split: mixed steps' decode rows in the decode kernel)",
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    loaded = load_model(args.model, device, torch.bfloat16)
    per_seq = -(-(args.prompt_len + 64) // 16)
    long_blocks = -(-(max(args.mixed_ctx) + max(args.mixed, default=0)) // 16) if args.mixed else 0
    long_blocks *= max(args.mixed_chunks)
    blocks = per_seq * max(args.batch) + long_blocks + 1
    runner = ModelRunner(
        loaded, num_blocks=blocks, backend=args.backend, cuda_graphs=not args.no_cuda_graphs
    )
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
                    profile_mixed(runner, pool, seqs(n), chunk, ctx, args.top, count)
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


def profile_mixed(
    runner: ModelRunner,
    pool: BlockPool,
    decoders: list[SeqInput],
    chunk: int,
    ctx: int,
    top: int,
    count: int = 1,
) -> None:
    """One mixed step: the decoders plus `count` prompt chunks of `chunk` tokens at `ctx`
    (one: a mixed-step graph where it fits; several run eagerly)."""
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
    print(f"\n## mixed: {len(decoders)} decoders + {what} at context {ctx}")
    kernels, device_ms = kernel_table(prof, 2, top)
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
