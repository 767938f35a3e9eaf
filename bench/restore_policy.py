"""The agents workload under a tight device budget, once per restore policy, side by side.

    python bench/restore_policy.py --before /work/main              # main, then always/auto/never
    python bench/restore_policy.py --policies always auto --repeat 2 --agents 16

Each run is a fresh `python -m ds4pool serve` (CPU, float32, the demo model unless
--device / --dtype / --model) with a small device KV budget, a small RAM tier and a disk
tier in a new temporary directory, so that sessions move device → RAM → disk between
turns and come back; then `ds4pool bench agents` drives N agents over HTTP. Runs:
`--before DIR` (a source tree without --restore-policy, e.g. main; optional), then this
tree with each of `--policies` (always = read every returning session's KV back, as
before kv/cost.py; auto = the cheaper of reading and recomputing from the measured rates;
never = recompute all). With --repeat R the list runs R times, the order reversed every
other round, so a busy machine slows every side alike.

Reported per run: prefill tokens computed / reused, first- and resumed-turn TTFT, session
moves and restore decisions (both scraped from /metrics), and the rates the server measured
(`ds4pool_tier_read_bytes_per_second`, `ds4pool_prefill_tokens_per_second`). Writes
<out>/<label>.json per run and <out>/restore_policy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agents_compare import free_port, stop, wait_ready  # noqa: E402
from ds4pool.bench.agents import moves_cell, ms_pair  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
_RATE = re.compile(
    r'^(ds4pool_tier_read_bytes_per_second\{tier="(\w+)"\}|ds4pool_prefill_tokens_per_second)'
    r"\s+(\S+)",
    re.M,
)


@dataclass(frozen=True)
class Run:
    label: str
    tree: Path
    flags: list[str]


def rates(url: str) -> dict[str, float]:
    """The server's measured rates (absent on a server without kv/cost.py)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for m in _RATE.finditer(text):
        out[m.group(2) or "prefill"] = float(m.group(3))
    return out


def run_one(run: Run, label: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="ds4pool-restore-") as disk:
        argv = [sys.executable, "-m", "ds4pool", "serve", "--device", args.device]
        argv += ["--dtype", args.dtype]
        argv += ["--model", args.model, "--kv-device-gb", str(args.kv_gb)]
        argv += ["--kv-ram-gb", str(args.ram_gb), "--kv-disk-dir", disk]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        argv += [*run.flags, *shlex.split(args.server_args)]
        log = args.out / f"{label}.server.log"
        print(f"\n$ (cd {run.tree} && {shlex.join(argv)})", file=sys.stderr)
        with log.open("wb") as log_file:
            proc = subprocess.Popen(argv, cwd=run.tree, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, log, 300)
            cmd = [sys.executable, "-m", "ds4pool", "bench", "agents", "--url", url]
            cmd += ["--agents", str(args.agents), "--turns", str(args.turns)]
            cmd += ["--system-tokens", str(args.system_tokens)]
            cmd += ["--user-tokens", str(args.user_tokens), "--gen-tokens", str(args.gen_tokens)]
            cmd += ["--think-s", *map(str, args.think_s), "--seed", str(args.seed)]
            cmd += ["--out", str(args.out), "--label", label]
            print(f"$ {shlex.join(cmd)}", file=sys.stderr)
            subprocess.run(cmd, check=False, cwd=HERE)
            report: dict[str, Any] = json.loads((args.out / f"{label}.json").read_text())
            report["rates"] = rates(url)
            report["tree"], report["flags"] = str(run.tree), run.flags
            (args.out / f"{label}.json").write_text(json.dumps(report, indent=1) + "\n")
            return report
        finally:
            stop(proc)


def row(r: dict[str, Any]) -> str:
    p, rt = r["prefill"], r["rates"]
    measured = (
        f"{rt['ram'] / 1e9:.2f} / {rt['disk'] / 1e9:.2f} GB/s, {rt['prefill']:,.0f} tok/s"
        if rt
        else "n/a"
    )
    return (
        f"| {r['label']} | {r['turns_ok']}/{r['turns_planned']} "
        f"| {p['computed']:,} / {p['reused']:,} | {ms_pair(r['ttft_first_s'])} "
        f"| {ms_pair(r['ttft_resumed_s'])} | {moves_cell(r['session_moves'])} "
        f"| {moves_cell(r.get('restore_decisions'))} | {measured} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, default=None, help="a tree without the cost model")
    p.add_argument("--policies", nargs="+", default=["always", "auto", "never"])
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, nargs=2, default=[0.5, 1.5])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gb", type=float, default=0.02, help="device KV budget (tight)")
    p.add_argument("--ram-gb", type=float, default=0.01, help="RAM tier budget (tight)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--reverse", action="store_true", help="start with the reversed order")
    p.add_argument("--server-args", default="", help="more `serve` flags, for every run")
    p.add_argument("--out", type=Path, default=Path("out/restore_policy"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [Run("before", args.before.resolve(), [])] if args.before else []
    runs += [Run(policy, HERE, ["--restore-policy", policy]) for policy in args.policies]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    reports = []
    for rnd in range(args.repeat):
        for run in runs if (rnd + args.reverse) % 2 == 0 else runs[::-1]:
            reports.append(run_one(run, f"{run.label}-r{rnd}", args))
    md = "\n".join(
        [
            f"started {started}, {time.monotonic() - t0:.0f} s, load 1m {load0:.1f} → "
            f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} cores); model {args.model} on "
            f"{args.device} {args.dtype}; "
            f"{args.agents} agents × {args.turns} turns, S={args.system_tokens}, "
            f"U={args.user_tokens}, G={args.gen_tokens}, think {args.think_s[0]:g}-"
            f"{args.think_s[1]:g} s, seed {args.seed}; device KV {args.kv_gb} GB, RAM "
            f"{args.ram_gb} GB, disk tier on; before = {args.before or '(none)'}",
            "",
            "| run | turns ok | prefill computed / reused | TTFT first p50 / p95 (ms) "
            "| TTFT resumed p50 / p95 (ms) | session moves | restore decisions "
            "| measured ram / disk read, prefill |",
            "|---|---:|---:|---:|---:|---|---|---|",
            *(row(r) for r in reports),
        ]
    )
    (args.out / "restore_policy.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
