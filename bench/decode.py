"""Decode throughput of the engine core at several batch sizes, next to the memory roofline.

    python bench/decode.py --model random:100m --batch 1 8 32
    python bench/decode.py --model random:llama3-8b --device cuda --batch 1 8 32 64 \
        --roofline --peer-hf --prefill 16384
    python bench/decode.py --model random:deepseek-v3-small --device cuda --batch 1 8 32 64 \
        --prompt-len 4096 --backend torch triton

Each batch size: B prompts of --prompt-len tokens are prefilled (untimed), then
--steps decode steps of all B sequences are timed, one forward per step (greedy), as the
server runs them (the persistent input batch; CUDA graphs on CUDA). Several --backend names
run one after the other on the same loaded model, a table row per (backend, batch).
Rooflines: the fastest a decode step can be if it only had to read the weights once
(weight bytes / measured copy bandwidth), and counting the KV read too (weights + B x the
mean context x KV bytes per token). --peer-hf runs transformers' `generate` with a static
cache on the same shapes in the same process (bench/hf_peer.py). --prefill N times one
N-token prompt prefilled in one step, against a measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.errors import DeviceError  # noqa: E402
from ds4pool.kv.blocks import BlockPool, BlockTable  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.cpu_linear import pack_cpu_linears  # noqa: E402
from ds4pool.model.device import blas_library, select_device, select_dtype  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.ops import PDL_KINDS, pdl_kinds  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul (median of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def bench_prefill(runner: ModelRunner, prompt_len: int, chunk: int) -> float:
    """Seconds to prefill one prompt of prompt_len tokens in chunks of `chunk` (median of 3)."""
    pool = BlockPool(runner.num_blocks)
    vocab = runner.loaded.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1))
    ids = prompt.tolist()
    times = []
    for _ in range(4):
        table = BlockTable(runner.block_size)
        table.ensure(pool, prompt_len)
        t0 = time.perf_counter()
        for start in range(0, prompt_len, chunk):
            part = ids[start : start + chunk]
            last = start + len(part) == prompt_len
            runner.step([SeqInput(part, start, table.blocks, sample=last)])
        sync(runner.device)
        times.append(time.perf_counter() - t0)
        table.release(pool)
    return sorted(times[1:])[1]


def prefill_batch(
    runner: ModelRunner, pool: BlockPool, batch: int, prompt_len: int
) -> tuple[list[BlockTable], list[int]]:
    """`batch` random prompts of prompt_len tokens prefilled one by one; (tables, first tokens)."""
    vocab = runner.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    tables = [BlockTable(runner.block_size) for _ in range(batch)]
    last = []
    for table in tables:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        table.ensure(pool, prompt_len + 1)
        for start in range(0, prompt_len, 4096):
            part = prompt[start : start + 4096]
            done = start + len(part) == prompt_len
            out = runner.step([SeqInput(part, start, table.blocks, sample=done)])
        last.append(out.sampled[0])
    return tables, last


def decode_rows(
    pool: BlockPool, tables: list[BlockTable], n: int, last: list[int] | None
) -> list[SeqInput]:
    """One greedy decode step's rows at position n, the tables grown as the scheduler grows
    them; `last` the input ids, or None: each row fed from the step before (fed_from)."""
    for t in tables:
        t.ensure(pool, n + 1)
    if last is None:
        return [
            SeqInput([0], n, t.blocks, seq_id=j + 1, table_epoch=t.epoch, fed_from=j)
            for j, t in enumerate(tables)
        ]
    return [
        SeqInput([tok], n, t.blocks, seq_id=j + 1, table_epoch=t.epoch)
        for j, (tok, t) in enumerate(zip(last, tables))
    ]


def decode_steps(
    runner: ModelRunner,
    pool: BlockPool,
    tables: list[BlockTable],
    last: list[int],
    start: int,
    steps: int,
    warmup: int = 2,
    ahead: bool = False,
) -> float:
    """Wall time of `steps` greedy decode steps of all sequences after `warmup` untimed ones.
    `ahead`: each step is launched before the step before it is read back, its ids fed on
    the device (runner.launch(feed=), the server's overlap "ahead"); else each step waits
    for the previous one's ids on the host."""
    if ahead:
        return _decode_steps_ahead(runner, pool, tables, last, start, steps, warmup)
    n = start
    elapsed = 0.0
    for i in range(steps + warmup):
        seqs = decode_rows(pool, tables, n, last)
        t0 = time.perf_counter()
        out = runner.step(seqs)  # ends with the readback of the sampled ids: synced
        if i >= warmup:
            elapsed += time.perf_counter() - t0
        last = [int(x) for x in out.sampled]  # type: ignore[arg-type]
        n += 1
    return elapsed


def _decode_steps_ahead(
    runner: ModelRunner,
    pool: BlockPool,
    tables: list[BlockTable],
    last: list[int],
    start: int,
    steps: int,
    warmup: int,
) -> float:
    """decode_steps with each step fed by the one before it: launch i, then wait i - 1; timed
    from the end of the last warm-up step to the end of the last step."""
    prev = None
    t0 = 0.0
    for i in range(steps + warmup):
        seqs = decode_rows(pool, tables, start + i, last if prev is None else None)
        if prev is None:
            launched = runner.launch(seqs)
        else:
            launched = runner.launch(seqs, feed=prev)
            runner.wait(prev)
        if i == warmup:
            t0 = time.perf_counter()  # the warm-up steps are done: step `warmup` runs now
        prev = launched
    assert prev is not None
    runner.wait(prev)
    return time.perf_counter() - t0


def bench_batch(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int, ahead: bool = False
) -> float:
    """`steps` decode steps (after 2 warm-up steps) of `batch` sequences → tok/s."""
    pool = BlockPool(runner.num_blocks)
    tables, last = prefill_batch(runner, pool, batch, prompt_len)
    elapsed = decode_steps(runner, pool, tables, last, prompt_len, steps, ahead=ahead)
    for t in tables:
        t.release(pool)
    return batch * steps / elapsed


def pdl_setting(value: str) -> str:
    """--pdl's values: DS4POOL_PDL's (model/ops.py pdl_kinds)."""
    try:
        pdl_kinds(value)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:100m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument(
        "--backend",
        nargs="+",
        default=["auto"],
        help="attention backends: auto, torch, triton, triton-split",
    )
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--roofline", action="store_true", help="measure copy bandwidth (GPU)")
    ap.add_argument("--peer-hf", action="store_true", help="transformers static-cache peer")
    ap.add_argument("--prefill", type=int, default=0, help="also time one N-token prefill")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill chunk (0: whole)")
    ap.add_argument(
        "--blas",
        nargs="+",
        choices=["auto", "default", "cublas", "cublaslt"],
        default=["auto"],
        help="CUDA: torch's preferred BLAS library for the projections, one run each on the\n"
        "same loaded model (auto: cublaslt on CUDA, as the server; default: torch's choice)",
    )
    ap.add_argument(
        "--launch",
        nargs="+",
        choices=["auto", "sync", "ahead"],
        default=["auto"],
        help="sync: each decode step launched once the previous one's ids are read back;\n"
        "ahead: launched before, its ids fed on the device (the server's overlap ahead);\n"
        "auto: as the server (ahead on CUDA, sync elsewhere); one run each",
    )
    ap.add_argument(
        "--skinny",
        nargs="+",
        choices=["on", "unfused", "off"],
        default=["on"],
        help="CUDA: the decode projections' skinny Triton GEMM where its table has the shape\n"
        "(on, as the server), the same without its fusions (unfused: silu·mul and the\n"
        "add + norm in launches of their own), or every projection on cuBLAS (off);\n"
        "several: an A/B in one run",
    )
    ap.add_argument(
        "--pdl",
        nargs="+",
        type=pdl_setting,
        default=["on"],
        help="CUDA: the decode step's Triton kernels launched with programmatic dependent\n"
        "launch: on (the server's kinds on Hopper), off, or kinds joined by + (of\n"
        f"{', '.join(PDL_KINDS)}: model/ops.py);\nseveral: an A/B in one run",
    )
    ap.add_argument(
        "--cpu-linear",
        choices=["auto", "onednn", "torch"],
        default="auto",
        help="CPU: projections through oneDNN prepacked weights (as serve; default auto)",
    )
    args = ap.parse_args()
    if not set(args.blas) <= {"auto", "default"} and not torch.cuda.is_available():
        sys.exit("--blas needs CUDA")

    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device, dtype)
    try:
        linear = pack_cpu_linears(loaded.model, args.cpu_linear, device, dtype)
    except DeviceError as exc:
        sys.exit(str(exc))
    load_s = time.perf_counter() - t0
    cfg = loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    embed = loaded.model.model.embed_tokens.weight
    # A decode step reads every weight but the embedding table (B rows of it), unless tied.
    read_bytes = weight_bytes - (0 if cfg.tie_word_embeddings else embed.nbytes)
    kv_per_token = cfg.kv_bytes_per_token(dtype.itemsize)
    bs = 16
    per_seq = -(-(args.prompt_len + args.steps + 2) // bs)
    num_blocks = max(per_seq * max(args.batch), -(-args.prefill // bs)) + 1
    bandwidth = copy_bandwidth(device) if args.roofline else None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"# {args.model} on {device} ({name}), {str(dtype).removeprefix('torch.')}, "
        f"{weight_bytes / 1e9:.2f} GB weights ({read_bytes / 1e9:.2f} GB read per decode step), "
        f"CUDA graphs {'off' if args.no_cuda_graphs else 'on'}, blas {' '.join(args.blas)}, "
        f"launch {' '.join(args.launch)}, skinny {' '.join(args.skinny)}, "
        f"pdl {' '.join(args.pdl)}, "
        f"linears {linear}, "
        f"torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load {load_s:.1f}s, {date.today()}"
    )
    print(f"# prompt {args.prompt_len} tokens, {args.steps} decode steps timed after 2 warm-up")
    if bandwidth:
        print(
            f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s → weight-read floor "
            f"{read_bytes / bandwidth * 1e3:.2f} ms/step"
        )
    rows = []  # (attention backend, batch, tok/s)
    prefill_s = None
    default_blas = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    launches = [
        ("ahead" if device.type == "cuda" else "sync") if m == "auto" else m for m in args.launch
    ]
    variants = [
        (a, b, s, p) for a in args.backend for b in args.blas for s in args.skinny
        for p in args.pdl
    ]  # fmt: skip
    for backend, blas, skinny, pdl in variants:
        if default_blas is not None:  # the library is a process-wide setting: set per run
            torch.backends.cuda.preferred_blas_library(blas_library(blas, device) or default_blas)
        runner = ModelRunner(
            loaded,
            num_blocks=num_blocks,
            block_size=bs,
            backend=backend,
            cuda_graphs=not args.no_cuda_graphs,
            max_decode_batch=max(64, max(args.batch)),
        )
        if skinny == "off" and hasattr(runner.model.ops, "skinny_table"):
            runner.model.ops.skinny_table = {}
        if skinny == "unfused" and hasattr(runner.model.ops, "fuse_act"):
            runner.model.ops.fuse_act = runner.model.ops.fuse_add_norm = False
        if hasattr(runner.model.ops, "pdl"):
            runner.model.ops.pdl = pdl_kinds(pdl)
        label = runner.backend.name + ("" if len(args.blas) == 1 else f" / {blas}")
        label += "" if len(args.skinny) == 1 else f" / skinny {skinny}"
        label += "" if len(args.pdl) == 1 else f" / pdl {pdl}"
        for launch in launches:
            tag = label + ("" if len(launches) == 1 else f" / {launch}")
            for b in args.batch:
                tps = bench_batch(runner, b, args.prompt_len, args.steps, launch == "ahead")
                rows.append((tag, b, tps))
                print(f"# {tag} batch {b}: {tps:.1f} tok/s", flush=True)
        if args.prefill and prefill_s is None:
            prefill_s = bench_prefill(runner, args.prefill, args.prefill_chunk or args.prefill)
        del runner
        gc.collect()
    peer: dict[int, float] = {}
    if args.peer_hf:
        peer = run_peer(args, loaded, device, dtype)
    header = "| attention | batch | ds4pool tok/s | ms/step |"
    sep = "|---|---:|---:|---:|"
    if peer:
        header += " transformers static cache tok/s | ds4pool / transformers |"
        sep += "---:|---:|"
    if bandwidth:
        header += " % of weight roofline | % of weight+KV roofline |"
        sep += "---:|---:|"
    print(header)
    print(sep)
    mean_ctx = args.prompt_len + args.steps / 2
    for backend, b, tps in rows:
        row = f"| {backend} | {b} | {tps:.1f} | {b / tps * 1e3:.2f} |"
        if peer:
            row += f" {peer[b]:.1f} | {tps / peer[b]:.2f}x |"
        if bandwidth:
            floor = read_bytes / bandwidth  # seconds per step
            floor_kv = (read_bytes + b * mean_ctx * kv_per_token) / bandwidth
            step = b / tps
            row += f" {100 * floor / step:.0f}% | {100 * floor_kv / step:.0f}% |"
        print(row, flush=True)
    if prefill_s is not None:
        report_prefill(args, cfg, read_bytes, prefill_s, device, dtype)


def run_peer(
    args: argparse.Namespace, loaded: object, device: torch.device, dtype: torch.dtype
) -> dict[int, float]:
    from bench import hf_peer

    hf = hf_config_of(args.model)
    del loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = hf_peer.build_model(hf, device, dtype)
    out = {}
    for b in args.batch:
        out[b] = hf_peer.decode_tok_s(model, b, args.prompt_len, args.steps)
        print(f"# transformers batch {b}: {out[b]:.1f} tok/s", flush=True)
    return out


def hf_config_of(spec: str) -> dict:
    from ds4pool.model import demo
    from ds4pool.model.loader import read_json

    if spec.startswith("random:"):
        return demo.preset_hf_config(spec)
    directory = demo.ensure_demo_model() if spec == "demo" else Path(spec).expanduser()
    return read_json(directory / "config.json")


def report_prefill(
    args: argparse.Namespace,
    cfg: object,
    read_bytes: int,
    seconds: float,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    n = args.prefill
    params = read_bytes / dtype.itemsize
    # matmul FLOPs of the weights plus causal attention (QK^T and PV over n(n+1)/2 pairs)
    flops = 2 * params * n + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
    rate = matmul_rate(device, dtype) if device.type == "cuda" else None
    line = f"\nprefill of one {n}-token prompt: {seconds:.3f} s = {n / seconds:,.0f} tok/s, "
    line += f"{flops / seconds / 1e12:.1f} TFLOP/s"
    if rate:
        line += f" = {100 * flops / seconds / rate:.0f}% of the bf16 matmul rate measured here "
        line += f"({rate / 1e12:.0f} TFLOP/s, 8192^3)"
    print(line)


if __name__ == "__main__":
    main()
