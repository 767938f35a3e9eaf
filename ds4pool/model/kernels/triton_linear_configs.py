"""Which decode projections take the skinny GEMM (triton_linear.py), with which tiles.

A table keyed by the weight's shape (N, K) and a row bucket (1, up to 4, up to 16 rows),
filled from one H200 run of `python3 bench/linear.py --sweep` (it times every candidate of
`sweep_configs` in CUDA graphs, each call reading a distinct weight as a decode step does,
next to cuBLASLt, and prints the winners that beat it as rows ready to paste). A shape or
bucket the table does not name stays on cuBLAS, as does every GPU but the one it was
measured on (`TABLE_DEVICE`). `DS4POOL_SKINNY_TABLE=<file>` replaces the table by a sweep's
JSON (`--emit`), `=0` turns the kernel off.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

MAX_ROWS = 16  # tl.dot's smallest tile; more rows than this go to cuBLAS
MAX_GEMV_ROWS = 4  # broadcast products of more rows than this need too many registers
ROW_BUCKETS = (1, 4, 16)
# The most rows whose projection fuses silu·mul or the add + norm (TritonOps; more rows run
# them in launches of their own, the projection still the skinny GEMM). Measured on the
# H200, Llama-3-8B step (docs/BENCHMARKS.md, session 26): batch 1 fused 4.21 ms, unfused
# 4.22; fused up to 4 rows, batch 2 and 4 took 6.11 and 6.26 ms against 4.52 and 4.55; at
# batch 8 the fused silu·mul made it 9.59 ms against 4.60 (and the add + norm's serial last
# program 11.1 against 4.8 in session 25).
FUSE_MAX_ROWS = 1


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """One (shape, row bucket)'s launch: BLOCK_N output columns a program, BLOCK_K a load,
    `split` strips of K, tl.dot tiles (rows padded to 16) or the one-row GEMV, and the
    compiler's num_warps / num_stages."""

    block_n: int
    block_k: int
    split: int = 1
    dot: bool = True
    warps: int = 4
    stages: int = 3
    # > 0: a grid of (SMs x waves) programs, each an equal share of the columns BLOCK_N at
    # a time (no wave of programs left half-empty at the end); 0: a program per BLOCK_N
    waves: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, not {value}")
        if self.dot and self.block_n < 16:
            raise ValueError(f"dot tiles need block_n >= 16, not {self.block_n}")
        if self.split < 1 or self.stages < 1 or self.waves < 0:
            raise ValueError(f"split and stages must be >= 1, waves >= 0: {self}")
        if self.waves and self.split > 1:
            raise ValueError(f"balanced programs (waves) do not split K: {self}")

    def label(self) -> str:
        kind = "dot" if self.dot else "gemv"
        waves = f" waves{self.waves}" if self.waves else ""
        return (
            f"{kind} n{self.block_n} k{self.block_k} s{self.split} w{self.warps} "
            f"st{self.stages}{waves}"
        )


# (N, K) → ((bucket, config), ...): a call takes its rows' bucket's config, cuBLAS where
# there is none. The winners of `python3 bench/linear.py --sweep` on the H200 (2026-12-02,
# docs/BENCHMARKS.md) by more than 2% over cuBLASLt, in CUDA graphs: the 8B Llama's and
# Qwen3-30B-A3B's projections (qkv, o, the 8B's gate_up and down, both LM heads).
Table = dict[tuple[int, int], tuple[tuple[int, SkinnyConfig], ...]]
TABLE_DEVICE = "NVIDIA H200"
SKINNY_TABLE: Table = {
    (2048, 4096): (  # Qwen3-30B-A3B o_proj
        (1, SkinnyConfig(2, 1024, dot=False, warps=4, stages=1)),
        (4, SkinnyConfig(32, 128, split=4, warps=4, stages=6)),
        (16, SkinnyConfig(32, 128, split=4, warps=4, stages=4)),
    ),
    (4096, 4096): (  # Llama-3-8B o_proj
        (1, SkinnyConfig(8, 1024, dot=False, warps=4, stages=1, waves=8)),
        (4, SkinnyConfig(64, 128, split=4, warps=4, stages=3)),
        (16, SkinnyConfig(32, 256, warps=2, stages=4)),
    ),
    (4096, 14336): (  # Llama-3-8B down_proj
        (1, SkinnyConfig(8, 1024, dot=False, warps=4, stages=1, waves=8)),
        (4, SkinnyConfig(64, 128, split=4, warps=4, stages=4)),
        (16, SkinnyConfig(64, 256, split=2, warps=4, stages=4)),
    ),
    (5120, 2048): ((1, SkinnyConfig(4, 512, dot=False, warps=4, stages=1)),),  # 30B-A3B qkv
    (6144, 4096): (  # Llama-3-8B qkv_proj
        (1, SkinnyConfig(2, 1024, dot=False, warps=4, stages=1)),
        (4, SkinnyConfig(32, 256, warps=2, stages=4)),
        (16, SkinnyConfig(32, 256, warps=2, stages=4)),
    ),
    (28672, 4096): ((1, SkinnyConfig(2, 1024, dot=False, warps=4, stages=1)),),  # 8B gate_up
    (128256, 4096): (  # Llama-3-8B LM head
        (1, SkinnyConfig(2, 1024, dot=False, warps=4, stages=1)),
        (4, SkinnyConfig(64, 128, warps=2, stages=4)),
        (16, SkinnyConfig(64, 128, warps=4, stages=4)),
    ),
    (151936, 2048): (  # Qwen3-30B-A3B LM head
        (1, SkinnyConfig(2, 1024, dot=False, warps=4, stages=1)),
        (4, SkinnyConfig(64, 128, warps=2, stages=4)),
        (16, SkinnyConfig(64, 128, warps=2, stages=4)),
    ),
}


