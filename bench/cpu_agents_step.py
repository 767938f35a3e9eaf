"""One CPU step of the multi-agent workload, whole (projections, attention, norms, sampling),
on tables laid out as a server's are after a few turns, optionally against an older checkout.

    python bench/cpu_agents_step.py --model /tmp/m77 --prefix 600 --own 230
    python bench/cpu_agents_step.py --model /tmp/m77 --prefix 2400 --own 880 --chunks 0 64 \
        --before-ref 8582289 --rounds 3

B = --rows sessions decode one token each at --prefix + --own tokens of KV: the first
--prefix tokens are one system prompt's blocks, shared by all of them (as sessions of one
tenant share them), the rest each session's own, handed out as a server hands them out
while sessions are served side by side: the first half in prompt chunks of 4 blocks, the
rest one block at a time round robin (decoding in lockstep). With --chunks C > 0 the step
also carries C prompt tokens of one more session on the same prefix (what
`--max-prefill-tokens C` gives while others decode).

As `ds4pool serve` runs it on CPU: projections packed for oneDNN (`--cpu-linear auto`),
OMP_WAIT_POLICY=PASSIVE, glibc's mmap threshold at 1 MiB (ds4pool/allocator.py), --threads
torch threads (the server's `--cpu-threads auto` on a 2-core box: 1, or 2 where its start-up
probe times a step at most 0.85x as long with 2). Every (code, C) runs
in a fresh process per round, the codes alternating, so a busy machine slows both alike;
with --before-ref the "before" processes import ds4pool from a git worktree of that ref
(made under /tmp, removed at the end). Printed per code and C: a step's median and best
wall time over all rounds, and minor page faults per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout(rows: int, prefix: int, own: int, bs: int, pool) -> list[list[int]]:  # noqa: ANN001
    """Block tables of rows + 1 sessions (the last one's for the prompt chunk)."""
    shared = pool.allocate(prefix // bs)
    tables = [list(shared)]
    for _ in range(rows):
        pool.incref(shared)
        tables.append(list(shared))
    own_blocks = -(-(prefix % bs + own) // bs) + 1  # one spare block past the context
    done = [0] * len(tables)
    while min(done) < own_blocks // 2:  # prompt chunks of 4 blocks, side by side
        for i in range(len(tables)):
            n = min(4, own_blocks // 2 - done[i])
            if n > 0:
                tables[i] += pool.allocate(n)
                done[i] += n
    while min(done) < own_blocks:  # decoding in lockstep: a block each in turn
        for i in range(len(tables)):
            if done[i] < own_blocks:
                tables[i] += pool.allocate(1)
                done[i] += 1
    return tables


def child(args: argparse.Namespace) -> None:
    """Time the steps in this process (ds4pool from sys.path: the code under test)."""
    from ds4pool.threads import apply_thread_env

    apply_thread_env(os.environ)  # before torch loads, as the CLI does
    from ds4pool.allocator import fix_mmap_threshold

    fix_mmap_threshold(os.environ)
    import torch

    from ds4pool.kv.blocks import BlockPool
    from ds4pool.model.cpu_linear import pack_cpu_linears
    from ds4pool.model.loader import load_model
    from ds4pool.model.runner import ModelRunner, SeqInput

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    loaded = load_model(args.model, cpu, torch.float32)
    pack_cpu_linears(loaded.model, "auto", cpu, torch.float32)
    bs = 16
    num_blocks = (args.prefix + (args.own + 2 * bs) * (args.rows + 1)) // bs + 8
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=bs)
    tables = layout(args.rows, args.prefix, args.own, bs, BlockPool(runner.num_blocks))
    ctx = args.prefix + args.own
    seqs = [SeqInput([7], ctx - 1, tables[i], seq_id=i + 1) for i in range(args.rows)]
    if args.chunk:
        ids = [7 + i % 64 for i in range(args.chunk)]
        seqs.append(SeqInput(ids, ctx - args.chunk, tables[-1], seq_id=args.rows + 1))
    for _ in range(2):  # warm-up: oneDNN primitives, the input batch
        runner.step(seqs)
    times = []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.steps):
        t0 = time.perf_counter()
        runner.step(seqs)
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / args.steps
    print(json.dumps({"times": times, "faults": faults}))


def run_child(code: Path | None, args: argparse.Namespace, chunk: int) -> dict:
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--chunk", str(chunk)]
    for name in ("model", "rows", "prefix", "own", "steps", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code or ROOT)
    if out.returncode:
        sys.exit(f"cpu_agents_step: the child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rows", type=int, default=16, help="decoding sessions")
    ap.add_argument("--prefix", type=int, default=600, help="shared system prompt tokens")
    ap.add_argument("--own", type=int, default=230, help="each session's own tokens")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per process")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before-ref", help="also time ds4pool as it was at this git ref")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from ds4pool.machine import cpu_name

    codes: dict[str, Path | None] = {"now": None}
    tmp = None
    if args.before_ref:
        tmp = Path(tempfile.mkdtemp(prefix="ds4pool-before-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tmp / "tree"), args.before_ref],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        codes = {"before": tmp / "tree", "now": None}
    print(
        f"# {args.model} on cpu ({cpu_name()}), float32, {args.threads} thread(s), "
        f"{args.rows} rows at {args.prefix} shared + {args.own} own tokens, "
        f"{args.steps} steps x {args.rounds} rounds, {datetime.now().isoformat(timespec='seconds')}"
    )
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for rnd in range(args.rounds):
            names = list(codes) if rnd % 2 == 0 else list(codes)[::-1]
            for chunk in args.chunks:
                for name in names:
                    results.setdefault((name, chunk), []).append(
                        run_child(codes[name], args, chunk)
                    )
    finally:
        if tmp is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "tree")], cwd=ROOT)
    print("| code | C | step median / best (ms) | x before | minor faults per step |")
    print("|---|---:|---:|---:|---:|")
    for chunk in args.chunks:
        base = None
        for name in codes:
            runs = results[(name, chunk)]
            times = [t for r in runs for t in r["times"]]
            med = statistics.median(times)
            base = base or med
            faults = statistics.median(r["faults"] for r in runs)
            print(
                f"| {name} | {chunk} | {med * 1e3:,.0f} / {min(times) * 1e3:,.0f} "
                f"| {med / base:.2f} | {faults:,.0f} |"
            )


if __name__ == "__main__":
    main()
