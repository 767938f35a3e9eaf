"""Time to first token when resuming a long session, by where its KV was, vs re-prefilling.

    python bench/session_resume.py                      # random:100m, CPU, float32, 8192
    python bench/session_resume.py --context 2048 --repeats 3 --scenarios device ram disk

Method. One session of --context tokens (random ids) is built once through the pool. Each
measured turn is what an agent's next request looks like: the whole history plus
--new-tokens new ones (a tool result), driven exactly as the scheduler will drive it:

    acquire → prepare → restore → reserve → prefill the new tokens in --chunk
    pieces (sampling on the last) → commit → release

TTFT is the wall time from acquire() to the first sampled token (the runner's one host
sync per step). After each turn the session is truncated back to --context tokens, so every
repetition resumes the same context. Before a turn the session's KV is put where the row
says, with the pool's own admin path (`evict(..., "ram" | "disk")`):

- device: the KV stayed in the paged blocks; only the new tokens are computed.
- ram: evicted to a host tensor; restore scatters it back into device blocks.
- disk: evicted to a snapshot file (lz4, CRC, fsync); restore reads and decodes it into a
  host tensor, then scatters that.
- disk, after restart: the pool is closed and a new SessionPool is opened over the same
  directory (as after a process restart), so the session is rebuilt from the file's index
  entry and its tokens and KV are read back from the file.
- disk, after restart, pages dropped: as above, after posix_fadvise(DONTNEED) on the
  snapshot file, which asks the kernel to drop its (clean) cached pages. The "block-device
  reads" column (/proc/self/io read_bytes) says whether the read really went to the device.
- re-prefill: the session is dropped and the whole prompt is computed from scratch, which
  is what a single-slot server does when it switches sessions.

Restore seconds come from the pool's observer hook `restored(tier, seconds)`: one "ram"
event for a RAM restore, one "disk" event for a disk restore (snapshot read and decode plus
the copy into the device blocks; before the pool merged them a disk restore reported a
"disk" and a "ram" event, and the two split columns come from that). Restore MB/s is the
session's KV bytes (10^6 bytes per MB) divided by the restore seconds. Evict seconds (the
demotion before the turn, not part of TTFT) are shown for reference. Each resume row is the
median of
--repeats turns, run interleaved (one turn of every row per round) so that a burst of load
from elsewhere does not land on one row; the re-prefill row is the median of
--prefill-repeats, the first before the resume rows, the rest after (slow on CPU). The header
says how many cores other processes kept busy during the run (from /proc/stat); above 0.1
the output carries a warning.
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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.engine import fingerprint_for  # noqa: E402
from ds4pool.kv.lease import SessionLease  # noqa: E402
from ds4pool.kv.pool import DeviceKV, PoolConfig, PoolObserver, SessionPool  # noqa: E402
from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.device import select_device, select_dtype  # noqa: E402
from ds4pool.model.loader import LoadedModel, load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402

TENANT, SESSION = "bench", "agent-1"
BLOCK_SIZE = 16
MB = 1e6

# scenario → table label
SCENARIOS = {
    "device": "device (KV stayed in the paged blocks)",
    "ram": "RAM (evicted to a host tensor)",
    "disk": "disk (snapshot file, same process)",
    "disk-restart": "disk, after restart (new SessionPool over the directory)",
    "disk-cold": "disk, after restart, file pages dropped (fadvise)",
}
RESTARTS = ("disk-restart", "disk-cold")


def block_device_read_bytes() -> int:
    """Bytes this process caused to be read from a block device (0 where not reported)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache (best effort)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class RestoreTimer(PoolObserver):
    """Collects the pool's restored(tier, seconds) events of one turn."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def restored(self, tier: str, seconds: float) -> None:
        self.events.append((tier, seconds))

    def take(self) -> list[tuple[str, float]]:
        events, self.events = self.events, []
        return events


@dataclass
class Sample:
    ttft_s: float
    num_reused: int
    num_computed: int
    to_ram_s: float = 0.0  # "disk" event: snapshot read + decode into host RAM
    to_device_s: float = 0.0  # "ram" event: host tensor → device blocks
    evict_s: float = 0.0  # the demotion before the turn (not in TTFT)
    device_read_bytes: int = 0  # block-device reads during the turn

    @property
    def restore_s(self) -> float:
        return self.to_ram_s + self.to_device_s


def prefill(runner: ModelRunner, s: SessionLease, ids: list[int], start: int, chunk: int) -> int:
    """Compute ids[start:] in chunks, sampling on the last one; returns the sampled id."""
    blocks = s.table().block_ids
    sampled: int | None = None
    for pos in range(start, len(ids), chunk):
        piece = ids[pos : pos + chunk]
        last = pos + len(piece) == len(ids)
        out = runner.step([SeqInput(piece, pos, blocks, sample=last)])
        if last:
            sampled = out.sampled[0]
    assert sampled is not None
    return sampled


class Bench:
    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, disk_dir: Path) -> None:
        self.loaded = loaded
        self.args = args
        self.disk_dir = disk_dir
        total = args.context + args.new_tokens
        self.runner = ModelRunner(loaded, -(-total // BLOCK_SIZE) + 2, block_size=BLOCK_SIZE)
        self.observer = RestoreTimer()
        self.rng = random.Random(0)
        self.context_ids = self.random_ids(args.context)
        self.pool = self.open_pool()
        self.last_snapshot_bytes = 0

    def random_ids(self, n: int) -> list[int]:
        vocab = self.loaded.config.vocab_size
        return [self.rng.randrange(3, vocab) for _ in range(n)]

    def open_pool(self) -> SessionPool:
        cfg = PoolConfig(
            num_device_blocks=self.runner.num_blocks,
            block_size=BLOCK_SIZE,
            ram_bytes=4 << 30,
            disk_dir=self.disk_dir,
            disk_bytes=16 << 30,
            persist_idle_s=0,
            persist_every_tokens=0,
        )
        return SessionPool(
            cfg,
            DeviceKV(self.runner.kv_caches, self.runner.layout),
            fingerprint_for(self.loaded),
            self.observer,
        )

    @property
    def kv_bytes(self) -> int:
        return self.args.context * self.pool.kv_bytes_per_token

    def snapshot_path(self) -> Path:
        assert self.pool.disk is not None
        return self.pool.disk.path_for(TENANT, SESSION)

    def turn(self) -> Sample:
        """One timed turn: the context plus fresh new tokens; then roll back to the context."""
        ids = self.context_ids + self.random_ids(self.args.new_tokens)
        self.observer.take()
        io0 = block_device_read_bytes()
        t0 = time.perf_counter()
        s = self.pool.acquire(TENANT, SESSION)
        try:
            m = s.prepare(prompt_ids=ids)
            s.restore()
            s.reserve(len(ids))
            prefill(self.runner, s, ids, m.num_cached, self.args.chunk)
            ttft = time.perf_counter() - t0
            s.commit(ids, "", len(ids))
            s.truncate(self.args.context)  # every repetition resumes the same KV
        finally:
            s.release()
        sample = Sample(ttft, m.num_cached, len(ids) - m.num_cached)
        sample.device_read_bytes = block_device_read_bytes() - io0
        for tier, seconds in self.observer.take():
            if tier == "disk":
                sample.to_ram_s += seconds
            else:
                sample.to_device_s += seconds
        return sample

    def warm_up(self) -> None:
        """An untimed ephemeral turn (one full chunk, then the new tokens), so one-time
        costs of both step shapes land in no measurement."""
        ids = self.random_ids(min(self.args.chunk, self.args.context) + self.args.new_tokens)
        s = self.pool.acquire(TENANT, None)
        try:
            s.prepare(prompt_ids=ids)
            s.restore()
            s.reserve(len(ids))
            prefill(self.runner, s, ids, 0, self.args.chunk)
        finally:
            s.release()

    def re_prefill(self) -> Sample:
        """Forget the session everywhere (its file too) and compute the whole prompt."""
        if self.pool.get(TENANT, SESSION) is not None:
            self.pool.drop(TENANT, SESSION)
        sample = self.turn()
        assert sample.num_reused == 0, sample
        return sample

    def resume(self, scenario: str) -> Sample:
        evict_s = 0.0
        if scenario != "device":
            t0 = time.perf_counter()
            self.pool.evict(TENANT, SESSION, "ram" if scenario == "ram" else "disk")
            evict_s = time.perf_counter() - t0
        if scenario in RESTARTS:
            self.pool.close()
            self.pool = self.open_pool()
            info = self.pool.get(TENANT, SESSION)
            assert info is not None and info.tier == "disk", info
        if scenario == "disk-cold":
            drop_cached_pages(self.snapshot_path())
        sample = self.turn()
        assert sample.num_reused == self.args.context, sample
        sample.evict_s = evict_s
        return sample

    def snapshot_bytes(self) -> int:
        return self.snapshot_path().stat().st_size if self.snapshot_path().exists() else 0


class CpuMeter:
    """Wall time, and how many cores other processes kept busy meanwhile (/proc/stat busy
    time minus this process's own CPU time): the bench's noise indicator on a shared box."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy_s(), self._own_s()
        self.wall_s = self.others_cores = 0.0

    @staticmethod
    def _busy_s() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return 0.0
        idle = fields[3] + fields[4]  # idle + iowait; steal (fields[7]) is not ours
        return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> None:
        self.wall_s = time.perf_counter() - self.t0
        others = (self._busy_s() - self.busy0) - (self._own_s() - self.own0)
        self.others_cores = max(0.0, others) / self.wall_s


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def row(label: str, samples: list[Sample], baseline_s: float, kv_bytes: int) -> str:
    ttft = median(samples, "ttft_s")
    ratio = ttft / baseline_s
    restore = median(samples, "restore_s")
    lo, hi = min(s.ttft_s for s in samples), max(s.ttft_s for s in samples)
    cells = [
        label,
        f"{ttft:.3f} ({lo:.3f}–{hi:.3f})",
        f"{ratio:.3f} ({1 / ratio:.0f}× faster)",
        f"{median(samples, 'num_computed'):.0f}",
    ]
    if restore > 0:
        to_ram = median(samples, "to_ram_s")
        cells += [
            f"{restore:.3f}",
            f"{kv_bytes / MB / restore:,.0f}",
            f"{to_ram:.3f}" if to_ram else "—",
            f"{median(samples, 'to_device_s'):.3f}",
        ]
    else:
        cells += ["—", "—", "—", "—"]
    evict = median(samples, "evict_s")
    cells.append(f"{evict:.3f}" if evict else "—")
    cells.append(f"{median(samples, 'device_read_bytes') / MB:.0f}")
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| KV was on | TTFT s (min–max) | TTFT / re-prefill | tokens computed | restore s "
    "| restore MB/s | disk→RAM s | RAM→device s | evict s (not in TTFT) | block-device reads MB |"
)
SEPARATOR = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:100m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=8192, help="tokens already in the session")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens added by the turn")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--repeats", type=int, default=5, help="turns per resume row (median)")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="re-prefill turns (median)")
    ap.add_argument("--disk-dir", type=Path, default=None, help="default: a temp dir, removed")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    return ap.parse_args()


