"""One sparse MoE layer alone, each expert path, by step size: where the decode kernels stop
winning (the `DECODE_MAX_PAIRS` crossover) and how close they read at the copy bandwidth.

    python3 bench/moe_layer.py --model random:qwen3-30b-a3b --tokens 1 2 4 8 16 32 64

Builds SparseMoeBlocks of the preset's shape (random N(0, 0.02) weights, bf16, on the GPU)
and, per step size T and path (`--experts`, default decode, grouped_mm, triton), captures one
forward of each of `--layers` such blocks (distinct weights: no expert stays in L2) in one
CUDA graph, as a decode step replays them, and times replays with CUDA events. Prints µs per
layer (router included), the distinct experts D(T) a layer read, and the expert bytes read
over that time (D(T) x one expert's bytes / µs) as GB/s and as a fraction of the measured
device copy bandwidth. The decode path's tile switch is `--decode-gemv-tokens`; `--route
gate_up separate` times it with the routing inside its gate_up launch and in a launch of
its own (model/moe.py ROUTE_IN_GATE_UP), a row each.

    python3 bench/moe_layer.py --sweep --tokens 1 2 4 8

times the decode path's launch configurations instead (model/kernels/triton_moe_configs.py):
per step size, every tile shape of each projection (the other at its default; GEMV or dot
tiles, chosen with gate_up's, at one or two tokens), then warps x stages for the best few,
and prints the best configuration of each step size as a row of `DECODE_CONFIGS`, ready to
paste, with its µs next to the default's. A configuration
the GPU cannot compile (shared memory) is skipped.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import copy_bandwidth  # noqa: E402
from bench.moe_gate import graph_us  # noqa: E402
from ds4pool.model.demo import preset_config  # noqa: E402
from ds4pool.model.kernels.triton_moe_configs import (  # noqa: E402
    DEFAULT,
    SWEEP_GEMV_TOKENS,
    DecodeConfig,
    sweep_gemv_shapes,
    sweep_schedules,
    sweep_shapes,
)
from ds4pool.model.moe import DECODE_ROUTES, SparseMoeBlock  # noqa: E402

SWEEP_FINALISTS = 3  # shapes of the first round whose warps x stages the second one tries


def layer_us(
    blocks: list[SparseMoeBlock], x: torch.Tensor, replays: int, repeats: int = 1
) -> float:
    """µs per layer: one forward of each block captured in one graph, timed over `replays`
    (distinct blocks, so the L2 cache holds no expert of the next one; the same input to
    each: its routing is of a real-scale token); the best of `repeats` such timings."""
    with torch.no_grad():
        return graph_us(lambda i: blocks[i](x), len(blocks), replays, repeats)


def sweep(
    blocks: list[SparseMoeBlock], x: torch.Tensor, replays: int
) -> tuple[DecodeConfig, float, float]:
    """(best config, its µs, the default's µs) of the decode path at x's step size: each
    projection in turn (gate_up first, then down with gate_up's winner), tile shapes first,
    then warps x stages of the best few."""
    timed: dict[DecodeConfig, float] = {}

    def us(config: DecodeConfig) -> float:
        if config not in timed:
            for b in blocks:
                b.decode_config = config
            try:
                timed[config] = layer_us(blocks, x, replays, repeats=3)
            except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: skip it
                print(f"#   skipped {config}: {type(exc).__name__}", file=sys.stderr)
                timed[config] = float("inf")
        return timed[config]

    best = DEFAULT
    gemvs = (False, True) if x.shape[0] <= SWEEP_GEMV_TOKENS else (False,)
    for proj in ("gate_up", "down"):
        base = best
        shapes = [
            replace(base, **{proj: tiles}, gemv=g if proj == "gate_up" else base.gemv)
            for tiles in sweep_shapes()
            for g in gemvs
        ]
        if (True in gemvs and proj == "gate_up") or (proj == "down" and base.gemv):
            shapes += [replace(base, **{proj: tiles}, gemv=True) for tiles in sweep_gemv_shapes()]
        finalists = sorted(shapes, key=us)[:SWEEP_FINALISTS]
        tried = [
            replace(f, **{proj: tiles})
            for f in finalists
            for tiles in sweep_schedules(getattr(f, proj))
        ]
        best = min([base, *tried], key=us)
    return best, us(best), us(DEFAULT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--experts", nargs="+", default=["decode", "grouped_mm", "triton"])
    ap.add_argument("--decode-gemv-tokens", type=int, default=None)
    ap.add_argument(
        "--route",
        nargs="+",
        default=["auto"],
        choices=tuple(DECODE_ROUTES),
        help="decode path: route inside the gate_up launch, in a launch of its own, or auto "
        "(one row each)",
    )
    ap.add_argument("--layers", type=int, default=8, help="blocks (1.2 GB each for the preset)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time the decode path's configurations")
    args = ap.parse_args()
    if any(t < 1 for t in args.tokens):
        raise SystemExit("--tokens must be >= 1")
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = preset_config(args.model.removeprefix("random:"))
    moe = cfg.moe
    if moe is None:
        raise SystemExit(f"{args.model} is not a mixture-of-experts model")
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = [SparseMoeBlock(moe, cfg.hidden_size).to(device, dtype) for _ in range(args.layers)]
    with torch.no_grad():
        for b in blocks:
            b.decode_gemv_tokens = args.decode_gemv_tokens
            for p in b.parameters():
                p.normal_(0.0, 0.02, generator=gen)
    expert_bytes = moe.expert_bytes(cfg.hidden_size, dtype.itemsize)
    bandwidth = copy_bandwidth(device)
    print(
        f"# {args.model}: one layer of {moe.num_experts} experts x {expert_bytes / 1e6:.2f} MB, "
        f"top-{moe.top_k}, hidden {cfg.hidden_size}; {torch.cuda.get_device_name(device)}, "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.layers} layers a graph"
    )
    if args.sweep:
        print("# DECODE_CONFIGS rows (most tokens, config), best per step size:")
        for t in args.tokens:
            x = torch.randn(t, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
            for b in blocks:
                b.impl = "decode"
            config, best_us, default_us = sweep(blocks, x, args.replays)
            print(
                f"    ({t}, {config}),  # {best_us:.1f} µs vs {default_us:.1f} default", flush=True
            )
        return
    print("| T | path | route | µs / layer | experts read | expert GB/s | % of copy bandwidth |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for t in args.tokens:
        x = torch.randn(t, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
        with torch.no_grad():  # mean distinct experts a layer reads at this T
            distinct = sum(int(torch.unique(b.gate(x)[1]).numel()) for b in blocks) / len(blocks)
        for impl in args.experts:
            routes = args.route if impl == "decode" else ["-"]  # the others route apart
            for route in routes:
                for b in blocks:
                    b.impl = impl
                    b.decode_route_in_gate_up = DECODE_ROUTES.get(route)
                us = layer_us(blocks, x, args.replays)
                rate = distinct * expert_bytes / (us * 1e-6)
                if route == "auto":
                    route = "gate_up" if blocks[0].routes_in_gate_up(t) else "separate"
                print(
                    f"| {t} | {impl} | {route} | {us:.1f} | {distinct:.1f} | {rate / 1e9:.0f} "
                    f"| {100 * rate / bandwidth:.0f}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
