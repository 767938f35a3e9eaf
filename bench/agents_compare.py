"""The multi-agent workload on several servers, one after another, on one model directory.

    python bench/agents_compare.py                              # demo model, N = 1 4 8 16
    python bench/agents_compare.py --agents 1 2 --turns 2       # a quick smoke run
    python bench/agents_compare.py --servers ds4pool no-batching
    python bench/agents_compare.py --servers ds4pool llama-server --gguf m.gguf \
        --model-dir DIR --agents 16 --repeat 3                  # alternating, 3 rounds
    python bench/agents_compare.py --device cuda --servers ds4pool llama-server transformers \
        --gguf m.gguf --llama-slots agents --llama-args "-ngl 99 -fa on" \
        --model-dir DIR --agents 16 32 64 --kv-gb 40          # the GPU comparison
    python bench/agents_compare.py --merge out/a out/b --device cuda  # earlier runs, one table

Servers (each started as its own process on a free loopback port; `--device` cpu, float32 by
default, or cuda, bfloat16 by default; `--dtype` overrides):
  - ds4pool:      `ds4pool serve` (continuous batching, sessions kept warm);
  - no-batching:  `ds4pool serve --no-batching` (one request at a time, one live session:
                  the ds4-server behaviour);
  - transformers: `transformers serve --continuous-batching` with HF_HUB_OFFLINE=1 (needs
                  `pip install "transformers[serving]"`), pinned to the model directory;
  - ds4pool:before: with --before-ref REF, `ds4pool serve` as it was at git REF (imported
                  from a worktree made for the run), to measure a change side by side;
  - ds4pool:NAME: `ds4pool serve` with the extra flags of `--variant NAME="FLAGS"` (e.g.
                  main's CPU defaults next to today's in one run); compared to the others
                  like ds4pool;
  - llama-server: llama.cpp's server (`--llama-server`, default `llama-server` on PATH) on
                  `--gguf`, the same weights converted by llama.cpp's convert_hf_to_gguf.py,
                  `-np --llama-slots -t --threads -c slots*--llama-slot-ctx`. It ignores
                  X-Session-Id (its slots reuse prompt prefixes).
  - llama-server:NAME: llama-server with the extra flags of `--llama-variant NAME="FLAGS"`;
                  an `-np K` (or `-np agents`) among them sets that server's slots and
                  context (e.g. -np 4 next to one slot per agent: the same ITL at equal
                  concurrency); compared to ds4pool like llama-server.
Both get the same KV budget (`--kv-gb`: ds4pool's `--kv-device-gb`, transformers'
`--cb-num-blocks` computed from the model's KV bytes per token and its 256-token pages) and
the same per-step token budget (`--max-batch-tokens` / `--cb-max-batch-tokens`).

With --repeat R the whole list of (N, server) runs R times, the servers alternating within
each N, so that a busy machine slows both sides of a comparison alike; the ratio lines pair
ds4pool with each other server in the same round and give the median over rounds.

For every server and every N a FRESH server runs `ds4pool bench agents` (as a subprocess,
the command is printed) with the same seed and sizes, so every run sends the same
requests and no session survives from a previous run. transformers serve rejects unknown
fields, so it gets `--no-ignore-eos` plus `generation_config` without eos ids (which
disables eos in its continuous batching): every turn still generates exactly G tokens.
The reply hashes of each run are compared with ds4pool's run at the same N (greedy
decoding on the same weights should give the same text).

Writes <out>/<server>-N<n>.json (+ .png), <out>/agents_compare.json, <out>/agents_compare.md,
and the combined plot (--plot, default <out>/agents_compare.png).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.bench.agents import moves_cell, ms_pair, report_notes  # noqa: E402

SERVERS = ("ds4pool", "no-batching", "transformers", "llama-server")
BEFORE = "ds4pool:before"  # with --before-ref: ds4pool serve at that git ref
TF_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig.page_size default
TF_GEN_CONFIG = json.dumps({"generation_config": json.dumps({"do_sample": False})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    """K and V of every layer for one token, in `dtype`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_value = DTYPE_BYTES[dtype]
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * per_value


