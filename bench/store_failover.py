"""TTFT of a session's first turn on a new replica: restore from the shared store vs re-prefill.

    python bench/store_failover.py                        # random:100m, CPU, float32, 4096
    python bench/store_failover.py --context 2048 --repeats 3

Method. Two replicas (two SessionPools with their own ModelRunner, `replica_id` "a" and "b")
share one store directory, as `ds4pool serve --replica-id` processes do. Replica a builds
--repeats sessions of --context tokens (random ids, the same for all), snapshots them to the
store and releases their leases, as a drained replica does (a SIGKILLed one's leases expire
after --lease-ttl-s; the restore is the same). Replica b then serves each session's next turn,
the context plus --new-tokens, driven as the API and the scheduler drive it:

    open_from_store (lease claim + header of the snapshot a wrote) → acquire → match_prefix
    (reads and verifies the snapshot) → restore → prefill the new tokens → first token

TTFT is the wall time from open_from_store() to the first sampled token. The re-prefill row
is the same turn on b for a session the store does not hold: the whole prompt computed, what
a replica without a shared store (or with a corrupt snapshot) does. Rows run interleaved,
one turn of each per round; the header says how many cores other processes kept busy.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.session_resume import CpuMeter, prefill  # noqa: E402
from ds4pool.engine import fingerprint_for  # noqa: E402
from ds4pool.kv.pool import DeviceKV, PoolConfig, SessionPool  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.device import select_device, select_dtype  # noqa: E402
from ds4pool.model.loader import LoadedModel, load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner  # noqa: E402

TENANT = "bench"
BLOCK_SIZE = 16
MB = 1e6


def replica(loaded: LoadedModel, store: Path, name: str, tokens: int) -> SessionPool:
    runner = ModelRunner(loaded, -(-tokens // BLOCK_SIZE) + 4, block_size=BLOCK_SIZE)
    cfg = PoolConfig(
        num_device_blocks=runner.num_blocks,
        block_size=BLOCK_SIZE,
        ram_bytes=1 << 30,
        disk_dir=store,
        disk_bytes=16 << 30,
        persist_idle_s=0,
        persist_every_tokens=0,
        replica_id=name,
        restore_policy="always",  # measure the read (kv/cost.py could pick recompute)
    )
    pool = SessionPool(cfg, DeviceKV(runner.kv_caches, runner.layout), fingerprint_for(loaded))
    pool.bench_runner = runner  # type: ignore[attr-defined]
    return pool


def turn(pool: SessionPool, sid: str, ids: list[int], chunk: int) -> tuple[float, int]:
    """One request of session `sid` on `pool`; returns (TTFT seconds, tokens reused)."""
    runner: ModelRunner = pool.bench_runner  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    pool.open_from_store(TENANT, sid)
    s = pool.acquire(TENANT, sid)
    try:
        m = s.prepare(prompt_ids=ids)
        s.restore()
        s.reserve(len(ids))
        prefill(runner, s, ids, m.num_cached, chunk)
        ttft = time.perf_counter() - t0
        s.commit(ids, "", len(ids))
    finally:
        s.release()
    return ttft, m.num_cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:100m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=4096, help="tokens already in the session")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens added by the turn")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--repeats", type=int, default=3, help="turns per row (median)")
    ap.add_argument("--store", type=Path, default=None, help="default: a temp dir, removed")
    args = ap.parse_args()

    device = select_device(args.device)
    loaded = load_model(args.model, device, select_dtype(args.dtype, device))
    store = args.store or Path(tempfile.mkdtemp(prefix="ds4pool-store-"))
    rng = random.Random(0)
    vocab = loaded.config.vocab_size

    def random_ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    # a different context per session and per row: no turn finds another's blocks on the
    # device (the block index shares a tenant's blocks by content)
    contexts = [random_ids(args.context) for _ in range(2 * args.repeats)]
    total = args.context + args.new_tokens
    cpu = CpuMeter()
    a = replica(loaded, store, "a", total)
    sids = [f"agent-{i}" for i in range(args.repeats)]
    for sid, context in zip(sids, contexts):  # a builds, persists, lets go (drained)
        turn(a, sid, context, args.chunk)
        a.evict(TENANT, sid, "disk")  # written to the store; the device blocks freed
    a.close()  # releases the leases
    b = replica(loaded, store, "b", total)
    turn(b, "warm-up", random_ids(min(args.chunk, args.context) + args.new_tokens), args.chunk)
    b.drop(TENANT, "warm-up")
    moved, fresh = [], []
    for i, sid in enumerate(sids):
        new = random_ids(args.new_tokens)
        ttft, reused = turn(b, sid, contexts[i] + new, args.chunk)
        assert reused == args.context, (reused, args.context)  # restored, not recomputed
        moved.append(ttft)
        b.drop(TENANT, sid)  # frees b's blocks for the next turn (and the file: fine, read)
        ttft, reused = turn(b, f"fresh-{i}", contexts[args.repeats + i] + new, args.chunk)
        assert reused == 0
        fresh.append(ttft)
        b.drop(TENANT, f"fresh-{i}")
    snapshot_mb = args.context * b.kv_bytes_per_token / MB
    b.close()
    cpu.stop()
    if args.store is None:
        shutil.rmtree(store, ignore_errors=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"# {args.model} on {device} ({name}), {str(loaded.dtype).removeprefix('torch.')}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{datetime.now():%Y-%m-%d %H:%M}"
    )
    print(
        f"# context {args.context} + {args.new_tokens} new tokens, chunk {args.chunk}; KV "
        f"{snapshot_mb:.1f} MB; median (min-max) of {args.repeats}; bench took "
        f"{cpu.wall_s:.0f}s, other processes used {cpu.others_cores:.2f} of "
        f"{os.cpu_count()} cores meanwhile"
    )
    if cpu.others_cores > 0.1:
        print("# WARNING: other processes competed for the CPU: timings are inflated and noisy")
    base = statistics.median(fresh)
    print("| first turn on the new replica | TTFT ms | vs re-prefill |")
    print("|---|---:|---:|")
    for label, xs in (
        ("restored from the store (another replica's snapshot)", moved),
        ("re-prefill of the whole prompt", fresh),
    ):
        med = statistics.median(xs)
        print(
            f"| {label} | {med * 1e3:,.0f} ({min(xs) * 1e3:,.0f}-{max(xs) * 1e3:,.0f}) | "
            f"{med / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
