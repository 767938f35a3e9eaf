"""One layer's CPU decode attention (attention_cpu.paged_decode) per KV memory order, vs the
memory roofline of the same bytes.

    OMP_NUM_THREADS=1 python bench/cpu_attention_kernel.py --rows 16 --contexts 1000 3000

B decode rows at ~C tokens each (block ids in FIFO order: each row one run of blocks, as the
pool hands them out), for each head shape: the token-major cache [2, N, bs, H_kv, D] and the
head-major one (KVLayout.head_major: same shape, memory [2, H_kv, N, bs, D]). Several layers'
caches are cycled so that each call reads cold memory, as a decode step does. The orders
alternate round by round (a shared machine slows both alike); the figure is the best round's
CPU time of this thread per layer (1 thread) or wall time (more threads), and the GB/s of K
and V read per call next to a plain read (`sum`) and copy of the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.attention_cpu import paged_decode  # noqa: E402
from ds4pool.model.kv_layout import KVLayout  # noqa: E402

# (H_kv, G, D): KV heads, query heads per KV head, head dim
SHAPES = {"demo": (4, 2, 32), "m77": (4, 3, 64), "llama8b": (8, 4, 128)}


def best_time(fn: Callable[[], object], reps: int, cpu_clock: bool) -> float:
    clock = time.thread_time if cpu_clock else time.perf_counter
    best = float("inf")
    for _ in range(reps):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--layers", type=int, default=4, help="caches cycled per call (cold reads)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cpu_clock = torch.get_num_threads() == 1
    print(
        f"# cpu ({cpu_name()}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{args.rows} rows, {args.dtype}, best of {args.rounds} alternating rounds, "
        f"{'CPU' if cpu_clock else 'wall'} ms per layer"
    )
    print("| shape | context | token-major ms (GB/s) | head-major ms (GB/s) | speedup | sum GB/s | copy GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    bs = 16
    for name in args.shapes:
        h_kv, g, d = SHAPES[name]
        for ctx in args.contexts:
            per_row = -(-ctx // bs)
            lens = [ctx - 7 * i for i in range(args.rows)]  # different lengths, one run each
            tables = torch.arange(per_row * args.rows).view(args.rows, per_row)
            caches = {}
            for head_major in (False, True):
                layout = KVLayout(args.layers, per_row * args.rows, bs, h_kv, d, dtype, 2, head_major)
                caches[head_major] = layout.allocate(torch.device("cpu"))
                for c in caches[head_major]:
                    c.copy_(torch.randn(c.shape, dtype=dtype))
            q = torch.randn(args.rows, h_kv * g, d, dtype=dtype)
            scale = d**-0.5
            want = paged_decode(q, caches[False][0], tables, lens, scale)
            got = paged_decode(q, caches[True][0].copy_(caches[False][0]), tables, lens, scale)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()
            times: dict[bool, float] = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for head_major, layer_caches in caches.items():

                    def step(layer_caches: list[torch.Tensor] = layer_caches) -> None:
                        for c in layer_caches:
                            paged_decode(q, c, tables, lens, scale)

                    t = best_time(step, 1, cpu_clock) / args.layers
                    times[head_major] = min(times[head_major], t)
            kv_bytes = sum(lens) * 2 * h_kv * d * q.element_size()
            flat = torch.cat([c.flatten() for c in caches[False]])
            out = torch.empty_like(flat)
            per_layer = flat.numel() * flat.element_size() / args.layers
            t_sum = best_time(flat.sum, args.rounds, cpu_clock) / args.layers
            t_copy = best_time(lambda: out.copy_(flat), args.rounds, cpu_clock) / args.layers
            tok, head = times[False], times[True]
            print(
                f"| {name} (H_kv {h_kv}, G {g}, D {d}) | {ctx} | {tok * 1e3:.2f} "
                f"({kv_bytes / tok / 1e9:.1f}) | {head * 1e3:.2f} ({kv_bytes / head / 1e9:.1f}) "
                f"| {tok / head:.2f}x | {per_layer / t_sum / 1e9:.1f} | "
                f"{per_layer / t_copy / 1e9:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
