"""First turns of N agents that share one system prompt, on two source trees of ds4pool.

    python bench/shared_prefix.py --before /work/main            # this tree vs main
    python bench/shared_prefix.py --before /work/main --agents 16 --system-tokens 2000

For each tree (`--before DIR` first, then this one) a fresh `python -m ds4pool serve` runs
with that tree as its working directory (so it imports that tree's package; CPU, float32,
the demo model), and `ds4pool bench agents --turns 1` sends the N agents' first turns at
once: one shared system prompt of S tokens, a different U-token user message each. Then one
request of the system prompt alone (no session) measures S' = its prompt tokens (the chat
template's tokens included, so the ideal below is slightly strict).

Reported per tree: prefill tokens computed (prompt - cached, summed over the first turns),
the ideal (one system prompt + the N suffixes = sum(prompt) - (N - 1) * S'), their ratio,
and first-turn TTFT p50 / p95. Writes <out>/<label>.json per tree and <out>/shared_prefix.md.
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agents_compare import free_port, stop, wait_ready  # noqa: E402
from ds4pool.bench.agents import Workload, make_vocab, ms_pair, system_prompt  # noqa: E402

HERE = Path(__file__).resolve().parents[1]


def system_tokens(url: str, args: argparse.Namespace) -> int:
    """Prompt tokens of the system prompt alone, as the server renders it."""
    w = Workload(args.agents, 1, args.system_tokens, args.user_tokens, 1, 0, 0, args.seed, "m")
    text = system_prompt(w, make_vocab(args.seed))
    body = {"messages": [{"role": "system", "content": text}], "max_tokens": 1}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    resp.raise_for_status()
    return int(resp.json()["usage"]["prompt_tokens"])


def run_tree(label: str, tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ds4pool", "serve", "--device", "cpu", "--dtype", "float32"]
    argv += ["--kv-device-gb", str(args.kv_gb), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "warning", *shlex.split(args.server_args)]
    log = args.out / f"{label}.server.log"
    print(f"\n$ (cd {tree} && {shlex.join(argv)})", file=sys.stderr)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(argv, cwd=tree, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, log, 300)
        cmd = [sys.executable, "-m", "ds4pool", "bench", "agents", "--url", url, "--turns", "1"]
        cmd += ["--agents", str(args.agents), "--system-tokens", str(args.system_tokens)]
        cmd += ["--user-tokens", str(args.user_tokens), "--gen-tokens", str(args.gen_tokens)]
        cmd += ["--seed", str(args.seed), "--out", str(args.out), "--label", label]
        print(f"$ {shlex.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=False, cwd=HERE)
        report = json.loads((args.out / f"{label}.json").read_text())
        report["system_prompt_tokens"] = system_tokens(url, args)
        report["tree"] = str(tree)
        return report
    finally:
        stop(proc)


def row(r: dict[str, Any]) -> str:
    first = [t for t in r["turns"] if t["turn"] == 0 and not t["error"]]
    prompts = sum(t["prompt_tokens"] for t in first)
    ideal = prompts - (len(first) - 1) * r["system_prompt_tokens"]
    computed = r["prefill"]["computed_first"]
    return (
        f"| {r['label']} | {len(first)} | {prompts:,} | {computed:,} | {ideal:,} "
        f"| {computed / ideal:.2f} | {ms_pair(r['ttft_first_s'])} |"
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
    p.add_argument("--server-args", default="", help="more `serve` flags, for both trees")
    p.add_argument("--out", type=Path, default=Path("out/shared_prefix"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    reports = [run_tree("before", args.before.resolve(), args), run_tree("after", HERE, args)]
    b, a = reports
    speedup = b["ttft_first_s"]["p50"] / a["ttft_first_s"]["p50"]
    md = "\n".join(
        [
            f"started {started}, {time.monotonic() - t0:.0f} s; before = {args.before}; "
            f"server flags: {args.server_args or '(defaults)'}",
            "",
            "| tree | first turns | prompt tokens | computed | ideal | computed / ideal "
            "| TTFT first p50 / p95 (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(row(r) for r in reports),
            "",
            f"first-turn TTFT p50: before / after = {speedup:.1f}x",
        ]
    )
    (args.out / "shared_prefix.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
