"""F.linear vs oneDNN prepacked weights (model/cpu_linear.py) on CPU: one GEMM per shape,
single thread, and the RSS of a model before and after packing its projections.

    python3 bench/cpu_linear.py [--model /tmp/m77]
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

from ds4pool.model.cpu_linear import pack_cpu_linears  # noqa: E402
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
