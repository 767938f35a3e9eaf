"""How long tier I/O stalls the step loop: the inter-token gaps of a decoding session while
other sessions are demoted to disk and restored from it, for two versions of the code.

    python bench/tier_stall.py --before-ref main          # this tree vs main, same run
    python bench/tier_stall.py --session-mb 100 --cycles 2

Method. Each version runs in its own child process (`--child DIR` puts DIR first on
sys.path, so the child imports that tree's ds4pool). A child builds an Engine on the CPU
with --model (random:100m: 24 KiB of fp32 KV per token, so 200 MB is 8.5k tokens), fills
the device KV tensors with random values (incompressible, like real KV: lz4 cannot shrink
it), and creates --sessions idle sessions of --session-mb of KV each through the pool
(acquire → prepare → restore → reserve → commit: no prefill).
The RAM tier holds one of them. Then one session decodes (greedy, ignore_eos, requests of
--tokens tokens back to back) while a mover thread, per cycle and session:

- evict-disk: `pool.evict(..., "disk")`, what `POST /admin/sessions/.../evict` runs (in a
  worker thread): device → host copy and a snapshot write;
- restore: a one-token request on that session (its whole history reused, checked): the
  KV comes back from disk (snapshot read, checksum, decode, host → device copy);
- evict-ram: `pool.evict(..., "ram")`: device → host, which pushes the RAM tier's previous
  entry out to disk (a RAM-overflow snapshot write).

The quiet row is the same decode with no mover. A gap is the time between two consecutive
tokens of one decode request (the step loop's pace); the table gives p50, p99 and the max of
those gaps, how many exceeded 50 ms, and the longest gap overlapping each kind of move. The
decoding session's own steps also carry the one-token prefill of a restored session (its
attention reads the whole restored context): that is compute, the same in both versions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

KIB = 1024
MB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- child


def child(args: argparse.Namespace) -> dict[str, object]:
    sys.path.insert(0, str(Path(args.child).resolve()))
    import torch

    import ds4pool
    from ds4pool.engine import Engine, EngineConfig
    from ds4pool.sched.request import Request

    torch.set_num_threads(args.threads)
    disk_dir = Path(tempfile.mkdtemp(prefix="tier-stall-"))
    session_bytes = args.session_mb * MB
    cfg = EngineConfig(
        model=args.model,
        device="cpu",
        dtype="float32",
        kv_device_gb=(args.sessions + 1) * session_bytes / (1 << 30) + 0.05,
        kv_ram_gb=1.2 * session_bytes / (1 << 30),  # one session fits, a second overflows
        kv_disk_dir=disk_dir,
        kv_disk_gb=4 * args.sessions * session_bytes / (1 << 30),
        kv_persist_idle_s=0,
        kv_persist_every_tokens=0,
    )
    e = Engine(cfg)
    pool = e.pool
    gen = torch.Generator().manual_seed(1)
    for cache in e.runner.kv_caches:
        cache.normal_(generator=gen)
    per_token = pool.kv_bytes_per_token
    n_tokens = session_bytes // per_token
    vocab = e.loaded.config.vocab_size
    rng = random.Random(2)
    histories: dict[str, list[int]] = {}
    for i in range(args.sessions):
        key = f"big-{i}"
        ids = [rng.randrange(3, vocab) for _ in range(n_tokens)]
        s = pool.acquire("default", key)
        if hasattr(pool, "match_prefix"):  # a tree from before SessionLease (--before-ref)
            pool.match_prefix(s, prompt_ids=ids)
            pool.restore(s)
            pool.ensure_blocks(s, len(ids))
            pool.commit(s, ids, "", len(ids))
            pool.release(s)
        else:
            s.prepare(prompt_ids=ids)
            s.restore()
            s.reserve(len(ids))
            s.commit(ids, "", len(ids))
            s.release()
        histories[key] = ids

    def decode(stop: threading.Event, gaps: list[tuple[float, float]], limit: int = 0) -> None:
        """Decode requests back to back until `stop` (or `limit` gaps); record the gaps."""
        prompt = [rng.randrange(3, vocab) for _ in range(64)]
        while not stop.is_set() and not (limit and len(gaps) >= limit):
            req = Request(
                session_id="decoder", prompt_ids=prompt, max_tokens=args.tokens, ignore_eos=True
            )
            last = None
            for ev in e.submit(req):
                now = time.perf_counter()
                if ev.token_ids:
                    if last is not None:
                        gaps.append((last, now))
                    last = now

    # The step loop's own pool work: schedule() (admission: acquire, match, restore, block
    # growth, pressure demotions; lock waits included) and the forward, timed per step.
    spans: dict[str, list[tuple[float, float]]] = {"schedule": [], "forward": []}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[name].append((t0, time.perf_counter()))

        return run

    e.scheduler.schedule = timed("schedule", e.scheduler.schedule)  # type: ignore[method-assign]
    e.runner.step = timed("forward", e.runner.step)  # type: ignore[method-assign]

    quiet: list[tuple[float, float]] = []  # the same decode with nothing moving
    decode(threading.Event(), quiet, limit=2 * args.tokens)

    quiet_end = time.perf_counter()
    moves: list[tuple[str, float, float]] = []  # (kind, start, end)
    busy: list[tuple[float, float]] = []
    stop = threading.Event()
    t = threading.Thread(target=decode, args=(stop, busy))
    t.start()
    time.sleep(0.5)
    for _ in range(args.cycles):
        for key, ids in histories.items():
            t0 = time.perf_counter()
            pool.evict("default", key, "disk")
            t1 = time.perf_counter()
            moves.append(("evict-disk", t0, t1))
            stream = e.submit(Request(session_id=key, prompt_ids=ids + [5], max_tokens=1))
            for ev in stream:
                if ev.finish_reason == "error":
                    raise SystemExit(f"the restore request failed: {ev.error}")
                if ev.finished and ev.usage and ev.usage.cached_tokens != len(ids):
                    raise SystemExit(f"restored {ev.usage.cached_tokens} of {len(ids)} tokens")
            t2 = time.perf_counter()
            moves.append(("restore", t1, t2))
            pool.evict("default", key, "ram")
            t3 = time.perf_counter()
            moves.append(("evict-ram", t2, t3))
            time.sleep(0.2)
    time.sleep(0.5)
    stop.set()
    t.join()
    e.close()
    shutil.rmtree(disk_dir, ignore_errors=True)
    return {
        "code": str(Path(ds4pool.__file__).resolve().parents[1]),
        "session_mb": args.session_mb,
        "n_tokens": n_tokens,
        "quiet": [b - a for a, b in quiet],
        "busy": busy,
        "moves": moves,
        "schedule_quiet": [b - a for a, b in spans["schedule"] if b <= quiet_end],
        "schedule_busy": [b - a for a, b in spans["schedule"] if a > quiet_end],
        "forward_busy": [b - a for a, b in spans["forward"] if a > quiet_end],
    }


# ----------------------------------------------------------------------------- parent


def ms_stats(values: list[float]) -> tuple[float, float, float]:
    ms = sorted(v * 1e3 for v in values) or [0.0]
    return statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))], ms[-1]


def report(label: str, res: dict[str, Any]) -> list[str]:
    busy, moves = res["busy"], res["moves"]
    worst: dict[str, float] = {}
    took: dict[str, list[float]] = {}
    for kind, m0, m1 in moves:
        overlapping = [b - a for a, b in busy if a < m1 and b > m0]
        worst[kind] = max([worst.get(kind, 0.0), *overlapping])
        took.setdefault(kind, []).append(m1 - m0)
    per_kind = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in worst.items())
    durations = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in took.items())
    lines = []
    for phase, gaps, sched, extra in (
        ("quiet", res["quiet"], res["schedule_quiet"], " | |"),
        ("moving", [b - a for a, b in busy], res["schedule_busy"], f" {per_kind} | {durations} |"),
    ):
        p50, p99, top = ms_stats(gaps)
        over = sum(g > 0.05 for g in gaps)
        s50, _, stop = ms_stats(sched)
        lines.append(
            f"| {label} | {phase} | {len(gaps)} | {p50:.1f} | {p99:.1f} | {top:.1f} | {over} "
            f"| {s50:.2f} | {stop:.1f} |{extra}"
        )
    return lines


def cores_busy_elsewhere(seconds: float, busy0: float, own0: float) -> float:
    return max(0.0, (_busy_s() - busy0 - (_own_s() - own0)) / seconds)


def _busy_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before-ref", default=None, help="git ref to compare with (e.g. main)")
    ap.add_argument("--model", default="random:100m", help="24 KiB of fp32 KV per token")
    ap.add_argument("--session-mb", type=int, default=200, help="KV of each moved session")
    ap.add_argument("--sessions", type=int, default=2, help="sessions moved in turn")
    ap.add_argument("--cycles", type=int, default=2, help="evict/restore cycles per session")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per decode request")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(child(args)))
        return
    trees: list[tuple[str, Path]] = []
    tmp = Path(tempfile.mkdtemp(prefix="tier-stall-src-"))
    if args.before_ref:
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before_ref], check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        trees.append((f"before ({args.before_ref})", before))
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    trees.append((f"after ({head})", REPO))
    t0, busy0, own0 = time.perf_counter(), _busy_s(), _own_s()
    lines = []
    for label, tree in trees:
        out = tmp / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree)]
        cmd += ["--out", str(out), "--session-mb", str(args.session_mb), "--model", args.model]
        cmd += ["--sessions", str(args.sessions), "--cycles", str(args.cycles)]
        cmd += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
        subprocess.run(cmd, check=True, cwd=tree)
        res = json.loads(out.read_text())
        lines += report(label, res)
    elsewhere = cores_busy_elsewhere(time.perf_counter() - t0, busy0, own0)
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"# tier_stall: {args.sessions} sessions x {args.session_mb} MB of KV moved, "
        f"{args.cycles} cycles; {args.model}, CPU, {args.threads} torch threads; "
        f"{elsewhere:.2f} cores busy elsewhere ({os.cpu_count()} cores)"
    )
    print(
        "| code | phase | gaps | gap p50 ms | gap p99 ms | gap max ms | gaps > 50 ms "
        "| schedule() p50 ms | schedule() max ms "
        "| longest gap (ms) overlapping each move | median move time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
