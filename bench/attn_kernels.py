"""Check, then benchmark, the Triton paged-attention kernels on one CUDA GPU (llama3-8b shapes).

    python3 bench/attn_kernels.py            # checks + full table (< 4 min on an H200)
    python3 bench/attn_kernels.py --quick    # fewer shapes, for a smoke run
    python3 bench/attn_kernels.py --sweep --emit   # decode launch sweep, table to paste
    python3 bench/attn_kernels.py --case 24,3000,8,243,3143 [--split] [--small-m 16] [--reps 3]
                                             # one mixed step's attention, for a profiler

--sweep times the decode kernel's launch candidates instead (bench/decode_sweep.py: block_n,
warps, stages, short-row pieces at batch 1-64, contexts 160-8k, graph-sized tables) and with
--emit prints a `DECODE_TABLE` for model/kernels/triton_decode_configs.py.

1. Checks: every launch variant below against the torch reference backend (TorchPagedAttention)
   on ragged, shuffled paged batches (bf16, block 16, H=32, H_kv=8, D=128), incl. a sliding
   window and a mixed prefill + decode step; then CUDA-graph replay of decode with new values.
2. Ceilings measured here: device-to-device copy bandwidth (bytes read + written) and a bf16
   torch.matmul 8192^3.
3. Decode at B x context: KV bytes read, time (triton.testing.do_bench median, L2 flushed
   between calls), GB/s and % of copy bandwidth, per launch variant; the best is marked.
   "graph µs": the default launch replayed from a CUDA graph (do_bench_cudagraph: no host
   launch cost, but no L2 flush either, so contexts whose KV fits in L2 read faster there);
   "via prefill µs": the same rows through paged_prefill (a one-kernel mixed step).
   Then the same decode on a 128k-token-wide table (the persistent-buffer case): partitions of
   512 over the full width vs a fixed split per row (num_partitions=auto_num_partitions).
4. Prefill of one 16k prompt and a 2k chunk after 14k cached: TFLOP/s over the causal pairs
   (2 matmuls x 2 flop x pairs x H x D) and % of the matmul rate.
5. Mixed steps of the agents workload (decoders at ~3k tokens beside prompt chunks) through
   TritonPagedAttention.forward: one prefill launch (`triton`) vs the decode rows in the
   decode kernel (`triton-split`) vs one launch with the decode rows on 16-row tiles
   (PrefillLaunch.small_m), with the largest difference from the first's outputs.
Tables print last; the exit code is 1 when a check failed. Change the variants below.

--case ND,DCTX,K,C,CCTX runs only one mixed step's attention (ND decode rows at DCTX tokens,
K prompt chunks of C tokens whose context ends at CCTX; ND may be 0), --reps times through the
backend's forward (one launch, or --split; with --small-m, the prefill launch's decode rows
on tiles of that many rows), and prints its median time: the launches for a
profiler (`ncu -k regex:prefill_kernel --launch-skip 1 -c 1 python3 bench/attn_kernels.py
--case ...`: the first rep compiles).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model.attention import TorchPagedAttention, build_metadata  # noqa: E402
from ds4pool.model.kernels import triton_attention as ta  # noqa: E402
from tests.paged_cases import case_metadata, make_case, rel_err, torch_reference  # noqa: E402

H, H_KV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
# name -> (launch, partition_size); the first is the default of triton_attention;
# partition_size None: num_partitions=auto_num_partitions(...) (a fixed split per row)
DECODE_VARIANTS: dict[str, tuple[ta.DecodeLaunch, int | None]] = {
    "n64 w4 s2 p512": (ta.DecodeLaunch(64, 4, 2), 512),
    "n128 w4 s2 p512": (ta.DecodeLaunch(128, 4, 2), 512),
    "n64 w4 s3 p256": (ta.DecodeLaunch(64, 4, 3), 256),
    "n128 w8 s2 p1024": (ta.DecodeLaunch(128, 8, 2), 1024),
    "n64 w4 s2 autoP": (ta.DecodeLaunch(64, 4, 2), None),
}
PREFILL_VARIANTS: dict[str, ta.PrefillLaunch] = {
    "m128 n64 w8 s2": ta.PrefillLaunch(128, 64, 8, 2),
    "m64 n64 w4 s2": ta.PrefillLaunch(64, 64, 4, 2),
    "m128 n128 w8 s2": ta.PrefillLaunch(128, 128, 8, 2),
    # deeper K/V pipelines (sm_90 compiles: 96 / 161 KB of shared memory); run K: the prefill
    # kernel was a third of a wave step (19.3 ms of 57.9, docs/BENCHMARKS.md)
    "m128 n64 w8 s3": ta.PrefillLaunch(128, 64, 8, 3),
    "m128 n128 w8 s3": ta.PrefillLaunch(128, 128, 8, 3),
}


def split_kwargs(part: int | None, batch: int, max_blocks: int) -> dict[str, int]:
    """paged_decode's split arguments for a variant's partition_size (None: auto fixed P)."""
    if part is not None:
        return {"partition_size": part}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"num_partitions": ta.auto_num_partitions(batch, H_KV, max_blocks * BS, sms)}


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms (L2 flushed before each call); NaN when the call fails, so the table goes on."""
    try:
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    except Exception as e:
        print(f"timing failed: {e!r}"[:2000], flush=True)
        return float("nan")


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_rate() -> float:
    """flop/s of a bf16 8192^3 torch.matmul."""
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    ms = bench_ms(lambda: torch.matmul(a, b))
    return 2 * 8192**3 / (ms * 1e-3)


