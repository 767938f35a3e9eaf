"""CPU decode throughput with the reference (gathering) attention vs attention_cpu, A/B.

    python bench/cpu_attention.py --model demo --batch 1 16 --prompt-len 1500 --steps 16

Same workload as bench/decode.py (B prompts prefilled untimed, then timed greedy decode
steps of all B), but both attention paths run on one model and one runner, alternating
round by round, so that a busy machine slows both alike: compare the ratios, not the
absolute numbers. "cpu" is TorchPagedAttention's default on CPU (attention_cpu), "gather"
is `cpu_kernels=False` (the reference path, the oracle in tests).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import bench_batch  # noqa: E402

from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.attention import TorchPagedAttention  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner  # noqa: E402

PATHS = {"gather": False, "cpu": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    device = torch.device("cpu")
    loaded = load_model(args.model, device, torch.float32)
    backends = {m.backend for m in loaded.model.modules() if hasattr(m, "backend")}
    assert len(backends) == 1, "one backend instance shared by every layer"
    backend = backends.pop()
    assert isinstance(backend, TorchPagedAttention)
    bs = 16
    per_seq = -(-(args.prompt_len + args.steps + 2) // bs)
    runner = ModelRunner(loaded, num_blocks=per_seq * max(args.batch) + 1, block_size=bs)
    print(
        f"# {args.model} on cpu ({cpu_name()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, prompt {args.prompt_len}, steps {args.steps}, "
        f"{args.rounds} alternating rounds, median"
    )
    tps: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for name, flag in PATHS.items():
                backend.cpu_kernels = flag
                tps.setdefault((name, b), []).append(
                    bench_batch(runner, b, args.prompt_len, args.steps)
                )
    med = {key: statistics.median(v) for key, v in tps.items()}
    print("| batch | gather tok/s | cpu tok/s | cpu / gather |")
    print("|---:|---:|---:|---:|")
    for b in args.batch:
        g, c = med[("gather", b)], med[("cpu", b)]
        print(f"| {b} | {g:.1f} | {c:.1f} | {c / g:.2f}× |")
    if len(args.batch) > 1:
        lo, hi = min(args.batch), max(args.batch)
        for name in PATHS:
            ratio = med[(name, hi)] / med[(name, lo)]
            print(f"# {name}: batch {hi} tok/s = {ratio:.2f}× batch {lo} tok/s")


if __name__ == "__main__":
    main()
