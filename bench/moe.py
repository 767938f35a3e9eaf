"""Mixture-of-experts decode: tok/s and the expert weight bytes a step actually reads, by batch.

    python3 bench/moe.py --model random:qwen3-moe-70m --batch 1 8 32 64      # CPU check
    python3 bench/moe.py --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 \\
        --batch 1 8 32 64

A decode step reads every non-expert weight once (attention, norms, routers, LM head) and,
in each sparse layer, each expert that at least one sequence of the batch chose, once: the
grouped expert path (model/moe.py) runs one GEMM per projection over all experts, so a
batch of B sequences reads D(B) distinct experts per layer, not B * k. This script measures
both halves:

- tok/s: B prompts of --prompt-len tokens prefilled (untimed), then --steps decode steps of
  all B timed as the server runs them (bench/decode.py's loop: persistent input batch, CUDA
  graphs where the model can capture them);
- D(B): the same prefill and steps again, eagerly, with an observer on every MoE block that
  counts the distinct experts of each forward (the observer syncs, so it is not timed).

Bytes per step = non-expert weights + D(B) x layers x one expert's bytes; the roofline is
that over the measured device copy bandwidth (and with the KV read of the step added:
B x the mean context x KV bytes per token). Random routers spread tokens nearly uniformly,
the worst case for grouping; a trained model's routing is more skewed, so fewer distinct
experts per batch. `--routing zipf` shows what skew gives (an illustration, not a trained
model: label it so): in every sparse layer the router row of the expert of popularity rank r
(a random order per layer) is scaled by (r + 1)^-alpha, so a few experts' logits spread
widest and win most top-k choices; D(B) is still measured, not assumed.

--experts picks the expert path (model/moe.py): `auto` takes the small-batch decode kernels
for steps of T·k <= --decode-max-pairs on CUDA and grouped GEMMs above; `decode`,
`grouped_mm`, `triton`, `loop` pin one; --decode-route where the decode kernels route
(`gate_up`: inside the gate_up launch, `separate`: a launch of its own). --profile prints
each batch's top kernels (3 decode steps under torch.profiler, graph replays included):

    python3 bench/moe.py --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 \\
        --batch 1 8 16 32 --experts decode --profile
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import (  # noqa: E402
    bench_batch,
    copy_bandwidth,
    decode_steps,
    pdl_setting,
    prefill_batch,
)
from bench.profile_decode import kernel_table  # noqa: E402
from ds4pool.kv.blocks import BlockPool  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.device import select_device, select_dtype  # noqa: E402
from ds4pool.model.experts import DECODE_MAX_PAIRS, EXPERT_IMPLS, expert_impl  # noqa: E402
from ds4pool.model.loader import LoadedModel, load_model  # noqa: E402
from ds4pool.model.moe import DECODE_ROUTES, SparseMoeBlock  # noqa: E402
from ds4pool.model.ops import PDL_KINDS, pdl_kinds  # noqa: E402
from ds4pool.model.runner import ModelRunner  # noqa: E402


@dataclass
class ExpertHits:
    """Distinct experts per MoE-block forward, summed over the forwards it saw after the
    first `skip`."""

    skip: int = 0
    distinct: int = 0
    forwards: int = 0

    def __call__(self, ids: torch.Tensor) -> None:  # [T, k]
        if self.skip:
            self.skip -= 1
            return
        self.distinct += int(torch.unique(ids).numel())
        self.forwards += 1


@dataclass(frozen=True)
class WeightBytes:
    dense: int  # non-expert weights a decode step reads
    expert: int  # one expert (gate, up, down)
    sparse_layers: int

    def per_step(self, distinct_per_layer: float) -> float:
        return self.dense + distinct_per_layer * self.sparse_layers * self.expert


def weight_bytes(loaded: LoadedModel) -> WeightBytes:
    cfg = loaded.config
    assert cfg.moe is not None, f"{loaded.name} is not a mixture-of-experts model"
    model = loaded.model
    dense = sum(p.nbytes for n, p in model.named_parameters() if ".experts." not in n)
    if not cfg.tie_word_embeddings:  # B rows of the embedding table, not all of it
        dense -= model.model.embed_tokens.weight.nbytes
    return WeightBytes(
        dense=dense,
        expert=cfg.moe.expert_bytes(cfg.hidden_size, loaded.dtype.itemsize),
        sparse_layers=len(cfg.moe.sparse_layers),
    )


def count_expert_hits(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Mean distinct experts per sparse layer per decode step over the decode steps that
    bench_batch times (same prompts, same greedy tokens), run eagerly."""
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    pool = BlockPool(runner.num_blocks)
    tables, last = prefill_batch(runner, pool, batch, prompt_len)
    hits = ExpertHits(skip=2 * len(blocks))  # bench_batch's 2 warm-up steps: not counted
    for b in blocks:
        b.observer = hits
    try:
        decode_steps(runner, pool, tables, last, prompt_len, steps, warmup=2)
    finally:
        for b in blocks:
            b.observer = None
    for t in tables:
        t.release(pool)
    return hits.distinct / hits.forwards