def checks() -> list[str]:
    """Every variant vs TorchPagedAttention; returns the failures."""
    failures: list[str] = []
    ctx = [1, 15, 16, 17, 130, 513, 1000, 2049, 4000, 8000, 777, 64]
    shape = dict(heads=H, kv_heads=H_KV, head_dim=D, block_size=BS, dtype=DTYPE, device="cuda")
    dec = make_case([1] * len(ctx), ctx, **shape)
    mix = make_case([2048, 512, 1, 1, 300], [2048, 4096, 8000, 1, 300], **shape, seed=1)
    for window in (None, 1000):
        ref = torch_reference(dec, window).double().cpu()
        for name, (launch, part) in DECODE_VARIANTS.items():
            out = torch.full_like(dec.q, float("nan"))
            run = partial(
                ta.paged_decode, dec.q, dec.cache[0], dec.cache[1], dec.block_tables,
                dec.context_lens, dec.scale, out, sliding_window=window, launch=launch,
                **split_kwargs(part, *dec.block_tables.shape),
            )  # fmt: skip
            failures += check(f"decode {name} window={window}", run, out, ref)
        out = torch.full_like(dec.q, float("nan"))
        run = partial(
            ta.paged_prefill, dec.q, dec.cache[0], dec.cache[1], dec.block_tables,
            dec.query_start, dec.context_lens, 1, dec.scale, out, sliding_window=window,
        )  # fmt: skip
        failures += check(f"decode rows via paged_prefill window={window}", run, out, ref)
        ref = torch_reference(mix, window).double().cpu()
        for name, launch in PREFILL_VARIANTS.items():
            out = torch.full_like(mix.q, float("nan"))
            run = partial(
                ta.paged_prefill, mix.q, mix.cache[0], mix.cache[1], mix.block_tables,
                mix.query_start, mix.context_lens, 2048, mix.scale, out, sliding_window=window,
                launch=launch,
            )  # fmt: skip
            failures += check(f"prefill {name} window={window}", run, out, ref)
    for split in ({"partition_size": 512}, {"num_partitions": 12}):
        try:
            failures += graph_check(split)
        except Exception as e:  # report and go on to the tables
            print(f"check FAIL decode CUDA-graph replay {split}: {e!r}", flush=True)
            failures.append(f"decode CUDA-graph replay {split}: {e!r}")
    return failures


