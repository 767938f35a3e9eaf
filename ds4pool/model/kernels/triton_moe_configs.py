"""Launch configurations of the MoE decode kernels (triton_moe_decode.py), by step size.

At 1-8 tokens a decode step's expert kernels are bound by parallelism and by the loads a
program keeps in flight, not by bandwidth (bench/moe_layer.py on the H200: one token's 8
experts at 30% of the copy bandwidth, two tokens' 15 at 60%). What helps there is a launch
question: the column tile (programs per expert), the K strip per load, warps and pipeline
stages, and split-K over the reduction (more programs for the same bytes; the partial sums
go to a float32 buffer that the next kernel adds up in a fixed order, so results stay
deterministic, no atomics). That is a small table keyed by the step's token count, filled
from one H200 run of `python3 bench/moe_layer.py --sweep` (it times `SWEEP` per token count
and prints the best row of each).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class ProjTiles:
    """One projection's launch: BLOCK_N output columns a program, BLOCK_K (None: the tile
    rule of triton_moe_decode._tiles, by dtype and rows), split_k programs along the
    reduction, and the compiler's num_warps / num_stages."""

    block_n: int
    block_k: int | None = None
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # weights by Hopper TMA (a tensor descriptor's box loads, which the pipeliner turns into
    # num_stages asynchronous copies in shared memory: more bytes in flight a program than
    # the pointer loads' registers hold) instead of pointer loads; the same sums either way
    tma: bool = False

    def __post_init__(self) -> None:
        # (GEMV tiles may be narrower than 16 columns: DecodeConfig checks the dot ones)
        for name, least in (("block_n", 1), ("block_k", 16)):
            value = getattr(self, name)
            if value is not None and (value < least or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= {least}, not {value}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1: {self}")


@dataclass(frozen=True)
class DecodeConfig:
    gate_up: ProjTiles  # over the hidden size, silu·mul in its epilogue (or the down's prologue)
    down: ProjTiles  # over the intermediate size; its split is summed by the combine
    # GEMV tiles (broadcast products, one row a token) instead of tl.dot's 16-row tiles;
    # None: by the kernels' GEMV_MAX_TOKENS (or the caller's gemv_max_tokens)
    gemv: bool | None = None

    def __post_init__(self) -> None:
        if not self.gemv and min(self.gate_up.block_n, self.down.block_n) < 16:
            raise ValueError(f"tl.dot tiles need block_n >= 16 (only GEMV tiles less): {self}")


# The configuration before any sweep (the H200's numbers in docs/BENCHMARKS.md were measured
# with it): 16 and 32 columns a program, no split.
DEFAULT = DecodeConfig(ProjTiles(16), ProjTiles(32))

# (most tokens, config): a step takes the first row that covers its token count, DEFAULT
# past the last. Replace rows with the winners of `bench/moe_layer.py --sweep` on the target
# GPU (each row is printed ready to paste).
# The H200 (2026-12-01, bench/moe_layer.py --sweep --tokens 1 2 4 8, Qwen3-30B-A3B shapes,
# bf16; µs a layer, best vs DEFAULT): 35.8 vs 38.3, 51.4 vs 58.3, 83.2 vs 93.4, 134.6 vs 149.2.
DECODE_CONFIGS: tuple[tuple[int, DecodeConfig], ...] = (
    # one token: GEMV tiles since 2026-12-02 (products accumulated along K, summed once:
    # bench/moe_layer.py --sweep --tokens 1, 34.2 µs vs 37.2 for DEFAULT in that run)
    (1, DecodeConfig(ProjTiles(16, 256, 1, 4, 3), ProjTiles(32, None, 1, 4, 3), gemv=True)),
    (2, DecodeConfig(ProjTiles(32, 128, 1, 4, 3), ProjTiles(64, 64, 1, 4, 3))),
    (4, DecodeConfig(ProjTiles(64, 128, 1, 4, 2), ProjTiles(64, 128, 1, 2, 2))),
    (8, DecodeConfig(ProjTiles(32, 128, 1, 2, 3), ProjTiles(64, 128, 1, 2, 3))),
)


def config_for(
    tokens: int, table: tuple[tuple[int, DecodeConfig], ...] = DECODE_CONFIGS
) -> DecodeConfig:
    for most, config in table:
        if tokens <= most:
            return config
    return DEFAULT


# What the sweep tries for each projection (the other one at its DEFAULT while it does), in
# two rounds to keep compiles few: the tile shapes at 4 warps and 3 stages (with GEMV and
# with dot tiles up to SWEEP_GEMV_TOKENS tokens), then warps and stages for the best few.
# Interpreter tests check every shape for correctness, GEMV and dot (warps and stages change
# the compiled code only, not the result).
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (64, 128, 256)
SWEEP_SPLIT_K = (1, 2, 4)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (2, 3, 4)
SWEEP_GEMV_TOKENS = 2
# GEMV-only tile shapes, tried where GEMV is (few columns a program, long K strips: the
# shapes that win for the dense projections' GEMV, triton_linear_configs.py)
SWEEP_GEMV_BLOCK_N = (2, 4, 8)
SWEEP_GEMV_BLOCK_K = (512, 1024)
# the second round tries each schedule with pointer loads and with TMA boxes (the first
# round's shapes are ranked with pointer loads: which shapes keep the SMs busy does not
# hinge on how a program fetches its tile)
SWEEP_TMA = (False, True)


def sweep_shapes() -> list[ProjTiles]:
    """The first round: every tile shape at the default warps and stages."""
    return [
        ProjTiles(n, k, s)
        for n, k, s in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_SPLIT_K)
    ]


def sweep_gemv_shapes() -> list[ProjTiles]:
    """More first-round shapes for GEMV configs (too narrow for tl.dot)."""
    return [
        ProjTiles(n, k, s)
        for n, k, s in itertools.product(SWEEP_GEMV_BLOCK_N, SWEEP_GEMV_BLOCK_K, SWEEP_SPLIT_K[:2])
    ]


def sweep_schedules(shape: ProjTiles) -> list[ProjTiles]:
    """The second round: one shape under each warps x stages x weight loads."""
    return [
        ProjTiles(shape.block_n, shape.block_k, shape.split_k, w, st, tma)
        for w, st, tma in itertools.product(SWEEP_WARPS, SWEEP_STAGES, SWEEP_TMA)
    ]
