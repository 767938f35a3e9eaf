"""Launch configurations of the paged decode kernel (triton_attention.paged_decode), by shape.

A decode launch is chosen on the host from the graph's static shape: the batch bucket (rows,
padding included) and the block table's width in tokens, never from device values, so a
captured graph replays the launch it was captured with.

What may differ between shapes, and what may not. A row of <= SHORT_CONTEXT keys must give
the same bits in every batch it can be in (batched == solo: the same sequence decoded alone
runs at batch bucket 1 over a narrow table, in a batch at bucket 64 over a table as wide as
its longest neighbour). The order in which such a row's keys are summed is set by
- block_n: the online softmax's tiles (where the running max moves, and so how the bf16
  probabilities of the P·V dot round),
- short_piece: the split of a short row into pieces combined by the reduce kernel,
- num_warps: how the tile's row sums are spread over threads (the reduction tree),
so those three are ONE value for the whole table (`DecodeTable.block_n` etc.): a per-shape
choice would make a short row's output depend on its batch. num_stages only changes how far
ahead the K/V loads are issued, not the arithmetic, so it is chosen per shape. Rows longer
than SHORT_CONTEXT are split by `decode_partition_size`, which already depends on the batch,
so they are equal to their solo run within rounding only (as before this table).
`bench/attn_kernels.py --sweep` prints whether each candidate's short rows are bit-identical
to the default's (its "bits" column), so a GPU run can show whether num_warps is in fact
neutral there before anyone moves it into the per-shape rows.

A row that is one piece in a split launch (a row of <= short_piece keys, or any short row
with short_piece 0) is written by its own program and the reduce program of each of its heads
returns at once (bits of the unsplit launch, tests/unit/test_triton_attention.py), so the
split path no longer makes every such row round-trip fp32 partials; what remains of its cost
at batch 64 is the reduce launch, its early-exit programs and the idle programs of the
partition axis. The sweep's short_piece 256 at B64 ctx 160 measures exactly that.

Short-row pieces (short_piece > 0) trade a longer serial walk (a 160-key row at block_n 64 is
3 tiles in a row, in each of 8 programs at batch 1) for more programs plus the reduce launch
(grid (B, H)); the sweep times both, the reduce included. Not done here: fusing that reduce
into the decode kernel (the last piece of a row to finish combines the partials, counted by an
atomic). It would need a self-resetting counter buffer that outlives every captured graph (so
owned by the backend, sized for the largest batch) and a barrier + release/acquire pairing
around the count that only a GPU run can check; worth it only if the sweep shows pieces losing
to whole rows by about a launch (~2-3 µs) at batch 1.

The table is filled from one H200 run of `python3 bench/attn_kernels.py --sweep --emit`
(Llama-3-8B shapes): it times the candidates below per (batch, context) and prints a
`DECODE_TABLE = DecodeTable(...)` to paste here.

What the H200 sweep said (2026-12-01, docs/BENCHMARKS.md "Decode launch table"): its emitted
table (64-key short-row pieces) won 1.06x over 16 shapes, but only by making batch 1 fast at
1k contexts (31.6 -> 7.8 us a layer) while batch 64 at short contexts got slower (17.0 -> 29.5
us: 3 pieces + the reduce where one program per row was enough). The decode benchmarks of
issue 10 sit at batch 64 with ~160-token contexts, and long agent contexts (> 1,024 keys) are
split by the partition rule anyway, so the table keeps short rows whole and takes only the
sweep's num_stages (1.00-1.05x per shape). Pieces at low batch stay a choice for later: they
need a rule that is a function of the row alone and costs batch 64 nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ds4pool.model.kernels.triton_attention import DecodeLaunch


@dataclass(frozen=True)
class DecodeTable:
    """The shared short-row arithmetic, plus num_stages per (batch bucket, width bucket).

    stages: rows (most batch rows, most table-width tokens, num_stages); a launch takes the
    row of the smallest listed batch >= its batch and, within it, the smallest listed width
    >= its width; `default_stages` where no row covers it (past the largest batch or width)."""

    block_n: int = 64
    num_warps: int = 4
    short_piece: int = 0
    default_stages: int = 2
    stages: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        DecodeLaunch(self.block_n, self.num_warps, self.default_stages, self.short_piece)
        for most_batch, most_width, num_stages in self.stages:
            if most_batch < 1 or most_width < 1 or num_stages < 1:
                raise ValueError(f"bad stages row {(most_batch, most_width, num_stages)}")
        keys = [(b, w) for b, w, _ in self.stages]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two stages rows for one (batch, width): {sorted(keys)}")

    def launch(self, batch: int, width_tokens: int) -> DecodeLaunch:
        """The launch of a decode over `batch` rows and a table `width_tokens` wide."""
        return DecodeLaunch(
            self.block_n, self.num_warps, self.stages_for(batch, width_tokens), self.short_piece
        )

    def stages_for(self, batch: int, width_tokens: int) -> int:
        batches = sorted({b for b, _, _ in self.stages if b >= batch})
        if not batches:
            return self.default_stages
        rows = sorted((w, s) for b, w, s in self.stages if b == batches[0] and w >= width_tokens)
        return rows[0][1] if rows else self.default_stages


# The launch before any sweep (the H200 numbers in docs/BENCHMARKS.md were measured with it).
# Replace with the `--emit` output of `bench/attn_kernels.py --sweep` on the target GPU.
# NVIDIA H200, 2026-12-01, bench/attn_kernels.py --sweep (block_n 64, 4 warps, whole short
# rows; num_stages per width: 3 at <= 1k and 16k-wide tables, 2 at 4k), µs a layer, stages 3
# vs 2: B1 ctx 1000 30.2 vs 31.6, B64 ctx 160 16.5 vs 17.0, B64 ctx 8192 501.3 vs 503.2
DECODE_TABLE = DecodeTable(
    block_n=64,
    num_warps=4,
    short_piece=0,
    default_stages=2,
    stages=((64, 1024, 3), (64, 4096, 2), (64, 16384, 3)),
)


# What the sweep tries (bench/decode_sweep.py), in rounds to keep compiles few: every
# (block_n, num_warps) at SWEEP_BASE_STAGES with short rows whole; then, for the best few,
# num_stages and the short-row pieces. tests/unit/test_decode_configs.py runs every
# (block_n, short_piece) of it under the interpreter (warps and stages change the compiled
# code only) and compiles a sample of the rest for sm_90.
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_STAGES = (1, 2, 3, 4)
SWEEP_SHORT_PIECES = (64, 128, 256)
SWEEP_BASE_STAGES = 2


def sweep_shapes() -> list[DecodeLaunch]:
    """The first round: every tile width x warps, default stages, short rows whole."""
    return [
        DecodeLaunch(n, w, SWEEP_BASE_STAGES)
        for n, w in itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS)
    ]


def sweep_pieces(shape: DecodeLaunch) -> list[DecodeLaunch]:
    """Short rows split into pieces of p keys (p a multiple of the tile width)."""
    return [
        DecodeLaunch(shape.block_n, shape.num_warps, shape.num_stages, p)
        for p in SWEEP_SHORT_PIECES
        if p % shape.block_n == 0
    ]


def sweep_schedules(shape: DecodeLaunch) -> list[DecodeLaunch]:
    """One launch under each num_stages (the per-shape choice of the table)."""
    return [
        DecodeLaunch(shape.block_n, shape.num_warps, s, shape.short_piece) for s in SWEEP_STAGES
    ]