def check(what: str, run: Callable[[], None], out: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """Run one kernel call into `out` (NaN-filled) and compare; an exception is a failure."""
    try:
        run()
        err = rel_err(out, ref)
    except Exception as e:  # e.g. a compile error of one variant: the others still run
        print(f"check FAIL {what}: {e!r}"[:2000], flush=True)
        return [f"{what}: {type(e).__name__}"]
    ok = err < 1e-2  # NaN (an unwritten element) fails too
    print(f"check {'ok  ' if ok else 'FAIL'} {what}: rel err {err:.2e}", flush=True)
    return [] if ok else [f"{what}: {err:.2e}"]


def graph_check(split: dict[str, int]) -> list[str]:
    """Capture decode once, replay with new lengths and tables: same as eager, bit for bit."""
    case = make_case([1] * 8, [4000] * 8, heads=H, kv_heads=H_KV, head_dim=D, block_size=BS,
                     dtype=DTYPE, device="cuda", spare_blocks=64, seed=2)  # fmt: skip
    q, tables, lens = case.q, case.block_tables.clone(), case.context_lens.clone()
    out = torch.empty_like(q)

    def step() -> None:
        ta.paged_decode(q, case.cache[0], case.cache[1], tables, lens, case.scale, out, **split)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor([1, 0, 4000, 17, 2048, 999, 3, 512], dtype=torch.int32))
    tables.copy_(torch.randint(0, case.cache.shape[1], tables.shape, device="cuda"))
    graph.replay()
    replayed = out.clone()
    step()
    same = bool(torch.equal(replayed, out))
    what = f"decode CUDA-graph replay == eager {split}"
    print(f"check {'ok  ' if same else 'FAIL'} {what}", flush=True)
    return [] if same else [what]


