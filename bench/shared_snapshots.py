"""Disk bytes of N agents' sessions that share one system prompt, on two source trees.

    python bench/shared_snapshots.py --before /work/main            # this tree vs main
    python bench/shared_snapshots.py --before /work/main --agents 16 --system-tokens 2000

For each tree (`--before DIR` first, then this one) a fresh `python -m ds4pool serve` runs
with that tree as its working directory (CPU, float32, the demo model) and an empty
`--kv-disk-dir`, write-behind off (`--kv-persist-idle-s 0 --kv-persist-every-tokens 0`), so
that each session's snapshot is written exactly once, by the flush at a clean shutdown.
`ds4pool bench agents --turns 1` sends the N agents' first turns (one shared system prompt of
S tokens, a different U-token user message each); then SIGTERM, and the directory is
measured: session files, block files, bytes. The server is then started again on the same
directory and every agent's second turn is sent: its cached tokens show how much resumed
from disk.

Writes <out>/shared_snapshots.json and <out>/shared_snapshots.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agents_compare import free_port, stop, wait_ready  # noqa: E402

HERE = Path(__file__).resolve().parents[1]


def serve(tree: Path, disk: Path, log: Path, args: argparse.Namespace) -> tuple[Any, str]:
    port = free_port()
    argv = [sys.executable, "-m", "ds4pool", "serve", "--device", "cpu", "--dtype", "float32"]
    argv += ["--kv-device-gb", str(args.kv_gb), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--kv-disk-dir", str(disk), "--kv-persist-idle-s", "0"]
    argv += ["--kv-persist-every-tokens", "0", "--log-level", "warning"]
    print(f"\n$ (cd {tree} && {shlex.join(argv)})", file=sys.stderr)
    with log.open("ab") as log_file:
        proc = subprocess.Popen(argv, cwd=tree, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log, 300)
    return proc, url


def agents(url: str, label: str, turns: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ds4pool", "bench", "agents", "--url", url]
    cmd += ["--turns", str(turns), "--agents", str(args.agents)]
    cmd += ["--system-tokens", str(args.system_tokens), "--user-tokens", str(args.user_tokens)]
    cmd += ["--gen-tokens", str(args.gen_tokens), "--seed", str(args.seed)]
    cmd += ["--out", str(args.out), "--label", label]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr)
    subprocess.run(cmd, check=False, cwd=HERE)
    return json.loads((args.out / f"{label}.json").read_text())


def measure(disk: Path) -> dict[str, int]:
    snaps, blocks = list(disk.glob("*.snap")), list(disk.glob("*.blk"))
    return {
        "session_files": len(snaps),
        "session_bytes": sum(p.stat().st_size for p in snaps),
        "block_files": len(blocks),
        "block_bytes": sum(p.stat().st_size for p in blocks),
    }


def run_tree(label: str, tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    disk = args.out / f"{label}.kv"
    subprocess.run(["rm", "-rf", str(disk)], check=True)
    log = args.out / f"{label}.server.log"
    proc, url = serve(tree, disk, log, args)
    try:
        first = agents(url, f"{label}-first", 1, args)
    finally:
        stop(proc)  # SIGTERM: the clean shutdown flushes every session once
    sizes = measure(disk)
    # second run on the same directory: resume every session's second turn
    proc, url = serve(tree, disk, log, args)
    try:
        again = agents(url, f"{label}-resume", 1, args)
    finally:
        stop(proc)
    resumed = [t for t in again["turns"] if t["turn"] == 0 and not t["error"]]
    return {
        "label": label,
        "tree": str(tree),
        **sizes,
        "first_turn_prompt_tokens": sum(
            t["prompt_tokens"] for t in first["turns"] if t["turn"] == 0
        ),
        "restart_first_turn_cached": sum(t["cached_tokens"] for t in resumed),
        "restart_first_turn_prompt": sum(t["prompt_tokens"] for t in resumed),
    }


def row(r: dict[str, Any]) -> str:
    total = r["session_bytes"] + r["block_bytes"]
    return (
        f"| {r['label']} | {r['session_files']} | {r['session_bytes'] / 1e6:.1f} "
        f"| {r['block_files']} | {r['block_bytes'] / 1e6:.1f} | {total / 1e6:.1f} "
        f"| {r['restart_first_turn_cached']:,} / {r['restart_first_turn_prompt']:,} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the other tree (e.g. main)")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--gen-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gb", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("out/shared_snapshots"))
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    reports = [run_tree("before", args.before.resolve(), args), run_tree("after", HERE, args)]
    b, a = reports
    ratio = (b["session_bytes"] + b["block_bytes"]) / (a["session_bytes"] + a["block_bytes"])
    md = "\n".join(
        [
            f"started {started}, {time.monotonic() - t0:.0f} s; before = {args.before}; "
            f"{args.agents} agents, {args.system_tokens}-token system prompt",
            "",
            "| tree | session files | session MB | block files | block MB | disk MB "
            "| after a restart: cached / prompt tokens of the next turn |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(row(r) for r in reports),
            "",
            f"disk bytes: before / after = {ratio:.1f}x",
        ]
    )
    (args.out / "shared_snapshots.json").write_text(json.dumps(reports, indent=1) + "\n")
    (args.out / "shared_snapshots.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
