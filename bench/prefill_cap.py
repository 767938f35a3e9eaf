"""What a prompt chunk costs the decoders next to it: step time vs the per-step prefill cap.

    python bench/prefill_cap.py --model DIR --decoders 16 --context 2800 \
        --chunks 0 32 64 128 256 512 --rounds 5

The multi-agent workload's steady state, in process: --decoders sequences decode (one token
each per step) at about --context tokens of KV, and every step also carries C prompt tokens of
one more sequence at the same context (a resumed turn's tool result, or a first turn's system
prompt), C = each --chunks value (0 = a decode-only step). A step with C prompt tokens is what
`--max-prefill-tokens C` gives while the others decode, so its duration is their
inter-token latency while any prompt is being prefilled, and C / step is the prompt rate
the cap leaves (how fast first turns and tool results get in). Per C and round, --steps
steps are timed after one warm-up; the C values alternate round by round so that a busy
machine slows every C alike. The KV is not prefilled (its content does not change the time
of a step), which keeps the bench to seconds.

Also per C: CPU seconds per step in user and kernel mode and minor page faults per step
(getrusage, all threads of the process): kernel time that grows with the batch is the
signature of per-step temporaries large enough for malloc to map and unmap them each time.
--paths gather cpu adds the reference (gathering) attention path for comparison.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.kv.blocks import BlockPool, BlockTable  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.attention import TorchPagedAttention  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402

PATHS = {"gather": False, "cpu": True}


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def time_steps(
    runner: ModelRunner, tables: list[BlockTable], context: int, chunk: int, steps: int
) -> tuple[list[float], tuple[float, float, float]]:
    """Wall seconds of each of `steps` steps (after one warm-up) and, per step, (user s,
    sys s, minor faults). Decoders sit at `context`; the prompt's chunk ends there too."""
    decoders, prompt = tables[:-1], tables[-1]
    seqs = [
        SeqInput([7], context - 1, t.blocks, seq_id=i + 1, table_epoch=t.epoch)
        for i, t in enumerate(decoders)
    ]
    if chunk:
        ids = [7 + i % 64 for i in range(chunk)]
        seqs.append(SeqInput(ids, context - chunk, prompt.blocks, sample=True))
    times = []
    runner.step(seqs)  # warm-up (a new batch shape)
    u0, s0, f0 = _usage()
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step(seqs)  # ends with the readback of the sampled ids
        times.append(time.perf_counter() - t0)
    u1, s1, f1 = _usage()
    return times, ((u1 - u0) / steps, (s1 - s0) / steps, (f1 - f0) / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--context", type=int, default=2800, help="KV tokens per sequence")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 32, 64, 128, 256, 512])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per C and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["cpu"])
    args = ap.parse_args()
    if 0 not in args.chunks:
        args.chunks = [0, *args.chunks]

    loaded = load_model(args.model, torch.device("cpu"), torch.float32)
    backends = {m.backend for m in loaded.model.modules() if hasattr(m, "backend")}
    backend = backends.pop()
    assert not backends and isinstance(backend, TorchPagedAttention)
    bs = 16
    per_seq = -(-args.context // bs)
    runner = ModelRunner(loaded, num_blocks=per_seq * (args.decoders + 1) + 1, block_size=bs)
    pool = BlockPool(runner.num_blocks)
    tables = [BlockTable(bs) for _ in range(args.decoders + 1)]
    for t in tables:
        t.ensure(pool, args.context)
    print(
        f"# {args.model} on cpu ({cpu_name()}), float32, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, {args.decoders} decoders at {args.context} tokens of KV, "
        f"{args.steps} steps x {args.rounds} alternating rounds, "
        f"{datetime.now().isoformat(timespec='seconds')}"
    )
    walls: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for rnd in range(args.rounds):
        order = args.chunks if rnd % 2 == 0 else args.chunks[::-1]
        for path in args.paths:
            backend.cpu_kernels = PATHS[path]
            for c in order:
                times, use = time_steps(runner, tables, args.context, c, args.steps)
                walls.setdefault((path, c), []).extend(times)
                cpu.setdefault((path, c), []).append(use)
    print(
        "| path | C (prompt tokens per step) | step p50 / p90 (ms) | x decode-only step "
        "| prompt tok/s | decode tok/s | CPU user / sys per step (ms) | minor faults per step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.paths:
        base = statistics.median(walls[(path, 0)])
        for c in args.chunks:
            xs = sorted(walls[(path, c)])
            p50, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
            user, sys_s, faults = (
                statistics.median(u[k] for u in cpu[(path, c)]) for k in range(3)
            )
            print(
                f"| {path} | {c} | {p50 * 1e3:,.0f} / {p90 * 1e3:,.0f} | {p50 / base:.2f} "
                f"| {c / p50:,.0f} | {args.decoders / p50:,.0f} "
                f"| {user * 1e3:,.0f} / {sys_s * 1e3:,.0f} | {faults:,.0f} |"
            )
    for t in tables:
        t.release(pool)


if __name__ == "__main__":
    main()
