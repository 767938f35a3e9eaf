"""The decode projections at 1-16 rows: cuBLAS(Lt) against the skinny Triton GEMM
(model/kernels/triton_linear.py), in CUDA graphs as a decode step runs them.

    python3 bench/linear.py                      # the table's configs (and cuBLAS)
    python3 bench/linear.py --sweep --emit t.json

Per weight shape (K → N: the 8B Llama's and Qwen3-30B-A3B's projections, `--shapes`) and row
count, `--copies` distinct bf16 weights (enough that no call finds its weight in L2: at
least `--min-mb` of them in all) are each multiplied once inside one CUDA graph, timed
over replays with CUDA events (bench/moe_gate.graph_us): µs a call and the weight bytes
over it in TB/s, next to the device's copy bandwidth. `--sweep` times the candidates of
triton_linear_configs.sweep_configs (tile shapes first, then warps x stages for the best
two), prints the winner of each (shape, rows) against cuBLAS, and `--emit` writes the
winners that beat cuBLAS by more than `--margin` into SKINNY_TABLE (the shapes and buckets it
timed replaced, the others kept) as a table that `DS4POOL_SKINNY_TABLE` loads, and prints
the timed shapes' rows ready to paste. Checks every timed config against
cuBLAS's result first (bf16: within 2e-2 relative of the row's largest value).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import copy_bandwidth  # noqa: E402
from bench.moe_gate import graph_us  # noqa: E402
from ds4pool.model.device import select_blas  # noqa: E402
from ds4pool.model.kernels.triton_linear import SkinnyWorkspace, skinny_linear  # noqa: E402
from ds4pool.model.kernels.triton_linear_configs import (  # noqa: E402
    ROW_BUCKETS,
    SKINNY_TABLE,
    SkinnyConfig,
    Table,
    config_for,
    sweep_configs,
    sweep_schedules,
    table_to_json,
)

# name → (K, N): the projections a decode step of each preset runs
SHAPES = {
    "8b.qkv": (4096, 6144),
    "8b.o": (4096, 4096),
    "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
    "30b-a3b.qkv": (2048, 5120),
    "30b-a3b.o": (4096, 2048),
    "8b.lm_head": (4096, 128256),
    "30b-a3b.lm_head": (2048, 151936),
}
DEFAULT_SHAPES = tuple(SHAPES)


class Case:
    """`copies` distinct [N, K] weights and one [rows, K] input on the device."""

    def __init__(self, k: int, n: int, rows: int, min_mb: float, dtype: torch.dtype) -> None:
        self.k, self.n, self.rows = k, n, rows
        self.bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(4, int(min_mb * 2**20 / self.bytes) + 1)
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [
            (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
            for _ in range(copies)
        ]
        self.x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)

    def us(self, fn, replays: int) -> float:  # noqa: ANN001 -- fn(x, weight)
        return graph_us(lambda i: fn(self.x, self.weights[i]), len(self.weights), replays)

    def tbs(self, us: float) -> float:
        return self.bytes / (us * 1e-6) / 1e12


def triton_fn(cfg: SkinnyConfig, ws: SkinnyWorkspace):  # noqa: ANN201
    return lambda x, w: skinny_linear(x, w, None, cfg, ws)


def checked(case: Case, cfg: SkinnyConfig, ws: SkinnyWorkspace) -> bool:
    ref = case.x @ case.weights[0].T
    try:
        got = skinny_linear(case.x, case.weights[0], None, cfg, ws)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: not a candidate
        print(f"#   skipped {cfg.label()}: {type(exc).__name__}", file=sys.stderr)
        return False
    scale = float(ref.float().abs().max())
    err = float((got.float() - ref.float()).abs().max())
    if err > 2e-2 * scale:
        print(f"#   WRONG {cfg.label()}: max err {err:.3g} of {scale:.3g}", file=sys.stderr)
        return False
    return True


def sweep_one(
    case: Case, ws: SkinnyWorkspace, replays: int, kinds: tuple[str, ...] = ("gemv", "dot")
) -> tuple[SkinnyConfig, float]:
    timed: dict[SkinnyConfig, float] = {}

    def us(cfg: SkinnyConfig) -> float:
        if cfg not in timed:
            timed[cfg] = case.us(triton_fn(cfg, ws), replays) if checked(case, cfg, ws) else 1e9
        return timed[cfg]

    candidates = [c for c in sweep_configs(case.rows) if ("dot" if c.dot else "gemv") in kinds]
    first = sorted(candidates, key=us)
    for cfg in first[:2]:
        for sched in sweep_schedules(cfg):
            us(sched)
    best = min(timed, key=timed.__getitem__)
    return best, timed[best]


def merged(table: Table, swept: dict[tuple[int, int, int], SkinnyConfig | None]) -> Table:
    """The table with each timed (shape, bucket) set to its winner, or removed where cuBLAS
    won: what `--emit` writes, so that a sweep of a few shapes keeps the others' rows."""
    out = {key: dict(entries) for key, entries in table.items()}
    for (n, k, rows), cfg in swept.items():
        row = out.setdefault((n, k), {})
        if cfg is None:
            row.pop(rows, None)
        else:
            row[rows] = cfg
    return {key: tuple(sorted(v.items())) for key, v in out.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROW_BUCKETS))
    ap.add_argument("--min-mb", type=float, default=400.0)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--blas", default="auto")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["gemv", "dot"],
        choices=["gemv", "dot"],
        help="--sweep: which candidates (fewer compiles)",
    )
    ap.add_argument("--emit", type=Path, help="write the sweep's winners as a JSON table")
    ap.add_argument("--margin", type=float, default=0.02, help="emit winners faster by this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/linear.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    select_blas(args.blas, device)
    ws = SkinnyWorkspace(device)
    bw = copy_bandwidth(device)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, blas {args.blas} "
        f"({torch.backends.cuda.preferred_blas_library()}), copy bandwidth {bw / 1e12:.2f} TB/s"
    )
    print(f"# command: python3 bench/linear.py {' '.join(sys.argv[1:])}")
    print(
        "| shape (K → N) | rows | cuBLAS µs (TB/s) | Triton µs (TB/s) | Triton / cuBLAS | config |"
    )
    print("|---|---:|---:|---:|---:|---|")
    swept: dict[tuple[int, int, int], SkinnyConfig | None] = {}  # (N, K, rows) → winner
    for name in args.shapes:
        k, n = SHAPES[name]
        for rows in args.rows:
            case = Case(k, n, rows, args.min_mb, torch.bfloat16)
            blas = case.us(lambda x, w: x @ w.T, args.replays)
            if args.sweep:
                cfg, us = sweep_one(case, ws, args.replays, tuple(args.kinds))
            else:
                found = config_for(n, k, rows, SKINNY_TABLE)
                cfg, us = found, (case.us(triton_fn(found, ws), args.replays) if found else 0.0)
            tri = f"{us:.1f} ({case.tbs(us):.2f})" if cfg else "—"
            ratio = f"{blas / us:.2f}×" if cfg else "—"
            print(
                f"| {name} {k} → {n} | {rows} | {blas:.1f} ({case.tbs(blas):.2f}) | {tri} | "
                f"{ratio} | {cfg.label() if cfg else 'cuBLAS (not in the table)'} |",
                flush=True,
            )
            swept[(n, k, rows)] = cfg if cfg is not None and us * (1 + args.margin) < blas else None
            del case
            torch.cuda.empty_cache()
    table = merged(SKINNY_TABLE, swept)
    print("\n# SKINNY_TABLE rows of the timed shapes (winners by more than the margin):")
    for n, k in sorted({(n, k) for n, k, _ in swept}):
        print(f"    ({n}, {k}): {table.get((n, k), ())!r},")
    if args.emit is not None:
        args.emit.write_text(table_to_json(table))
        print(f"# wrote {args.emit}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
