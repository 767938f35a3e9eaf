"""The add + RMSNorm + router linear before a sparse block: one launch vs two, by launch config.

    python3 bench/moe_gate.py --model random:qwen3-30b-a3b --tokens 1 8 64

Times, per step size T, `kernels/triton_moe_gate.add_norm_logits` at each (BLOCK_E, warps)
against the two launches it replaces (triton_fused.rms_norm with the residual, then F.linear:
cuBLAS), µs per layer, each captured for `--layers` distinct layers (distinct router weights,
more bytes than the L2 holds, as a decode step sees them) in one CUDA graph and timed over its
replays with CUDA events. Prints a table and the best configuration per T. CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model.demo import preset_config  # noqa: E402
from ds4pool.model.kernels.triton_fused import rms_norm  # noqa: E402
from ds4pool.model.kernels.triton_moe_gate import add_norm_logits  # noqa: E402

BLOCK_ES = (1, 2, 4, 8, 16)
WARPS = (1, 2, 4, 8)


def graph_us(fn: Callable[[int], None], layers: int, replays: int, repeats: int = 3) -> float:
    """µs per layer of fn(layer) for every layer, captured in one CUDA graph (after one eager
    pass on a side stream: compiles and warm-up), timed over `replays` with CUDA events; the
    best of `repeats` such timings. bench/moe_layer.py times its blocks with it too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * layers))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--layers", type=int, default=192, help="distinct router weights a graph")
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_gate.py needs a CUDA GPU")
    cfg = preset_config(args.model.removeprefix("random:"))
    if cfg.moe is None:
        raise SystemExit(f"{args.model} is not a mixture-of-experts model")
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, experts = cfg.hidden_size, cfg.moe.num_experts
    gen = torch.Generator(device=dev).manual_seed(0)
    routers = [
        (torch.randn(experts, hidden, device=dev, generator=gen) * 0.02).to(dt)
        for _ in range(args.layers)
    ]
    norm_w = torch.ones(hidden, device=dev, dtype=dt)
    configs = list(itertools.product(BLOCK_ES, WARPS))
    print(
        f"# {args.model}: hidden {hidden}, {experts} experts; {torch.cuda.get_device_name(dev)}; "
        f"{args.layers} layers a graph, µs per layer"
    )
    print("| T | two launches | " + " | ".join(f"E{b} w{w}" for b, w in configs) + " | best |")
    print("|---:|---:|" + "---:|" * (len(configs) + 1))
    for t in args.tokens:
        a = torch.randn(t, hidden, device=dev, generator=gen).to(dt)
        res = torch.randn(t, hidden, device=dev, generator=gen).to(dt)
        cells = row_us(a, res, norm_w, routers, configs, args.replays)
        best = min(range(len(configs)), key=lambda j: cells[j + 1])
        b, w = configs[best]
        print(f"| {t} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | E{b} w{w} |", flush=True)


def row_us(
    a: torch.Tensor,
    res: torch.Tensor,
    norm_w: torch.Tensor,
    routers: list[torch.Tensor],
    configs: list[tuple[int, int]],
    replays: int,
) -> list[float]:
    """[two launches, then each (BLOCK_E, warps)], µs per layer."""

    def two(i: int) -> None:
        h = rms_norm(a, norm_w, 1e-6, residual=res)  # in place: values drift, time not
        F.linear(h, routers[i])

    cells = [graph_us(two, len(routers), replays)]
    for block_e, warps in configs:

        def one(i: int, b: int = block_e, w: int = warps) -> None:
            add_norm_logits(a, res, norm_w, 1e-6, routers[i], block_e=b, num_warps=w)

        cells.append(graph_us(one, len(routers), replays))
    return cells


if __name__ == "__main__":
    main()