def decode_table(batches: list[int], contexts: list[int], copy_bw: float) -> list[str]:
    max_tokens = max(batches) * max(contexts)
    cache = torch.randn(2, max_tokens // BS + 8, BS, H_KV, D, dtype=DTYPE, device="cuda")
    names = list(DECODE_VARIANTS)
    rows = [
        "| B | context | KV MB | best | µs | GB/s | % copy BW | "
        + " | ".join(f"{n} µs" for n in names) + " | graph µs | via prefill µs | torch ref µs |",
        "|---" * (10 + len(names)) + "|",
    ]  # fmt: skip
    for b in batches:
        for ctx in contexts:
            nb = ctx // BS
            perm = torch.randperm(cache.shape[1], device="cuda")[: b * nb]
            tables = perm.view(b, nb).to(torch.int32)  # shuffled, non-contiguous blocks
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(b, H, D, dtype=DTYPE, device="cuda")
            out = torch.empty_like(q)
            times = {
                name: bench_ms(partial(
                    ta.paged_decode, q, cache[0], cache[1], tables, lens, D**-0.5, out,
                    launch=launch, **split_kwargs(part, b, nb),
                ))
                for name, (launch, part) in DECODE_VARIANTS.items()
            }  # fmt: skip
            graph_ms = decode_graph_ms(q, cache, tables, lens, out)
            # the same rows through the mixed-step kernel (no split-K, 16-row tiles)
            q_start = torch.arange(b + 1, dtype=torch.int32, device="cuda")
            via_prefill_ms = bench_ms(partial(
                ta.paged_prefill, q, cache[0], cache[1], tables, q_start, lens, 1, D**-0.5, out,
            ))  # fmt: skip
            ref_ms = torch_decode_ms(q, cache, tables, lens)
            best = min(times, key=lambda n: (math.isnan(times[n]), times[n]))
            kv_bytes = b * ctx * H_KV * D * 2 * cache.element_size()
            gbs = kv_bytes / (times[best] * 1e-3) / 1e9
            rows.append(
                f"| {b} | {ctx} | {kv_bytes / 1e6:.1f} | {best} | {times[best] * 1e3:.1f} | "
                f"{gbs:.0f} | {100 * gbs * 1e9 / copy_bw:.0f}% | "
                + " | ".join(f"{times[n] * 1e3:.1f}" for n in names)
                + f" | {graph_ms * 1e3:.1f} | {via_prefill_ms * 1e3:.1f} | {ref_ms * 1e3:.0f} |"
            )  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def decode_graph_ms(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
    out: torch.Tensor,
) -> float:  # fmt: skip
    """Default launch replayed from a CUDA graph (no host launch cost; L2 stays warm)."""
    parts = ta.decode_num_partitions(tables.shape[1], BS, ta.DEFAULT_PARTITION)
    workspace = ta.decode_workspace(q.shape[0], H, D, parts, q.device)
    step = partial(ta.paged_decode, q, cache[0], cache[1], tables, lens, D**-0.5, out,
                   workspace=workspace)  # fmt: skip
    try:
        return float(triton.testing.do_bench_cudagraph(step, rep=20, return_mode="median"))
    except Exception as e:  # a capture problem must not hide the rest of the table
        print(f"graph timing failed: {e!r}", flush=True)
        return float("nan")


def wide_table_rows(batches: list[int], contexts: list[int], width: int) -> list[str]:
    """Persistent-buffer case: tables `width` tokens wide whatever the contexts are."""
    cache = torch.randn(2, max(batches) * max(contexts) // BS + 8, BS, H_KV, D, dtype=DTYPE,
                        device="cuda")  # fmt: skip
    wide_blocks = width // BS
    rows = [
        f"| B | context | table width | p512 µs (P={wide_blocks * BS // 512}) | autoP µs | P |",
        "|---" * 6 + "|",
    ]
    for b in batches:
        for ctx in contexts:
            nb = ctx // BS
            tables = torch.zeros(b, wide_blocks, dtype=torch.int32, device="cuda")
            tables[:, :nb] = torch.randperm(cache.shape[1], device="cuda")[: b * nb].view(b, nb)
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(b, H, D, dtype=DTYPE, device="cuda")
            out = torch.empty_like(q)
            run = partial(ta.paged_decode, q, cache[0], cache[1], tables, lens, D**-0.5, out)
            auto = split_kwargs(None, b, wide_blocks)
            p512_ms, auto_ms = bench_ms(run), bench_ms(partial(run, **auto))
            rows.append(f"| {b} | {ctx} | {width} | {p512_ms * 1e3:.1f} | {auto_ms * 1e3:.1f} | "
                        f"{auto['num_partitions']} |")  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def torch_decode_ms(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor) -> float:  # fmt: skip
    """The reference backend's decode on the same batch (metadata built once, untimed)."""
    ctx = lens.tolist()
    meta = build_metadata([1] * len(ctx), ctx, tables.tolist(), BS, q.device)
    backend = TorchPagedAttention()
    return bench_ms(lambda: backend._decode(q, cache, meta, D**-0.5))


def prefill_table(shapes: list[tuple[int, int]], matmul: float) -> list[str]:
    """shapes: (query tokens, context after the step), one sequence each."""
    names = list(PREFILL_VARIANTS)
    rows = [
        "| new tokens | context | best | ms | TFLOP/s | % matmul | "
        + " | ".join(f"{n} ms" for n in names) + " |",
        "|---" * (6 + len(names)) + "|",
    ]  # fmt: skip
    for q_len, ctx in shapes:
        nb = -(-ctx // BS)
        cache = torch.randn(2, nb + 8, BS, H_KV, D, dtype=DTYPE, device="cuda")
        tables = torch.randperm(nb + 8, device="cuda")[:nb].view(1, nb).to(torch.int32)
        q_start = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        q = torch.randn(q_len, H, D, dtype=DTYPE, device="cuda")
        out = torch.empty_like(q)
        times = {
            name: bench_ms(partial(
                ta.paged_prefill, q, cache[0], cache[1], tables, q_start, lens, q_len, D**-0.5,
                out, launch=launch,
            ))
            for name, launch in PREFILL_VARIANTS.items()
        }  # fmt: skip
        best = min(times, key=lambda n: (math.isnan(times[n]), times[n]))
        first = ctx - q_len  # query at position p sees p + 1 keys
        pairs = (first + 1 + ctx) * q_len // 2
        tflops = 4 * pairs * H * D / (times[best] * 1e-3) / 1e12
        rows.append(
            f"| {q_len} | {ctx} | {best} | {times[best]:.2f} | {tflops:.0f} | "
            f"{100 * tflops * 1e12 / matmul:.0f}% | "
            + " | ".join(f"{times[n]:.2f}" for n in names) + " |"
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


# mixed steps of the agents workload (docs/BENCHMARKS.md, run K): decoders at ~3k tokens next
# to prompt chunks; (decode rows, their context, chunks, chunk tokens, context after the chunk)
MIXED_SHAPES = [(24, 3000, 1, 243, 3143), (24, 3000, 8, 243, 3143), (24, 3000, 1, 1944, 4844),
                (64, 3000, 8, 243, 3143)]  # fmt: skip


def _mixed_forward(backend: object, case: object, meta: object) -> torch.Tensor:
    """The backend's forward over a case whose K/V are in the cache already (kv_stored)."""
    k = case.q[:, :H_KV]  # type: ignore[attr-defined]  # only its shape is read
    return backend.forward(case.q, k, k, case.cache, meta, case.scale, True)  # type: ignore


def mixed_backends(small_m: int = 16) -> tuple[object, object, object]:
    """The device's one-launch backend, triton-split, and the one launch with the decode
    rows on `small_m`-row tiles (PrefillLaunch.small_m)."""
    from ds4pool.model.attention_triton import TritonPagedAttention

    return (
        TritonPagedAttention(),
        TritonPagedAttention(split_decode_rows=True),
        TritonPagedAttention(small_m=small_m),
    )


def mixed_table(shapes: list[tuple[int, int, int, int, int]]) -> tuple[list[str], list[str]]:
    """A mixed step's attention as the backend runs it: one prefill launch over every row
    (`triton`) against the decode rows in the decode kernel and the chunks in the prefill
    kernel past them (`triton-split`) and against one launch whose decode rows run on small
    tiles, TritonPagedAttention.forward with the backend's own launch choices. Returns the
    table and the shapes whose outputs disagree with the one launch's."""
    one, split, small = mixed_backends()
    rows = [
        "| decode rows x context | chunks x tokens (context after) | one launch µs | split µs "
        f"| small tiles ({small.prefill_launch.small_m} rows) µs | split / one | small / one "
        "| max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    failures = []
    for nd, dctx, k, c, cctx in shapes:
        case = make_case(
            [1] * nd + [c] * k, [dctx] * nd + [cctx] * k, heads=H, kv_heads=H_KV, head_dim=D,
            block_size=BS, dtype=DTYPE, device="cuda", seed=nd + k,
        )  # fmt: skip
        meta = case_metadata(case, index_dtype=torch.int32)
        assert meta.lead_decode_rows == nd, meta.lead_decode_rows
        runs = [partial(_mixed_forward, b, case, meta) for b in (one, split, small)]
        ref = runs[0]().float()
        diff = max(float((run().float() - ref).abs().max()) for run in runs[1:])
        if not diff < 2e-2:
            failures.append(f"mixed {nd}x{dctx} + {k}x{c}: split or small differ by {diff}")
        t_one, t_split, t_small = (bench_ms(run) for run in runs)
        rows.append(
            f"| {nd} x {dctx} | {k} x {c} ({cctx}) | {t_one * 1e3:.0f} | {t_split * 1e3:.0f} "
            f"| {t_small * 1e3:.0f} | {t_split / t_one:.2f} | {t_small / t_one:.2f} "
            f"| {diff:.1e} |"
        )
        print(rows[-1], flush=True)
    return rows, failures


def one_case(spec: str, split: bool, reps: int, small_m: int = 0) -> int:
    """--case: one mixed step's attention, reps times, and its median µs per layer."""
    nd, dctx, k, c, cctx = (int(x) for x in spec.split(","))
    case = make_case(
        [1] * nd + [c] * k, [dctx] * nd + [cctx] * k, heads=H, kv_heads=H_KV, head_dim=D,
        block_size=BS, dtype=DTYPE, device="cuda", seed=nd + k,
    )  # fmt: skip
    from ds4pool.model.attention_triton import TritonPagedAttention

    meta = case_metadata(case, index_dtype=torch.int32)
    backend = TritonPagedAttention(split_decode_rows=split, small_m=small_m)
    run = partial(_mixed_forward, backend, case, meta)
    times = []
    for _ in range(max(1, reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    name = f"{'triton-split' if split else 'triton'}, {backend.prefill_launch}"
    print(f"{name} {nd} x {dctx} + {k} x {c} ({cctx}): {sorted(times)[len(times) // 2]:.0f} µs "
          f"(median of {len(times)}, the first compiling)")  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    parser.add_argument("--sweep", action="store_true", help="decode launch sweep only")
    parser.add_argument("--emit", action="store_true", help="--sweep: print the table to paste")
    parser.add_argument("--budget-s", type=float, default=120.0, help="--sweep: time budget")
    parser.add_argument("--case", help="ND,DCTX,K,C,CCTX: one mixed step only (see above)")
    parser.add_argument("--split", action="store_true", help="--case: as triton-split")
    parser.add_argument("--small-m", type=int, default=0, help="--case: PrefillLaunch.small_m")
    parser.add_argument("--reps", type=int, default=3, help="--case: launches")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attn_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    if args.case:
        return one_case(args.case, args.split, args.reps, args.small_m)
    if args.sweep:
        from bench.decode_sweep import run

        return run(args.quick, args.emit, args.budget_s)
    t0 = time.perf_counter()
    failures = checks()
    print(f"checks done in {time.perf_counter() - t0:.0f} s", flush=True)
    copy_bw, matmul = copy_bandwidth(), matmul_rate()
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    contexts = [128, 1024] if args.quick else [128, 1024, 8192]
    decode = decode_table(batches, contexts, copy_bw)
    wide = wide_table_rows(batches[1:] or batches, contexts[1:] or contexts, 131072)
    prefill_shapes = [(2048, 4096)] if args.quick else [(16384, 16384), (2048, 16384)]
    prefill = prefill_table(prefill_shapes, matmul)
    mixed, mixed_failures = mixed_table(MIXED_SHAPES[:2] if args.quick else MIXED_SHAPES)
    failures += mixed_failures
    print(f"all done in {time.perf_counter() - t0:.0f} s", flush=True)

    print(f"\n## Triton paged attention, {torch.cuda.get_device_name()}, llama3-8b shapes")
    print(f"(H={H}, H_kv={H_KV}, D={D}, {DTYPE}, block {BS}, shuffled block tables)\n")
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write), "
          f"bf16 matmul 8192^3 {matmul / 1e12:.0f} TFLOP/s\n")  # fmt: skip
    print("### decode (one token per sequence, all at the same context)\n")
    print("\n".join(decode))
    print("\n### decode on a 128k-token-wide block table (persistent buffers), same contexts\n")
    print("\n".join(wide))
    print("\n### prefill (one sequence; causal pairs counted)\n")
    print("\n".join(prefill))
    print("\n### mixed steps: one prefill launch, decode rows in the decode kernel or on small")
    print("tiles (per layer)\n")
    print("\n".join(mixed))
    print(f"\nchecks: {'all passed' if not failures else 'FAILED: ' + '; '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