def bucket(rows: int) -> int:
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    raise ValueError(f"{rows} rows is more than the skinny GEMM takes ({MAX_ROWS})")


def config_for(n: int, k: int, rows: int, table: Table) -> SkinnyConfig | None:
    """The config of rows' bucket for an [N, K] weight; None (cuBLAS) where the table has
    none: a bucket that did not beat cuBLAS in the sweep is not filled by its neighbour's."""
    if rows < 1 or rows > MAX_ROWS:
        return None
    return dict(table.get((n, k), ())).get(bucket(rows))


def table_to_json(table: Table) -> str:
    rows = [
        {"n": n, "k": k, "rows": most, **dataclasses.asdict(cfg)}
        for (n, k), entries in sorted(table.items())
        for most, cfg in entries
    ]
    return json.dumps(rows, indent=1)


def table_from_json(path: Path) -> Table:
    """A sweep's `--emit` file → a table (rows of one shape in bucket order)."""
    table: dict[tuple[int, int], list[tuple[int, SkinnyConfig]]] = {}
    for row in json.loads(path.read_text()):
        key = (int(row.pop("n")), int(row.pop("k")))
        most = int(row.pop("rows"))
        table.setdefault(key, []).append((most, SkinnyConfig(**row)))
    return {key: tuple(sorted(v, key=lambda e: e[0])) for key, v in table.items()}


# What the sweep tries: every tile shape at 4 warps first, then the best few under each
# schedule. GEMV tiles (broadcast products) up to MAX_GEMV_ROWS rows; programs by column
# block or balanced (`waves`).
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (128, 256, 512)
SWEEP_SPLIT = (1, 2, 4)
SWEEP_DOT_WAVES = (2, 4)
SWEEP_GEMV_N = (2, 4, 8, 16)
SWEEP_GEMV_K = (256, 512, 1024)
# one row: also long strips (more 16-byte loads in flight a thread), few columns a program
SWEEP_GEMV_LONG = ((1, 2048), (2, 2048), (4, 2048), (1, 4096), (2, 4096))
SWEEP_GEMV_WAVES = (2, 4, 8)
SWEEP_SCHEDULES = ((4, 3), (4, 6), (8, 4), (2, 4))  # dot: (warps, stages)
SWEEP_GEMV_WARPS = (2, 4, 8, 16)  # its loads are not pipelined: stages do not matter


def sweep_configs(rows: int) -> list[SkinnyConfig]:
    """The first round at `rows` rows."""
    shapes = [
        SkinnyConfig(n, k, s, True, 4, 4)
        for n, k, s in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_SPLIT)
    ]
    shapes += [
        SkinnyConfig(16, k, 1, True, 4, 4, waves=w)
        for k, w in itertools.product(SWEEP_BLOCK_K, SWEEP_DOT_WAVES)
    ]
    if rows <= MAX_GEMV_ROWS:
        gemv_k = SWEEP_GEMV_K if rows == 1 else SWEEP_GEMV_K[:2]
        shapes += [
            SkinnyConfig(n, k, s, False, 4, 1)
            for n, k, s in itertools.product(SWEEP_GEMV_N, gemv_k, (1, 2))
        ]
        shapes += [
            SkinnyConfig(n, k, 1, False, 4, 1, waves=w)
            for n, k, w in itertools.product(SWEEP_GEMV_N[:3], gemv_k, SWEEP_GEMV_WAVES)
        ]
        if rows == 1:
            shapes += [
                SkinnyConfig(n, k, s, False, w, 1)
                for (n, k), s, w in itertools.product(SWEEP_GEMV_LONG, (1, 2), (4, 8))
            ]
    return shapes


def sweep_schedules(cfg: SkinnyConfig) -> list[SkinnyConfig]:
    """The second round: one shape under each warps (x stages for tl.dot tiles)."""
    if not cfg.dot:
        return [dataclasses.replace(cfg, warps=w) for w in SWEEP_GEMV_WARPS]
    return [dataclasses.replace(cfg, warps=w, stages=st) for w, st in SWEEP_SCHEDULES]
