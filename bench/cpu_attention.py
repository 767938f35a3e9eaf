"""CPU decode throughput: the reference (gathering) attention vs attention_cpu over either
KV memory order, A/B.

    python bench/cpu_attention.py --model demo --batch 1 16 --prompt-len 1500 --steps 16

Same workload as bench/decode.py (B prompts prefilled untimed, then timed greedy decode
steps of all B), but every configuration runs on one model, alternating round by round, so
that a busy machine slows all alike: compare the ratios, not the absolute numbers.
"gather" is `cpu_kernels=False` (the reference path, the oracle in tests) over the
token-major cache; "cpu" is attention_cpu over the token-major cache; "cpu-head" is
attention_cpu over the head-major cache (KVLayout.head_major, the CPU default). For an
older tree's code, run bench/decode.py from each tree (docs/BENCHMARKS.md, "head-major").
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

# name: (attention_cpu on, head-major KV memory)
PATHS = {"gather": (False, False), "cpu": (True, False), "cpu-head": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    args = ap.parse_args()

    device = torch.device("cpu")
    loaded = load_model(args.model, device, torch.float32)
    bs = 16
    per_seq = -(-(args.prompt_len + args.steps + 2) // bs)
    runners = {
        head_major: ModelRunner(
            loaded,
            num_blocks=per_seq * max(args.batch) + 1,
            block_size=bs,
            kv_head_major=head_major,
        )
        for head_major in (False, True)
    }
    backends = {m.backend for m in loaded.model.modules() if hasattr(m, "backend")}
    assert len(backends) == 1, "one backend instance shared by every layer"
    backend = backends.pop()
    assert isinstance(backend, TorchPagedAttention)
    print(
        f"# {args.model} on cpu ({cpu_name()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, prompt {args.prompt_len}, steps {args.steps}, "
        f"{args.rounds} alternating rounds, median"
    )
    tps: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for name in args.paths:
                kernels, head_major = PATHS[name]
                backend.cpu_kernels = kernels
                tps.setdefault((name, b), []).append(
                    bench_batch(runners[head_major], b, args.prompt_len, args.steps)
                )
    med = {key: statistics.median(v) for key, v in tps.items()}
    cols = " | ".join(f"{name} tok/s" for name in args.paths)
    ratios = [
        (a, b) for a, b in (("cpu", "gather"), ("cpu-head", "cpu")) if {a, b} <= set(args.paths)
    ]
    print(f"| batch | {cols} | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---:|" + "---:|" * (len(args.paths) + len(ratios)))
    for b in args.batch:
        cells = [f"{med[(name, b)]:.1f}" for name in args.paths]
        cells += [f"{med[(a, b)] / med[(c, b)]:.2f}×" for a, c in ratios]
        print(f"| {b} | " + " | ".join(cells) + " |")
    if len(args.batch) > 1:
        lo, hi = min(args.batch), max(args.batch)
        for name in args.paths:
            ratio = med[(name, hi)] / med[(name, lo)]
            print(f"# {name}: batch {hi} tok/s = {ratio:.2f}× batch {lo} tok/s")


if __name__ == "__main__":
    main()