def skew_routers_(model: torch.nn.Module, alpha: float, seed: int = 0) -> None:
    """Zipf-like routing (see the module doc): router row of popularity rank r × (r + 1)^-α."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            w = m.gate.weight
            rank = torch.randperm(w.shape[0], generator=gen)  # expert e has rank rank[e]
            scale = (rank.double() + 1.0) ** -alpha
            with torch.no_grad():
                w.mul_(scale.to(w.device, w.dtype)[:, None])


def profile_batch(runner: ModelRunner, batch: int, prompt_len: int, top: int) -> None:
    """The top kernels of 3 decode steps of `batch` sequences, after 2 warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    pool = BlockPool(runner.num_blocks)
    tables, last = prefill_batch(runner, pool, batch, prompt_len)
    decode_steps(runner, pool, tables, last, prompt_len, 0, warmup=2)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        decode_steps(runner, pool, tables, last, prompt_len + 2, 3, warmup=0)
    print(f"\n## batch {batch}: kernels of one decode step")
    kernels, device_ms = kernel_table(prof, 3, top)
    print(f"{kernels:.0f} kernels, {device_ms:.2f} ms of device time per step\n")
    for t in tables:
        t.release(pool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-moe-70m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--experts",
        default="auto",
        choices=EXPERT_IMPLS,
        help="expert compute: auto, torch grouped_mm, the Triton grouped GEMM, the small-batch "
        "decode kernels, the per-expert loop",
    )
    ap.add_argument(
        "--decode-max-pairs",
        type=int,
        default=DECODE_MAX_PAIRS,
        help="with --experts auto: the decode kernels for steps of T*k up to this",
    )
    ap.add_argument(
        "--decode-gemv-tokens",
        type=int,
        default=None,
        help="decode kernels: steps of up to this many tokens as GEMVs, larger as tl.dot tiles "
        "(default: the kernels' GEMV_MAX_TOKENS; 0: tl.dot from one token)",
    )
    ap.add_argument(
        "--gate",
        default="fused",
        choices=("fused", "separate"),
        help="decode path: the add + norm before a sparse block and its router's linear in one "
        "launch (kernels/triton_moe_gate.py) or two",
    )
    ap.add_argument(
        "--decode-route",
        default="auto",
        choices=tuple(DECODE_ROUTES),
        help="decode kernels: the routing inside the gate_up launch, in a launch of its own, "
        "or auto (model/moe.py ROUTE_IN_GATE_UP: Qwen3-MoE / Mixtral up to "
        "ROUTE_IN_GATE_UP_MAX_TOKENS tokens)",
    )
    ap.add_argument(
        "--launch",
        default="auto",
        choices=("auto", "sync", "ahead"),
        help="decode steps launched after the previous one's readback (sync) or before it, "
        "their ids fed on the device (ahead); auto: as the server (ahead on CUDA)",
    )
    ap.add_argument(
        "--skinny",
        default="on",
        choices=("on", "off"),
        help="CUDA: the dense projections' skinny Triton GEMM where its table has the shape "
        "(on, as the server) or all on cuBLAS (off)",
    )
    ap.add_argument(
        "--pdl",
        nargs="+",
        default=["on"],
        type=pdl_setting,
        help="CUDA: the decode step's Triton kernels launched with programmatic dependent\n"
        "launch: on (the server's kinds on Hopper), off, or kinds joined by + (of\n"
        f"{', '.join(PDL_KINDS)});\nseveral: an A/B in one run (a runner and graphs each)",
    )
    ap.add_argument("--routing", default="uniform", choices=("uniform", "zipf"))
    ap.add_argument("--zipf-alpha", type=float, default=1.0)
    ap.add_argument("--profile", action="store_true", help="print each batch's top kernels")
    ap.add_argument("--top", type=int, default=12, help="kernels --profile lists")
    args = ap.parse_args()

    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device, dtype)
    load_s = time.perf_counter() - t0
    cfg = loaded.config
    for m in loaded.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.impl = args.experts
            m.decode_max_pairs = args.decode_max_pairs
            m.decode_gemv_tokens = args.decode_gemv_tokens
            m.fuse_gate = args.gate == "fused"
            m.decode_route_in_gate_up = DECODE_ROUTES[args.decode_route]
    if args.routing == "zipf":
        skew_routers_(loaded.model, args.zipf_alpha)
    assert cfg.moe is not None
    top_k, max_pairs = cfg.moe.top_k, args.decode_max_pairs
    impl = expert_impl(device, dtype, args.experts)
    if expert_impl(device, dtype, args.experts, top_k, max_pairs) != impl:
        impl = f"decode for T*k <= {max_pairs}, else {impl}"
    routing = "uniform (random routers)"
    if args.routing == "zipf":
        routing = f"ZIPF-SKEWED alpha {args.zipf_alpha} (illustration, not a trained model)"
    wb = weight_bytes(loaded)
    bs = 16
    # + 3: warm-up steps and the last token; --profile runs 5 steps of its own
    num_blocks = -(-(args.prompt_len + max(args.steps, 5) + 3) // bs) * max(args.batch) + 1
    common = {"num_blocks": num_blocks, "block_size": bs, "backend": args.backend}
    max_batch = max(64, max(args.batch))
    counter = ModelRunner(loaded, **common, cuda_graphs=False, max_decode_batch=max_batch)

    def timed_runner(pdl: str) -> ModelRunner:
        runner = ModelRunner(
            loaded, **common, cuda_graphs=not args.no_cuda_graphs, max_decode_batch=max_batch
        )
        # after the runner is made (it sets the shared model's ops), before any capture
        if args.skinny == "off" and hasattr(loaded.model.ops, "skinny_table"):
            loaded.model.ops.skinny_table = {}
        if hasattr(loaded.model.ops, "pdl"):
            loaded.model.ops.pdl = pdl_kinds(pdl)
        return runner

    runner = timed_runner(args.pdl[0])
    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (256 << 20))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    total = sum(p.nbytes for p in loaded.model.parameters())
    moe = cfg.moe
    print(
        f"# {args.model} on {device} ({name}), {str(dtype).removeprefix('torch.')}, "
        f"{total / 1e9:.2f} GB weights: {moe.num_experts} experts x {wb.sparse_layers} layers "
        f"of {wb.expert / 1e6:.2f} MB, top-{moe.top_k}; {wb.dense / 1e9:.2f} GB non-expert read "
        f"per step; experts {impl} (decode route {args.decode_route}), gate {args.gate}, "
        f"attention {runner.backend.name}, launch {args.launch}, skinny {args.skinny}, "
        f"pdl {' '.join(args.pdl)}, CUDA graphs "
        f"{'on' if runner.graphs is not None else 'off'}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load {load_s:.1f}s, {date.today()}"
    )
    print(
        f"# prompt {args.prompt_len} tokens, {args.steps} decode steps timed after 2 warm-up; "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; routing {routing}"
    )
    kv_per_token = cfg.kv_bytes_per_token(dtype.itemsize)
    mean_ctx = args.prompt_len + 2 + args.steps / 2
    ahead = args.launch == "ahead" or (args.launch == "auto" and device.type == "cuda")
    rows = []
    distinct = {}
    for i, pdl in enumerate(args.pdl):
        if i:  # a runner (and graphs) of its own, the last one's freed first
            del runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
            runner = timed_runner(pdl)
        label = "" if len(args.pdl) == 1 else f" (pdl {pdl})"
        for b in args.batch:
            tps = bench_batch(runner, b, args.prompt_len, args.steps, ahead)
            if b not in distinct:
                distinct[b] = count_expert_hits(counter, b, args.prompt_len, args.steps)
            rows.append((label, b, tps, distinct[b]))
            path = expert_impl(device, dtype, args.experts, b * top_k, max_pairs)
            print(
                f"# batch {b}{label}: {tps:.1f} tok/s, {distinct[b]:.1f} distinct experts/layer, "
                f"experts {path}",
                flush=True,
            )
            if args.profile and device.type == "cuda":
                profile_batch(runner, b, args.prompt_len, args.top)
    print(
        "| batch | tok/s | ms/step | experts read / layer / step | expert MB / token "
        "| weight MB / token | weight-roofline tok/s | % of it | % of weight+KV roofline |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    per_token = {}
    for label, b, tps, hits in rows:
        step_bytes = wb.per_step(hits)
        expert_token = hits * wb.sparse_layers * wb.expert / b
        per_token[b] = (expert_token, step_bytes / b)
        roof = b * bandwidth / step_bytes
        roof_kv = b * bandwidth / (step_bytes + b * mean_ctx * kv_per_token)
        print(
            f"| {b}{label} | {tps:.1f} | {b / tps * 1e3:.2f} | {hits:.1f} of {moe.num_experts} "
            f"| {expert_token / 1e6:.1f} | {step_bytes / b / 1e6:.1f} | {roof:.0f} "
            f"| {100 * tps / roof:.0f}% | {100 * tps / roof_kv:.0f}% |",
            flush=True,
        )
    first, last = min(per_token), max(per_token)
    if first != last:
        e = per_token[last][0] / per_token[first][0]
        w = per_token[last][1] / per_token[first][1]
        print(
            f"\nper token at batch {last} vs batch {first}: expert bytes x{e:.3f} (1/{1 / e:.1f}), "
            f"all weight bytes x{w:.3f} (1/{1 / w:.1f})"
        )


if __name__ == "__main__":
    main()