def server_command(
    name: str, model_dir: Path, port: int, args: argparse.Namespace, agents: int = 1
) -> tuple[list[str], dict[str, str], list[str]]:
    """(server argv, its environment, extra `bench agents` flags) for one server run with
    `agents` clients (llama-server's slot count may follow it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS4POOL_")}
    common = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    variants = dict(args.variant)
    if name == BEFORE:
        env.update(before_env(args.before_tree, env))
    if name in ("ds4pool", "no-batching", BEFORE) or name in variants:
        argv = [sys.executable, "-m", "ds4pool", "serve", "--model", str(model_dir)]
        argv += ["--device", args.device, "--dtype", args.dtype, "--kv-device-gb", str(args.kv_gb)]
        argv += ["--max-batch-tokens", str(args.max_batch_tokens), *common]
        argv += shlex.split(variants.get(name, ""))
        return argv + (["--no-batching"] if name == "no-batching" else []), env, []
    llama_variants = dict(args.llama_variant)
    if name == "llama-server" or name in llama_variants:
        return llama_server_command(port, args, agents, llama_variants.get(name, "")), env, []
    exe = shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the transformers CLI is not installed")
    per_token = kv_bytes_per_token(model_dir, args.dtype)
    blocks = math.ceil(args.kv_gb * 2**30 / (TF_PAGE_SIZE * per_token))
    argv = [exe, "serve", "--continuous-batching", "--cb-num-blocks", str(blocks)]
    argv += ["--cb-max-batch-tokens", str(args.max_batch_tokens), "--device", args.device]
    argv += ["--dtype", args.dtype, *common, str(model_dir)]
    env["HF_HUB_OFFLINE"] = "1"
    # its /v1/models (our readiness probe) scans the hub cache and answers 500 where that
    # directory does not exist (a fresh machine: transformers 5.17 on the H200), and a big
    # cache makes every call slow: an empty cache of the run's own (the model is a path)
    hub = args.out / "hf-hub-cache"
    hub.mkdir(parents=True, exist_ok=True)
    env["HF_HUB_CACHE"] = str(hub)
    # it lists no model served from a path, and 5.17 refuses any other name than the one it
    # is pinned to (HTTP 400): the requests name the directory
    client = ["--no-ignore-eos", "--extra-body", TF_GEN_CONFIG, "--model", str(model_dir)]
    return argv, env, client


SLOT_FLAGS = ("-np", "--parallel")  # llama-server's slot count


def split_slots(flags: str) -> tuple[int | str | None, list[str]]:
    """A --llama-variant's flags: (its -np value if it has one, the other flags)."""
    words, slots, rest = shlex.split(flags), None, []
    it = iter(words)
    for word in it:
        if word in SLOT_FLAGS:
            value = next(it, None)
            if value is None:
                raise argparse.ArgumentTypeError(f'{word} needs a slot count or "agents"')
            slots = _slots(value)
        else:
            rest.append(word)
    return slots, rest


