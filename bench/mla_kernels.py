"""Check, then benchmark, the Triton paged MLA decode kernel on one CUDA GPU (DeepSeek-V3's
latent: R = 512, r = 64; 16 heads as random:deepseek-v3-small, 128 as the full model).

    python3 bench/mla_kernels.py            # checks + table (~1-2 min on an H200)
    python3 bench/mla_kernels.py --quick    # fewer shapes

1. Checks: every launch variant below against the torch reference (TorchMLAAttention's
   decode, float64) on a ragged, shuffled paged batch; rel err < 1e-2.
2. Decode of one layer at heads x B x context (every row at the context, shuffled blocks):
   latent bytes read (B x context x 576 x 2), time (triton.testing.do_bench median, L2
   flushed), GB/s and % of the copy bandwidth for the best variant, each variant's µs with
   the backend's split-K partition (`TritonMLAAttention.partition_size`), and the torch
   reference's decode (gather + two matmuls) on the same batch. Tables print last; the exit
   code is 1 when a check failed. Change the variants below.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attn_kernels import bench_ms, copy_bandwidth  # noqa: E402
from ds4pool.model.attention import AttentionMetadata  # noqa: E402
from ds4pool.model.attention_mla import TorchMLAAttention  # noqa: E402
from ds4pool.model.attention_mla_triton import TritonMLAAttention  # noqa: E402
from ds4pool.model.kernels import triton_mla as tm  # noqa: E402
from tests.paged_cases import make_case, rel_err  # noqa: E402

R, ROPE, BS = 512, 64, 16
DTYPE = torch.bfloat16
SCALE = (128 + ROPE) ** -0.5  # qk_head_dim 192
# name -> launch; the first is triton_mla's default
VARIANTS: dict[str, tm.MLADecodeLaunch] = {
    "h16 n32 w8 s2": tm.MLADecodeLaunch(16, 32, 8, 2),
    "h16 n32 w4 s2": tm.MLADecodeLaunch(16, 32, 4, 2),
    "h16 n64 w8 s2": tm.MLADecodeLaunch(16, 64, 8, 2),
    "h16 n16 w4 s2": tm.MLADecodeLaunch(16, 16, 4, 2),
    "h16 n32 w8 s3": tm.MLADecodeLaunch(16, 32, 8, 3),
    "h32 n32 w8 s2": tm.MLADecodeLaunch(32, 32, 8, 2),
}


def decode_meta(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    rows = torch.arange(tables.shape[0], device=tables.device)
    return AttentionMetadata(
        positions=rows, slot_mapping=rows, block_tables=tables.long(), context_lens=lens.long(),
        decode_rows=rows, decode_tokens=rows, max_decode_blocks=tables.shape[1], prefills=(),
        block_size=BS,
    )  # fmt: skip


def launch_fn(
    backend: TritonMLAAttention, launch: tm.MLADecodeLaunch, q: torch.Tensor,
    cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
) -> Callable[[], None]:  # fmt: skip
    """The backend's partition rule, rounded to the variant's tile (a multiple of block_n)."""
    part = backend.partition_size(q.shape[0], q.shape[1], tables.shape[1] * BS)
    part = -(-part // launch.block_n) * launch.block_n
    return partial(
        tm.mla_decode, q, cache, tables, lens, SCALE, out, partition_size=part,
        short_context=backend.short_context, launch=launch,
    )  # fmt: skip


def checks(backend: TritonMLAAttention) -> list[str]:
    failures = []
    ctx = [1, 15, 17, 300, 1024, 1025, 2049, 4000, 64, 3]
    for heads in (16, 128):
        case = make_case([1] * len(ctx), ctx, heads=heads, kv_heads=1, head_dim=R + ROPE,
                         block_size=BS, dtype=DTYPE, device="cuda", seed=heads)  # fmt: skip
        cache = case.cache[:1]
        meta = decode_meta(case.block_tables, case.context_lens)
        ref = TorchMLAAttention._decode(case.q.double(), cache.double(), meta, SCALE, R).cpu()
        for name, launch in VARIANTS.items():
            out = torch.full((len(ctx), heads, R), float("nan"), dtype=DTYPE, device="cuda")
            what = f"H={heads} {name}"
            try:
                launch_fn(backend, launch, case.q, cache[0], case.block_tables,
                          case.context_lens, out)()  # fmt: skip
                err = rel_err(out, ref)
            except Exception as e:  # one variant's compile error: the others still run
                print(f"check FAIL {what}: {e!r}"[:2000], flush=True)
                failures.append(f"{what}: {type(e).__name__}")
                continue
            ok = err < 1e-2
            print(f"check {'ok  ' if ok else 'FAIL'} {what}: rel err {err:.2e}", flush=True)
            failures += [] if ok else [f"{what}: {err:.2e}"]
    return failures


def decode_table(
    backend: TritonMLAAttention, heads: int, batches: list[int], contexts: list[int],
    copy_bw: float,
) -> list[str]:  # fmt: skip
    cache = torch.randn(max(batches) * max(contexts) // BS + 8, BS, 1, R + ROPE, dtype=DTYPE,
                        device="cuda")  # fmt: skip
    names = list(VARIANTS)
    rows = [
        "| H | B | context | latent MB | best | µs | GB/s | % copy BW | "
        + " | ".join(f"{n} µs" for n in names) + " | torch ref µs | ref / best |",
        "|---" * (10 + len(names)) + "|",
    ]  # fmt: skip
    for b in batches:
        for ctx in contexts:
            nb = ctx // BS
            perm = torch.randperm(cache.shape[0], device="cuda")[: b * nb]
            tables = perm.view(b, nb).to(torch.int64)  # as AttentionMetadata holds them
            lens = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
            q = torch.randn(b, heads, R + ROPE, dtype=DTYPE, device="cuda")
            out = torch.empty((b, heads, R), dtype=DTYPE, device="cuda")
            times = {
                name: bench_ms(launch_fn(backend, launch, q, cache, tables, lens, out))
                for name, launch in VARIANTS.items()
            }
            ref = partial(TorchMLAAttention._decode, q, cache[None], decode_meta(tables, lens))
            ref_ms = bench_ms(partial(ref, SCALE, R))
            best = min(times, key=lambda n: (math.isnan(times[n]), times[n]))
            nbytes = b * ctx * (R + ROPE) * cache.element_size()
            gbs = nbytes / (times[best] * 1e-3) / 1e9
            rows.append(
                f"| {heads} | {b} | {ctx} | {nbytes / 1e6:.1f} | {best} | "
                f"{times[best] * 1e3:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / copy_bw:.0f}% | "
                + " | ".join(f"{times[n] * 1e3:.1f}" for n in names)
                + f" | {ref_ms * 1e3:.0f} | {ref_ms / times[best]:.1f}x |"
            )  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    backend = TritonMLAAttention()
    failures = checks(backend)
    copy_bw = copy_bandwidth()
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    contexts = [1024, 4096] if args.quick else [512, 1024, 4096, 16384]
    tables = [decode_table(backend, h, batches, contexts, copy_bw) for h in (16, 128)]
    print(f"\n## Triton paged MLA decode, {torch.cuda.get_device_name()}, one layer")
    print(f"(R={R}, r={ROPE}, {DTYPE}, block {BS}, shuffled block tables; copy bandwidth "
          f"{copy_bw / 1e9:.0f} GB/s read + write)\n")  # fmt: skip
    for t in tables:
        print("\n".join(t) + "\n")
    print(f"checks: {'all passed' if not failures else 'FAILED: ' + '; '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
