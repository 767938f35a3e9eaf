"""One layer's CPU decode attention (attention_cpu.paged_decode) per KV memory order, vs the
memory roofline of the same bytes.

    OMP_NUM_THREADS=1 python bench/cpu_attention_kernel.py --rows 16 --contexts 1000 3000

B decode rows at ~C tokens each (block ids in FIFO order: each row one run of blocks, as the
pool hands them out; with --prefix-blocks P the rows share their first P blocks, agents on
one system prompt: two runs each; with --interleave too, each row's own blocks lie between
the other rows', one run each, as a server's tables look once turns were written side by
side), for each head shape, these configurations:
- "main": the token-major cache [2, N, bs, H_kv, D], attention_cpu.MAX_RUNS = 1 (what main
  did before session 20: rows of one run in place, the others gathered; since session 27 a
  row's long first run stays in place under any MAX_RUNS);
- "token": the token-major cache, rows of up to MAX_RUNS runs in place;
- "head": the head-major cache (KVLayout.head_major: same shape, memory [2, H_kv, N, bs, D],
  the CPU default), rows of up to MAX_RUNS runs in place;
- "head-gathered": the head-major cache, MAX_RUNS = 1;
- with --before-ref REF, "before": attention_cpu.py as it was at git REF, head-major cache.
Several layers' caches are cycled so that each call reads cold memory, as a decode step
does. The configurations alternate round by round (a shared machine slows all alike); the
figure is the best round's CPU time of this thread per layer (1 thread) or wall time (more
threads), and the GB/s of K and V read per call (a shared prefix counted once per row) next
to a plain read (`sum`) and copy of the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model import attention_cpu  # noqa: E402
from ds4pool.model.attention_cpu import paged_decode  # noqa: E402
from ds4pool.model.kv_layout import KVLayout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (H_kv, G, D): KV heads, query heads per KV head, head dim
SHAPES = {"demo": (4, 2, 32), "m77": (4, 3, 64), "llama8b": (8, 4, 128)}


def module_at(ref: str) -> types.ModuleType:
    """ds4pool/model/attention_cpu.py as it was at git `ref`, as a module of its own."""
    path = "ds4pool/model/attention_cpu.py"
    src = subprocess.run(
        ["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    mod = types.ModuleType(f"attention_cpu_at_{ref}")
    exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)  # noqa: S102 (our own file)
    return mod


def best_time(fn: Callable[[], object], reps: int, cpu_clock: bool) -> float:
    clock = time.thread_time if cpu_clock else time.perf_counter
    best = float("inf")
    for _ in range(reps):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def one_shape(
    shape: tuple[int, int, int],
    ctx: int,
    args: argparse.Namespace,
    cpu_clock: bool,
    before: types.ModuleType | None = None,
) -> dict[str, float]:
    """Seconds per layer of each memory order, and the read / copy roofline in bytes/s."""
    h_kv, g, d = shape
    dtype = getattr(torch, args.dtype)
    bs = 16
    per_row = -(-ctx // bs)
    lens = [ctx - 7 * i for i in range(args.rows)]  # different lengths
    own = per_row - args.prefix_blocks
    prefix = torch.arange(args.prefix_blocks).expand(args.rows, -1)
    mine = torch.arange(own * args.rows).view(-1, own)  # row r: its own run
    if args.interleave:  # row r: blocks r, r + B, r + 2B, ... (one run each)
        mine = torch.arange(own * args.rows).view(own, -1).t()
    tables = torch.cat([prefix, args.prefix_blocks + mine], 1)
    num_blocks = args.prefix_blocks + own * args.rows
    caches = {}
    for order in ("token", "head"):
        layout = KVLayout(args.layers, num_blocks, bs, h_kv, d, dtype, 2, order == "head")
        caches[order] = layout.allocate(torch.device("cpu"))
        for c in caches[order]:
            c.copy_(torch.randn(c.shape, dtype=dtype))
    q = torch.randn(args.rows, h_kv * g, d, dtype=dtype)
    scale = d**-0.5
    want = paged_decode(q, caches["token"][0], tables, lens, scale)
    got = paged_decode(q, caches["head"][0].copy_(caches["token"][0]), tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()
    max_runs = attention_cpu.MAX_RUNS

    def step(layer_caches: list[torch.Tensor], runs: int) -> None:
        attention_cpu.MAX_RUNS = runs  # a bench-only switch, restored below
        try:
            for c in layer_caches:
                paged_decode(q, c, tables, lens, scale)
        finally:
            attention_cpu.MAX_RUNS = max_runs

    configs = {
        "main": ("token", 1),
        "token": ("token", max_runs),
        "head": ("head", max_runs),
        "head-gathered": ("head", 1),
    }
    fns = {name: functools.partial(step, caches[o], runs) for name, (o, runs) in configs.items()}
    if before is not None:
        assert torch.allclose(before.paged_decode(q, caches["head"][0], tables, lens, scale), want,
                              atol=tol, rtol=tol)  # fmt: skip
        fns["before"] = lambda: [
            before.paged_decode(q, c, tables, lens, scale) for c in caches["head"]
        ]
    res = {name: float("inf") for name in fns}
    for _ in range(args.rounds):  # alternate the configurations round by round
        for name, fn in fns.items():
            res[name] = min(res[name], best_time(fn, 1, cpu_clock) / args.layers)
    flat = torch.cat([c.flatten() for c in caches["token"]])
    out = torch.empty_like(flat)
    per_layer = flat.numel() * flat.element_size() / args.layers
    res["sum"] = per_layer / (best_time(flat.sum, args.rounds, cpu_clock) / args.layers)
    res["copy"] = per_layer / (
        best_time(functools.partial(out.copy_, flat), args.rounds, cpu_clock) / args.layers
    )
    res["kv_bytes"] = sum(lens) * 2 * h_kv * d * q.element_size()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--layers", type=int, default=4, help="caches cycled per call (cold reads)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefix-blocks", type=int, default=0, help="blocks every row shares")
    ap.add_argument(
        "--interleave", action="store_true", help="each row's own blocks between the others'"
    )
    ap.add_argument("--before-ref", help="also time attention_cpu.py as it was at this git ref")
    args = ap.parse_args()
    before = module_at(args.before_ref) if args.before_ref else None
    cpu_clock = torch.get_num_threads() == 1
    print(
        f"# cpu ({cpu_name()}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{args.rows} rows, {args.dtype}, best of {args.rounds} alternating rounds, "
        f"{'CPU' if cpu_clock else 'wall'} ms per layer"
    )
    print(
        f"# prefix blocks shared by every row: {args.prefix_blocks}, own blocks "
        f"{'interleaved' if args.interleave else 'one run'}; ms per layer (GB/s of KV read "
        "per call)"
    )
    extra = f" | before ({args.before_ref}) | before / head" if before else ""
    print(
        "| shape | context | main | token-major | head-major | head-major, runs gathered "
        f"| main / head{extra} | sum GB/s | copy GB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if before else "") + "---:|---:|")
    torch.manual_seed(0)
    for name in args.shapes:
        h_kv, g, d = SHAPES[name]
        for ctx in args.contexts:
            r = one_shape(SHAPES[name], ctx, args, cpu_clock, before)
            cells = [
                f"{r[c] * 1e3:.2f} ({r['kv_bytes'] / r[c] / 1e9:.1f})"
                for c in ("main", "token", "head", "head-gathered")
            ]
            cells.append(f"{r['main'] / r['head']:.2f}x")
            if before:
                cells.append(f"{r['before'] * 1e3:.2f} ({r['kv_bytes'] / r['before'] / 1e9:.1f})")
                cells.append(f"{r['before'] / r['head']:.2f}x")
            print(
                f"| {name} (H_kv {h_kv}, G {g}, D {d}) | {ctx} | "
                + " | ".join(cells)
                + f" | {r['sum'] / 1e9:.1f} | {r['copy'] / 1e9:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
