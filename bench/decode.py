"""Decode throughput of the engine core at several batch sizes, next to the memory roofline.

    python bench/decode.py --model random:100m --batch 1 8 32
    python bench/decode.py --model random:llama3-8b --device cuda --batch 1 32 --roofline

Each batch size: B prompts of --prompt-len tokens are prefilled (untimed), then
--steps decode steps of all B sequences are timed, one forward per step (greedy).
The roofline is the fastest a decode step can be if it only had to read the weights
once: weight bytes / measured device copy bandwidth (KV reads ignored).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.kv.blocks import BlockPool, BlockTable  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.device import select_device, select_dtype  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def bench_batch(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Median-free simple timing: total wall time of `steps` decode steps (after 2 warm-up)."""
    pool = BlockPool(runner.num_blocks)
    vocab = runner.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    tables = [BlockTable(runner.block_size) for _ in range(batch)]
    last = []
    for table in tables:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        table.ensure(pool, prompt_len + steps + 2)
        out = runner.step([SeqInput(prompt, 0, table.blocks)])
        last.append(out.sampled[0])
    n = prompt_len
    elapsed = 0.0
    for i in range(steps + 2):
        seqs = [SeqInput([tok], n, t.blocks) for tok, t in zip(last, tables)]
        t0 = time.perf_counter()
        out = runner.step(seqs)  # ends with the readback of the sampled ids: synced
        if i >= 2:
            elapsed += time.perf_counter() - t0
        last = [int(x) for x in out.sampled]  # type: ignore[arg-type]
        n += 1
    for t in tables:
        t.release(pool)
    return batch * steps / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:100m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--roofline", action="store_true", help="measure copy bandwidth (GPU)")
    args = ap.parse_args()

    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device, dtype)
    load_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bs = 16
    per_seq = -(-(args.prompt_len + args.steps + 2) // bs)
    runner = ModelRunner(loaded, num_blocks=per_seq * max(args.batch) + 1, block_size=bs)
    bandwidth = copy_bandwidth(device) if args.roofline else None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"# {args.model} on {device} ({name}), {str(dtype).removeprefix('torch.')}, "
        f"{weight_bytes / 1e9:.2f} GB weights, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load {load_s:.1f}s, {date.today()}"
    )
    if bandwidth:
        print(
            f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s → weight-read floor "
            f"{weight_bytes / bandwidth * 1e3:.2f} ms/step"
        )
    header = "| batch | decode tok/s | ms/step |"
    sep = "|---:|---:|---:|"
    if bandwidth:
        header += " roofline tok/s | % of roofline |"
        sep += "---:|---:|"
    print(header)
    print(sep)
    for b in args.batch:
        tps = bench_batch(runner, b, args.prompt_len, args.steps)
        row = f"| {b} | {tps:.1f} | {b / tps * 1e3:.2f} |"
        if bandwidth:
            roof = b * bandwidth / weight_bytes
            row += f" {roof:.0f} | {100 * tps / roof:.0f}% |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
