"""Host time to build a step's metadata: the lists of ints a step's tensors start from, into
CPU tensors by torch.tensor() or by numpy (`device.host_ints`), side by side in one run.

    python bench/host_metadata.py [--decodes 24] [--chunks 8] [--chunk 243] [--context 2900]

The default shape is run L's wave step (docs/BENCHMARKS.md): 24 decode rows next to 8 prompt
chunks of 243 tokens over ~2.9k-token contexts, the step an eager launch or a several-chunk
mixed graph (`MixedBatch.load`) prepares on the host before its device work can start. Prints
the median of each conversion, then the whole `build_metadata` and `MixedBatch.load` as the
code runs them now, then the slot indices of a session's KV move (demotion, restore) built
the old way and by `KVLayout.slot_tensor`. CPU only; the host work is the same in front of a
GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model.attention import build_metadata  # noqa: E402
from ds4pool.model.device import host_ints  # noqa: E402
from ds4pool.model.input_batch import DecodeRow  # noqa: E402
from ds4pool.model.kv_layout import KVLayout  # noqa: E402
from ds4pool.model.mixed_batch import ChunkRow, MixedBatch, MixedShape  # noqa: E402

BS = 16


def median_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=24)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=243)
    ap.add_argument("--context", type=int, default=2900)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--session-tokens", type=int, default=30000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    per = -(-(args.context + args.chunk) // BS)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(args.decodes + args.chunks)]
    q = [1] * args.decodes + [args.chunk] * args.chunks
    ctx = [args.context + 1] * args.decodes + [args.context + args.chunk] * args.chunks
    positions = [p for n, c in zip(q, ctx) for p in range(c - n, c)]
    slots = [t[p // BS] * BS + p % BS for n, c, t in zip(q, ctx, tables) for p in range(c - n, c)]
    padded = [t + [0] * (per - len(t)) for t in tables]
    four = [positions, slots, positions, slots]
    cases = [
        (f"positions ({len(positions):,})", positions, torch.int64),
        ("4 rows of them, one tensor", four, torch.int64),
        (f"block tables ({len(padded)} x {per})", padded, torch.int32),
    ]
    print(f"## {args.decodes} decode rows + {args.chunks} chunks of {args.chunk} at {args.context}")
    print("| list -> CPU tensor | torch.tensor (µs) | host_ints (µs) | ratio |")
    print("|---|---:|---:|---:|")
    for name, values, dtype in cases:
        a = median_us(lambda v=values, d=dtype: torch.tensor(v, dtype=d), args.repeat)
        b = median_us(lambda v=values, d=dtype: host_ints(v, d), args.repeat)
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x |")

    cpu = torch.device("cpu")
    layout = KVLayout(1, len(tables) * per + 1, BS, 8, 128, torch.bfloat16)
    mixed = MixedBatch(layout, 64, 2048, per, cpu, torch.int32, None, max_chunks=args.chunks)
    decodes = [DecodeRow(5, args.context, tables[i], i + 1) for i in range(args.decodes)]
    chunk_rows = [
        ChunkRow([7] * args.chunk, args.context, tables[args.decodes + j], 1000 + j)
        for j in range(args.chunks)
    ]
    total = args.chunks * args.chunk
    shape = MixedShape(args.decodes, next(b for b in (256, 512, 1024, 2048, total) if b >= total))
    sampled = list(range(args.decodes + args.chunks))
    built = median_us(lambda: build_metadata(q, ctx, tables, BS, cpu, None, torch.int32), 200)
    loaded = median_us(lambda: mixed.load(decodes, chunk_rows, sampled, shape), 200)
    print("\n| whole step, as the code runs now | µs |")
    print("|---|---:|")
    print(f"| build_metadata (eager step) | {built:,.0f} |")
    print(f"| MixedBatch.load (several-chunk graph) | {loaded:,.0f} |")

    # a session's KV move (kv/transfer.py): the slots of every token it copies
    n = args.session_tokens
    move = KVLayout(1, -(-n // BS) + 1, BS, 8, 128, torch.bfloat16)
    blocks = list(range(-(-n // BS)))
    listed = median_us(lambda: torch.tensor(move.slots(blocks, 0, n), device=cpu), 50)
    computed = median_us(lambda: move.slot_tensor(blocks, 0, n, cpu), 50)
    print(f"\n| slots of a {n:,}-token KV move | µs |")
    print("|---|---:|")
    print(f"| list of every slot -> torch.tensor (before) | {listed:,.0f} |")
    print(f"| KVLayout.slot_tensor (now) | {computed:,.0f} |")

    # reading one block's tokens out of the CPU's head-major cache (a permuted view): what a
    # copy-on-write and a demotion do per layer (kv/transfer.py)
    pool = KVLayout(1, 8191, BS, 4, 32, torch.float32, head_major=True)  # a demo layer
    view = pool.token_view(pool.allocate(cpu)[0])
    block = pool.slot_tensor([5], 0, BS, cpu)
    by_select = median_us(lambda: view.index_select(1, block), 5)
    by_index = median_us(lambda: view[:, block], 50)
    print("\n| one block out of a head-major layer (one of the demo pool's 4, 134 MB) | µs |")
    print("|---|---:|")
    print(f"| index_select (before) | {by_select:,.0f} |")
    print(f"| indexing (now) | {by_index:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
