"""F.linear vs oneDNN prepacked weights (model/cpu_linear.py) on CPU: one GEMM per shape,
single thread, and the RSS of a model before and after packing its projections.

    python3 bench/cpu_linear.py [--model /tmp/m77]
    python3 bench/cpu_linear.py --rss-rows 600 [--raw]

--rss-rows N: the RSS of one 768 x 4096 packed linear called once with each row count 1..N
(oneDNN caches a primitive per input shape), through PackedLinear's row buckets, or with
--raw through the bare op; then µs per call at a few row counts, bucketed next to exact.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model.cpu_linear import (  # noqa: E402
    ROW_CAP,
    PackedLinear,
    pack_cpu_linears,
    row_bucket,  # noqa: E402
)
from ds4pool.model.loader import load_model  # noqa: E402

SHAPES = [(1, 768, 1280), (1, 768, 4096), (1, 2048, 768), (16, 768, 4096), (256, 768, 4096)]


def seconds(f: Callable[[], object], reps: int = 100) -> float:
    for _ in range(10):
        f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="also measure RSS around packing this model")
    ap.add_argument("--rss-rows", type=int, default=0, help="only: RSS over row counts 1..N")
    ap.add_argument("--raw", action="store_true", help="--rss-rows through the bare op")
    args = ap.parse_args()
    if args.rss_rows:
        rss_over_rows(args.rss_rows, args.raw)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print("| M × K × N | F.linear µs | packed hint 1 µs | packed hint 16 µs |")
    print("|---|---:|---:|---:|")
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        cells = [seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w))]
        for hint in (1, 16):
            pw = torch.ops.mkldnn._reorder_linear_weight(w, hint)
            op = torch.ops.mkldnn._linear_pointwise
            cells.append(seconds(lambda x=x, pw=pw, op=op: op(x, pw, None, "none", [], "")))
        print(f"| {m} × {k} × {n} | " + " | ".join(f"{c * 1e6:.0f}" for c in cells) + " |")
    if args.model:
        torch.set_num_threads(threads)
        cpu = torch.device("cpu")
        loaded = load_model(args.model, cpu, torch.float32)
        gc.collect()
        before = rss_mb()
        impl = pack_cpu_linears(loaded.model, "onednn", cpu, torch.float32)
        gc.collect()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        print(
            f"# {impl}: RSS {before:.0f} MB after load, {rss_mb():.0f} MB after packing, "
            f"peak {peak:.0f} MB"
        )


def op_seconds(op: Callable[..., torch.Tensor], rows: torch.Tensor, w: torch.Tensor) -> float:
    return best_of(lambda: op(rows, w, None, "none", [], ""))


def best_of(f: Callable[[], object], rounds: int = 5) -> float:
    """The fastest of `rounds` means of 10 calls: this VM's other jobs only add time."""
    return min(seconds(f, 10) for _ in range(rounds))


def rss_over_rows(n: int, raw: bool) -> None:
    lin = torch.nn.Linear(768, 4096, bias=False)
    packed = PackedLinear(lin)
    del lin
    op = torch.ops.mkldnn._linear_pointwise
    x = torch.randn(max(n, 512), 768)

    def call(rows: torch.Tensor) -> torch.Tensor:
        if raw:
            return op(rows, packed.weight, None, "none", [], "")
        return packed(rows)

    # the dense weight freed above raises glibc's mmap threshold past the outputs' sizes, as
    # packing a model does: outputs then come from the heap, where the primitives made between
    # them fragment it (the raw op's RSS grows with the square of the row count)
    with torch.no_grad():
        call(x[:1])
        gc.collect()
        before = rss_mb()
        for m in range(1, n + 1):
            call(x[:m])
            if m % 100 == 0 or m == n:
                print(f"# rows 1..{m}: RSS +{rss_mb() - before:.0f} MB", flush=True)
        print(f"{'raw op' if raw else 'buckets'}: RSS {before:.0f} -> {rss_mb():.0f} MB")
        print("| rows | bucket | op on rows µs | op on bucket rows µs | PackedLinear µs |")
        print("|---:|---:|---:|---:|---:|")
        for m in (1, 9, 16, 17, 33, 65, 129, 257, 512):
            b = row_bucket(m) if m <= ROW_CAP else ROW_CAP
            exact, at_bucket = (op_seconds(op, x[:k].contiguous(), packed.weight) for k in (m, b))
            rows = x[:m].contiguous()
            cells = (exact, at_bucket, best_of(lambda r=rows: packed(r)))
            print(f"| {m} | {b} | " + " | ".join(f"{c * 1e6:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
