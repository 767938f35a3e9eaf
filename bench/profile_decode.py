"""Where a decode step's time goes: whole step vs CUDA-graph replay vs the host, and the
kernels inside (torch.profiler sees the kernels of graph replays through CUPTI).

    python bench/profile_decode.py --model random:llama3-8b --batch 1 64

Prints per batch size: step ms (runner.step, incl. input upload, sampling and the one
readback), replay ms (the graph alone, CUDA events), kernels per step and the top kernels
by device time.
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
    args = ap.parse_args()
    device = torch.device("cuda")
    loaded = load_model(args.model, device, torch.bfloat16)
    per_seq = -(-(args.prompt_len + 64) // 16)
    runner = ModelRunner(loaded, num_blocks=per_seq * max(args.batch) + 1)
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
        for t in tables:
            t.release(pool)


if __name__ == "__main__":
    main()