def run_all(bench: Bench, args: argparse.Namespace) -> tuple[list[Sample], dict[str, list[Sample]]]:
    """Re-prefill first (it also builds the session) and last; the resume rows in between,
    interleaved round by round, so a burst of load from elsewhere hits every row alike."""
    bench.warm_up()
    prefills = [bench.re_prefill()]
    results: dict[str, list[Sample]] = {sc: [] for sc in args.scenarios}
    for _ in range(args.repeats):
        for sc in args.scenarios:
            results[sc].append(bench.resume(sc))
    bench.last_snapshot_bytes = bench.snapshot_bytes()
    prefills += [bench.re_prefill() for _ in range(args.prefill_repeats - 1)]
    return prefills, results


def print_report(
    bench: Bench,
    args: argparse.Namespace,
    prefills: list[Sample],
    results: dict[str, list[Sample]],
    cpu: CpuMeter,
) -> None:
    device, dtype = bench.loaded.device, bench.loaded.dtype
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"# {args.model} on {device} ({name}), {str(dtype).removeprefix('torch.')}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{datetime.now():%Y-%m-%d %H:%M}"
    )
    print(
        f"# context {args.context} tokens + {args.new_tokens} new, chunk {args.chunk}; "
        f"KV {bench.kv_bytes / MB:.1f} MB ({bench.pool.kv_bytes_per_token} B/token), "
        f"snapshot file {bench.last_snapshot_bytes / MB:.1f} MB; median (min–max) of "
        f"{args.repeats} turns, re-prefill of {len(prefills)}; bench took {cpu.wall_s:.0f}s, "
        f"other processes used {cpu.others_cores:.2f} of {os.cpu_count()} cores meanwhile"
    )
    if cpu.others_cores > 0.1:
        print("# WARNING: other processes competed for the CPU: timings are inflated and noisy")
    baseline = median(prefills, "ttft_s")
    print(HEADER)
    print(SEPARATOR)
    for sc, samples in results.items():
        print(row(SCENARIOS[sc], samples, baseline, bench.kv_bytes))
    print(row("nothing: re-prefill the whole prompt", prefills, baseline, bench.kv_bytes))


def main() -> None:
    args = parse_args()
    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    loaded = load_model(args.model, device, dtype)
    disk_dir = args.disk_dir or Path(tempfile.mkdtemp(prefix="ds4pool-bench-"))
    cpu = CpuMeter()
    bench = Bench(loaded, args, disk_dir)
    try:
        prefills, results = run_all(bench, args)
    finally:
        bench.pool.close()
        if args.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    cpu.stop()
    print_report(bench, args, prefills, results, cpu)


if __name__ == "__main__":
    main()