def llama_server_command(
    port: int, args: argparse.Namespace, agents: int = 1, flags: str = ""
) -> list[str]:
    exe = shutil.which(str(args.llama_server))
    if exe is None:
        raise RuntimeError(f"llama-server not found: {args.llama_server} (--llama-server PATH)")
    if args.gguf is None or not args.gguf.is_file():
        raise RuntimeError(f"llama-server needs --gguf FILE (got {args.gguf})")
    own, extra = split_slots(flags)
    want = args.llama_slots if own is None else own
    slots = agents if want == "agents" else int(want)
    argv = [exe, "-m", str(args.gguf), "-np", str(slots), "-t", str(args.threads)]
    argv += ["-c", str(slots * args.llama_slot_ctx), "--metrics"]
    argv += shlex.split(args.llama_args) + extra
    return argv + ["--host", "127.0.0.1", "--port", str(port)]


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM of a live process (Linux); None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_times(pid: int) -> dict[str, float] | None:
    """User and kernel CPU seconds and minor page faults of a live process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    # fields[0] is field 3 of proc(5): minflt is field 10, utime 14, stime 15
    return {"user_s": int(fields[11]) / tick, "sys_s": int(fields[12]) / tick,
            "minflt": float(fields[7])}  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s (log: {log})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def workload_flags(args: argparse.Namespace, n: int) -> list[str]:
    return [
        "--agents", str(n), "--turns", str(args.turns),
        "--system-tokens", str(args.system_tokens), "--user-tokens", str(args.user_tokens),
        "--gen-tokens", str(args.gen_tokens), "--think-s", *map(str, args.think_s),
        "--seed", str(args.seed),
    ]  # fmt: skip


def run_one(
    name: str, n: int, model_dir: Path, args: argparse.Namespace, rnd: int = 0
) -> dict[str, Any]:
    """A fresh server, one `bench agents` run against it, the server stopped."""
    port = free_port()
    argv, env, client_flags = server_command(name, model_dir, port, args, n)
    label = f"{name}-N{n}" + (f"-r{rnd}" if args.repeat > 1 else "")
    log = args.out / f"{label}.server.log"
    print(f"\n$ {shlex.join(argv)}", file=sys.stderr)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log, args.start_timeout_s)
        cmd = [sys.executable, "-m", "ds4pool", "bench", "agents", "--url", url]
        cmd += [*workload_flags(args, n), *client_flags, "--out", str(args.out), "--label", label]
        cmd += ["--client-procs", str(args.client_procs)]
        print(f"$ {shlex.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=False)
        report_path = args.out / f"{label}.json"
        if not report_path.exists():
            raise RuntimeError(f"{label}: the bench wrote no report")
        report = json.loads(report_path.read_text())
        report["server"], report["server_command"] = name, shlex.join(argv)
        report["round"], report["server_peak_rss"] = rnd, peak_rss_bytes(proc.pid)
        report["device"] = args.device
        report["server_cpu"] = cpu_times(proc.pid)  # since the server started
        return report
    finally:
        stop(proc)


# ------------------------------------------------------------------ tables and plots


def same_replies(report: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """How many turns generated the same text as the reference run (ds4pool, same N)."""
    if ref is None:
        return "n/a"
    want = {(t["agent"], t["turn"]): t["reply_sha256"] for t in ref["turns"] if not t["error"]}
    got = [(t["agent"], t["turn"], t["reply_sha256"]) for t in report["turns"] if not t["error"]]
    same = sum(1 for a, k, h in got if want.get((a, k)) == h)
    return f"{same}/{len(got)}"


HEADER = (
    "| server | agents | round | turns ok | TTFT first p50 / p95 (ms) "
    "| TTFT resumed p50 / p95 (ms) | ITL p50 / p95 (ms) | gen tok/s | wall (s) "
    "| prefill computed / reused | session moves | same text as ds4pool | peak RSS (GB) "
    "| server CPU user / sys (s) "
    "| load 1m |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"
)


def _key(r: dict[str, Any]) -> tuple[int, int]:
    return r["workload"]["agents"], r.get("round", 0)


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f}"


def _cpu(c: dict[str, float] | None) -> str:
    return "n/a" if c is None else f"{c['user_s']:.0f} / {c['sys_s']:.0f}"


def table(reports: list[dict[str, Any]]) -> str:
    # the reference text: ds4pool's run, else the first ds4pool variant's (ds4pool:NAME)
    mine = [r["server"] for r in reports if r["server"].startswith("ds4pool")]
    ref = "ds4pool" if "ds4pool" in mine else next(iter(mine), None)
    refs = {_key(r): r for r in reports if r["server"] == ref}
    rows = [HEADER]
    for r in reports:
        n, p = r["workload"]["agents"], r["prefill"]
        load = r["machine_before"]["loadavg"][0]
        rows.append(
            f"| {r['server']} | {n} | {r.get('round', 0)} | {r['turns_ok']}/{r['turns_planned']} "
            f"| {ms_pair(r['ttft_first_s'])} | {ms_pair(r['ttft_resumed_s'])} "
            f"| {ms_pair(r['itl_s'])} | {r['gen_tok_s']:.1f} | {r['wall_s']:.1f} "
            f"| {p['computed']:,} / {p['reused']:,} | {moves_cell(r['session_moves'])} "
            f"| {same_replies(r, refs.get(_key(r)))} | {_gb(r.get('server_peak_rss'))} "
            f"| {_cpu(r.get('server_cpu'))} | {load:.2f} |"
        )
    return "\n".join(rows)


# (other server, resumed TTFT goal, tok/s goal, ITL goal: ds4pool's p50 at most goal x
# theirs, per device: issue 10 asks for 2x llama-server -np 4's on CPU, at least its ITL on CUDA)
GOALS = (
    ("no-batching", 10.0, 4.0, None),
    ("transformers", 1.0, 1.0, None),
    ("llama-server", 1.0, 1.0, {"cpu": 2.0, "cuda": 1.0}),
)


def _ratios(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """ds4pool vs one other run: resumed TTFT (theirs / ours: > 1 is better), tok/s (ours /
    theirs), ITL p50 (ours / theirs: < 1 is better)."""

    def div(a: float | None, b: float | None) -> float:
        return a / b if a and b else float("nan")

    return {
        "ttft": div(other["ttft_resumed_s"]["p50"], ours["ttft_resumed_s"]["p50"]),
        "tps": div(ours["gen_tok_s"], other["gen_tok_s"]),
        "itl": div(ours["itl_s"]["p50"], other["itl_s"]["p50"]),
    }


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets(reports: list[dict[str, Any]]) -> list[str]:
    """The issue's targets at every N (ITL and tok/s "at every N"), as ratios of runs of
    the same round: resumed TTFT and tok/s vs no-batching and transformers; ITL and tok/s vs
    llama-server (the ITL goal by the runs' device, "cpu" where a report does not say).
    Every ds4pool variant (ds4pool:NAME) is compared like ds4pool, and with every
    llama-server variant (llama-server:NAME) as with llama-server."""
    lines: list[str] = []
    for n in sorted({r["workload"]["agents"] for r in reports}):
        lines += _targets_at(reports, n)
    return lines


def _targets_at(reports: list[dict[str, Any]], n: int) -> list[str]:
    by = {(r["server"], *_key(r)): r for r in reports}
    rounds = sorted({r.get("round", 0) for r in reports})
    ours = sorted({r["server"] for r in reports if r["server"].startswith("ds4pool")})
    goals = {goal[0]: goal[1:] for goal in GOALS}
    theirs = [  # every other server with goals, its variants (llama-server:NAME) too
        (other, *goals[other.partition(":")[0]])
        for other in dict.fromkeys(r["server"] for r in reports)
        if other.partition(":")[0] in goals
    ]
    lines = []
    for mine, (other, ttft_goal, tps_goal, itl_goals) in itertools.product(ours, theirs):
        rounds_of = [k for k in rounds if (mine, n, k) in by and (other, n, k) in by]
        pairs = [_ratios(by[(mine, n, k)], by[(other, n, k)]) for k in rounds_of]
        if not pairs:
            continue
        med = {m: _median([p[m] for p in pairs]) for m in ("ttft", "tps", "itl")}

        each = {m: ", ".join(f"{p[m]:.2f}" for p in pairs) for m in ("ttft", "tps", "itl")}
        text = (
            f"N={n}, {mine} vs {other} (median of {len(pairs)} round(s)): "
            f"resumed-turn TTFT p50 {med['ttft']:.1f}x better [{each['ttft']}] "
            f"(target >= {ttft_goal:g}x: {_verdict(med['ttft'] >= ttft_goal)}), "
            f"gen tok/s {med['tps']:.2f}x [{each['tps']}] "
            f"(target >= {tps_goal:g}x: {_verdict(med['tps'] >= tps_goal)})"
        )
        if itl_goals is not None:
            itl_goal = itl_goals[by[(mine, n, rounds_of[0])].get("device", "cpu")]
            text += (
                f", ITL p50 {med['itl']:.2f}x theirs [{each['itl']}] "
                f"(target <= {itl_goal:g}x: {_verdict(med['itl'] <= itl_goal)})"
            )
        lines.append(text)
    return lines


def plot(reports: list[dict[str, Any]], path: Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=90)
    servers = list(dict.fromkeys(r["server"] for r in reports))  # variants too, run order
    n_max = max(r["workload"]["agents"] for r in reports)
    for s in servers:
        rs = sorted(
            (r for r in reports if r["server"] == s and r.get("round", 0) == 0),
            key=lambda r: r["workload"]["agents"],
        )
        ns = [r["workload"]["agents"] for r in rs]
        panels = ((axes[0][0], "ttft_resumed_s"), (axes[0][1], "ttft_first_s"),
                  (axes[0][2], "itl_s"))  # fmt: skip
        for ax, key in panels:
            (line,) = ax.plot(ns, [r[key]["p50"] * 1e3 for r in rs], "o-", label=f"{s} p50")
            ax.plot(ns, [r[key]["p95"] * 1e3 for r in rs], "--", color=line.get_color(),
                    alpha=0.5, label=f"{s} p95")  # fmt: skip
        axes[1][0].plot(ns, [r["gen_tok_s"] for r in rs], "o-", label=s)
        last = next((r for r in rs if r["workload"]["agents"] == n_max), None)
        if last is not None:
            med = [(int(k) + 1, v["p50"] * 1e3) for k, v in last["ttft_by_turn_s"].items()
                   if v["p50"] is not None]  # fmt: skip
            axes[1][1].plot(*zip(*med), "o-", label=s)
    axes[1][2].axis("off")
    _decorate(axes, n_max, sorted({r["workload"]["agents"] for r in reports}))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _decorate(axes: Any, n_max: int, ns: list[int]) -> None:
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    some = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")  # 2s and 5s
    titles = (
        ("resumed turns: TTFT (ms)", "first turn: TTFT (ms)", "inter-token latency (ms)"),
        ("aggregate generated tok/s", f"TTFT p50 per turn at N={n_max} (ms; turn 1 = first)"),
    )
    for i, row in enumerate(axes):
        for j, ax in enumerate(row[: len(titles[i])]):
            ax.set_title(titles[i][j], fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            if (i, j) != (1, 0):
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(some)
            else:
                ax.set_ylim(bottom=0)
            if (i, j) != (1, 1):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.set_xlabel("agents")
            else:
                ax.set_xticks(range(1, 1 + max(len(line.get_xdata()) for line in ax.lines)))
                ax.set_xlabel("turn")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None, help="default: the demo model")
    p.add_argument(
        "--servers",
        nargs="+",
        default=list(SERVERS),
        help=f"any of {', '.join(SERVERS)} and the variants' names (ds4pool:NAME, "
        "llama-server:NAME)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        metavar="NAME=FLAGS",
        help="one more ds4pool server, ds4pool:NAME, with these serve flags, e.g. "
        '--variant "main=--max-prefill-tokens 64 --max-prefill-cost 112"; list it in --servers',
    )
    p.add_argument(
        "--before-ref",
        default=None,
        metavar="REF",
        help=f"serve {BEFORE} from a git worktree of REF (list {BEFORE} in --servers), or "
        "from REF itself where it is a directory holding the ds4pool package as it was (an "
        "export, `git archive REF ds4pool | tar -x -C DIR`, for a machine without the "
        "repository's history: the device's copy of the tree)",
    )
    p.add_argument("--agents", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--think-s", type=float, nargs=2, default=[0.5, 2.0], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gb", type=float, default=0.5, help="KV budget of every server")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="ds4pool's and transformers'"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default=None,
        help="model dtype of ds4pool and transformers (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="`bench agents` client processes (GPU runs at 32+ agents: 4)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds (servers alternate per N)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama-server -t (ds4pool and transformers use torch's default)",
    )
    p.add_argument("--gguf", type=Path, default=None, help="llama-server's model file")
    p.add_argument("--llama-server", type=Path, default=Path("llama-server"))
    p.add_argument(
        "--llama-slots",
        type=_slots,
        default=4,
        help='llama-server -np: a count, or "agents" for one slot per agent',
    )
    p.add_argument("--llama-slot-ctx", type=int, default=8192, help="context per slot")
    p.add_argument("--llama-args", default="", help='more llama-server flags, e.g. "--poll 0"')
    p.add_argument(
        "--llama-variant",
        action="append",
        default=[],
        type=_llama_variant,
        metavar="NAME=FLAGS",
        help="one more llama-server, llama-server:NAME, with these flags after --llama-args; "
        '-np K or -np agents sets its slots, e.g. --llama-variant "np16=-np 16"; list it in '
        "--servers",
    )
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=Path("out/agents_compare"))
    p.add_argument("--plot", type=Path, default=None, help="default: <out>/agents_compare.png")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="PATH",
        help="start no server: one table, target lines and plot from earlier runs' "
        "agents_compare.json (files, or the --out directories holding them), e.g. the "
        "per-server runs of bench/h200_agents.sh; --device says which ITL goal applies to "
        "runs that do not record it",
    )
    args = p.parse_args(argv)
    known = {*SERVERS, *(name for name, _ in args.variant + args.llama_variant)}
    if args.before_ref:
        known.add(BEFORE)
    elif BEFORE in args.servers:
        p.error(f"{BEFORE} needs --before-ref REF")
    args.before_tree = None
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    unknown = [s for s in args.servers if s not in known]
    if unknown:
        p.error(f"unknown server(s) {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
    return args


def _slots(text: str) -> int | str:
    """--llama-slots: a positive count or "agents"."""
    if text == "agents":
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f'expected a slot count or "agents", got {text!r}')


def _variant(text: str, server: str = "ds4pool") -> tuple[str, str]:
    """NAME=FLAGS -> ("ds4pool:NAME", FLAGS)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return f"{server}:{name.strip()}", flags


def _llama_variant(text: str) -> tuple[str, str]:
    """NAME=FLAGS -> ("llama-server:NAME", FLAGS), its -np checked now."""
    name, flags = _variant(text, "llama-server")
    split_slots(flags)
    return name, flags


def before_env(tree: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment variables that make `python -m ds4pool` import the package of `tree`:
    it first on PYTHONPATH (ahead of what the path had: the device image finds the server
    stack's wheels there), and PYTHONSAFEPATH, without which `-m` puts the working directory
    first and, run from the repository's root, the code under test shadows the tree (every
    `ds4pool:before` run before session 41 served the current code: docs/BENCHMARKS.md).
    Checked: a child with that environment must import ds4pool from `tree`."""
    paths = (str(tree), env.get("PYTHONPATH", ""))
    extra = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONSAFEPATH": "1"}
    probe = [sys.executable, "-c", "import ds4pool; print(ds4pool.__file__)"]
    found = subprocess.run(probe, env={**env, **extra}, capture_output=True, text=True)
    where = Path(found.stdout.strip() or "?").resolve()
    if found.returncode or not where.is_relative_to(tree.resolve()):
        raise SystemExit(
            f"agents_compare: {BEFORE} would import {where}, not {tree} (PYTHONSAFEPATH "
            "needs Python 3.11)"
        )
    return extra


@contextlib.contextmanager
def before_tree(ref: str | None) -> Iterator[Path | None]:
    """A detached git worktree of `ref` for the run (None without a ref), removed after;
    `ref` itself where it is a directory with a ds4pool package (an export of a ref)."""
    if ref is None:
        yield None
        return
    if (Path(ref) / "ds4pool" / "__init__.py").is_file():
        yield Path(ref).resolve()
        return
    root = Path(__file__).resolve().parents[1]
    tree = Path(tempfile.mkdtemp(prefix="ds4pool-before-")) / "tree"
    made = subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), ref], cwd=root, capture_output=True
    )
    if made.returncode:
        raise SystemExit(f"agents_compare: no worktree of {ref!r}: {made.stderr.decode()[-300:]}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root)


def run_order(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """(round, N, server) in run order. One round: every server at N before the next N,
    so the runs being compared are minutes apart; later rounds reverse the server order
    (A B, B A, A B ...) so neither side always runs first."""
    if args.repeat == 1:  # the original order: every N of one server, then the next
        return [(0, n, name) for name in args.servers for n in args.agents]
    order = []
    for rnd in range(args.repeat):
        names = args.servers if rnd % 2 == 0 else args.servers[::-1]
        order += [(rnd, n, name) for n in args.agents for name in names]
    return order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.model_dir is None:
        from ds4pool.model.demo import ensure_demo_model

        args.model_dir = ensure_demo_model()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    reports, failures = [], []
    with before_tree(args.before_ref) as args.before_tree:
        for rnd, n, name in run_order(args):
            try:
                reports.append(run_one(name, n, args.model_dir, args, rnd))
            except RuntimeError as exc:
                failures.append(f"{name} N={n} round {rnd}: {exc}")
                print(f"FAILED {failures[-1]}", file=sys.stderr)
    header = (
        f"model {args.model_dir} on {args.device}, {args.dtype} "
        f"({kv_bytes_per_token(args.model_dir, args.dtype)} B of KV per token); "
        f"turns {args.turns}, S={args.system_tokens}, U={args.user_tokens}, "
        f"G={args.gen_tokens}, think {args.think_s[0]}-{args.think_s[1]} s, seed {args.seed}; "
        f"{datetime.now().isoformat(timespec='seconds')}, {time.monotonic() - t0:.0f} s in all"
    )
    title = (
        f"{args.model_dir.name}, {args.device} {args.dtype}: S={args.system_tokens}, "
        f"U={args.user_tokens}, G={args.gen_tokens}, {args.turns} turns, think "
        f"{args.think_s[0]:g}-{args.think_s[1]:g} s, seed {args.seed}"
    )
    return write_results(args, header, title, reports, failures)


def write_results(
    args: argparse.Namespace,
    header: str,
    title: str,
    reports: list[dict[str, Any]],
    failures: list[str],
) -> int:
    """Print and write the table, the target lines and the plot; 1 if some run failed."""
    notes = [n for r in reports for n in report_notes(r)]
    text = "\n".join([header, "", table(reports), "", *targets(reports), *notes, *failures])
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agents_compare.md").write_text(text + "\n")
    (args.out / "agents_compare.json").write_text(
        json.dumps({"header": header, "failures": failures, "reports": reports}, indent=1)
    )
    if reports:
        plot(reports, args.plot or args.out / "agents_compare.png", title)
    return 1 if failures else 0


def merge(args: argparse.Namespace) -> int:
    """--merge: one comparison from the agents_compare.json of earlier runs."""
    reports, failures, headers = [], [], []
    for path in args.merge:
        path = path / "agents_compare.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
            runs, failed, header = data["reports"], data["failures"], data["header"]
            if not (isinstance(runs, list) and all(isinstance(r, dict) for r in runs)):
                raise TypeError("its reports are not a list of runs")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"agents_compare: {path} is not an agents_compare.json ({exc})")
        reports += [{"device": args.device, **r} for r in runs]  # older runs lack "device"
        failures += failed
        headers.append(f"- {path}: {header}")
    work = reports[0]["workload"] if reports else {}
    title = ", ".join(f"{k}={work[k]}" for k in ("system_tokens", "user_tokens", "gen_tokens",
                      "turns", "seed") if k in work)  # fmt: skip
    title = f"{Path(str(work.get('model', ''))).name}: {title}"
    header = "\n".join([f"merged from {len(args.merge)} comparison(s):", *headers])
    return write_results(args, header, title, reports, failures)


if __name__ == "__main__":
    raise SystemExit(main())
