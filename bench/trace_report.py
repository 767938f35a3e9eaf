"""Where a first token's wait went: a `--trace-steps` file, with a `ds4pool bench agents` run.

    python bench/trace_report.py TRACE.jsonl [--agents RUN.json]

For every request of the trace (sched/trace.py), its time to the first token splits into

    api      received → arrival   the HTTP handler: body, chat template, checks
    queue    arrival → admitted   waiting for a batch (tokenizing, a busy session, the budget)
    wait     admitted → launch    admitted, until the step with its first chunk is launched
    compute  launch → results     from that launch to the results of its last chunk's step
                                  (the steps of its chunks, and any between them)
    push     results → pushed     until the worker put the first token on the request's stream
    loop     pushed → taken       until the event loop's handler took it
    server   received → results   (arrival → results outside the API)

and with `--agents` (the JSON `ds4pool bench agents --out` wrote for the same server) each
turn is matched to its request (X-Session-Id `agent-<i>-<seed>`, turns in order) and

    client   what the client's TTFT adds to received → taken (→ results without the API's
             lines): sending the first chunk, the network, the client's own parsing, and what
             came before the handler (reading and routing the request)

Prints p50 / p90 in ms of each part, first turns and resumed turns apart, then the steps: how
many, how many of them ran eagerly (no CUDA graph), their length by the number of prompt
chunks they carried, the slow ones (over 3x
the median of their kind, with the idle time before them), and the prompts' busy
periods: requests whose time from arrival to first token overlaps, chained (a request that
arrives before the period's last first token joins it). Agents that line up (every turn
ending in the same few steps, the same pause) come as a few large periods whose arrivals
lie close together and whose length is the prompts' compute one after another; agents
spread out come as many periods of one or two.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.bench import agents  # noqa: E402

SESSION = re.compile(r"^agent-(\d+)-")


@dataclass
class Req:
    rid: int
    session: str | None
    received: float | None
    arrival: float
    admitted: float | None
    launch: float | None = None  # the step with its first chunk
    done: float | None = None  # results of the step with its last chunk
    steps: int = 0  # steps that carried a chunk of it
    turn: int | None = None
    agent: int | None = None
    client_ttft: float | None = None
    pushed: float | None = None  # the worker pushed its first event to the stream
    taken: float | None = None  # the HTTP handler took it
    parts: dict[str, float] = field(default_factory=dict)


def read_trace(path: Path) -> tuple[list[dict], dict[int, Req]]:
    steps, reqs = [], {}
    firsts: dict[int, dict] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                step = json.loads(line)
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise ValueError(f"{path}:{n}: not a JSON line") from None
                break  # the server was still writing its last line
            if "t0" not in step:  # a first event taken by the API: its handler may write
                firsts[step["rid"]] = step  # it before the worker writes the step's line
                continue
            steps.append(step)
            for r in step.get("new", ()):
                seen = reqs.get(r["rid"])
                if seen is not None and seen.arrival != r["arrival"]:  # not a preemption
                    raise ValueError(
                        f"{path}:{n}: request {r['rid']} arrived twice: the file holds more "
                        "than one server's run (request ids restart with each server)"
                    )
                if seen is None:
                    reqs[r["rid"]] = Req(
                        r["rid"], r["session"], r["received"], r["arrival"], r["admitted"]
                    )
            for rid, n_tok, start, prompt in step["chunks"]:
                req = reqs.get(rid)
                if req is None:
                    continue  # its first chunk came before the trace began
                if req.launch is None:
                    req.launch = step["t0"]
                req.steps += 1
                if start + n_tok >= prompt:
                    req.done = step["t1"]
    for rid, first in firsts.items():
        req = reqs.get(rid)
        if req is not None:
            req.pushed, req.taken = first["pushed"], first["taken"]
    return steps, reqs


def match_turns(reqs: dict[int, Req], agents_json: Path) -> int:
    """Number the requests of each agent's session in arrival order and attach the client's
    TTFT of that turn; returns how many turns matched."""
    report = json.loads(agents_json.read_text(encoding="utf-8"))
    by_session: dict[int, list[Req]] = {}
    for req in reqs.values():
        m = SESSION.match(req.session or "")
        if m:
            by_session.setdefault(int(m.group(1)), []).append(req)
    ttft = {(t["agent"], t["turn"]): t["ttft"] for t in report["turns"] if t.get("ttft")}
    matched = 0
    for agent, rs in by_session.items():
        for turn, req in enumerate(sorted(rs, key=lambda r: r.arrival)):
            req.agent, req.turn = agent, turn
            req.client_ttft = ttft.get((agent, turn))
            matched += req.client_ttft is not None
    return matched


def split(req: Req) -> dict[str, float]:
    parts: dict[str, float] = {}
    if req.received is not None:
        parts["api"] = req.arrival - req.received
    if req.admitted is not None:
        parts["queue"] = req.admitted - req.arrival
        if req.launch is not None:
            parts["wait"] = req.launch - req.admitted
    if req.launch is not None and req.done is not None:
        parts["compute"] = req.done - req.launch
        start = req.received if req.received is not None else req.arrival
        parts["server"] = req.done - start
        end = req.done
        if req.pushed is not None and req.taken is not None:
            parts["push"] = req.pushed - req.done
            parts["loop"] = req.taken - req.pushed
            end = req.taken
        if req.client_ttft is not None:
            parts["client"] = req.client_ttft - (end - start)
    return parts


PARTS = ("api", "queue", "wait", "compute", "push", "loop", "server", "client")


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def table(groups: dict[str, list[Req]]) -> list[str]:
    lines = [
        "| turns | n | " + " | ".join(f"{p} p50 / p90 (ms)" for p in PARTS) + " | steps p50 |",
        "|---|---:|" + "---:|" * (len(PARTS) + 1),
    ]
    for name, rs in groups.items():
        if not rs:
            continue
        cells = []
        for p in PARTS:
            vals = [r.parts[p] * 1e3 for r in rs if p in r.parts]
            cells.append(f"{pct(vals, 50):,.1f} / {pct(vals, 90):,.1f}" if vals else "n/a")
        steps = statistics.median(r.steps for r in rs)
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + f" | {steps:g} |")
    return lines


def chunk_group(step: dict) -> int:
    """The steps' grouping by the prompt chunks they carried: 0 .. 8, and 9 for 9 or more."""
    return min(len(step["chunks"]), 9)


def step_lines(steps: list[dict]) -> list[str]:
    """Steps by prompt chunks: how many, how many of them ran eagerly (no CUDA graph: the
    trace marks them from the overlapped loop), their length and their launch call."""
    by_chunks: dict[int, list[tuple[float, float | None, bool]]] = {}
    for s in steps:
        k = chunk_group(s)
        ret = (s["ret"] - s["t0"]) * 1e3 if "ret" in s else None
        by_chunks.setdefault(k, []).append(((s["t1"] - s["t0"]) * 1e3, ret, bool(s.get("eager"))))
    lines = [
        "| prompt chunks | steps | eager | launch → results p50 / p90 (ms) | "
        "launch call p50 / p90 (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k in sorted(by_chunks):
        v = [a for a, _, _ in by_chunks[k]]
        r = [b for _, b, _ in by_chunks[k] if b is not None]
        eager = sum(e for _, _, e in by_chunks[k])
        label = f"{k}+" if k == 9 else str(k)
        call = f"{pct(r, 50):,.1f} / {pct(r, 90):,.1f}" if r else "n/a"
        times = f"{pct(v, 50):,.1f} / {pct(v, 90):,.1f}"
        lines.append(f"| {label} | {len(v):,} | {eager:,} | {times} | {call} |")
    return lines


def slow_steps(steps: list[dict], factor: float = 3.0, top: int = 8) -> list[str]:
    """Steps that took more than `factor` x the median of the steps with as many prompt
    chunks (as `step_lines` groups them; a compile, a capture, a collection...), longest
    first, with the idle time before them (the previous step's results to this launch; 0
    for a step launched ahead), the host time the trace counted (run L's 1.1 s steps), and
    the launch call against the step thread's CPU time in it (traces since session 41): a
    call far longer than its CPU waited, for the GIL or the device (run M's wave steps)."""
    dur = [(s["t1"] - s["t0"]) * 1e3 for s in steps]
    by_group: dict[int, list[float]] = {}
    for s, d in zip(steps, dur):
        by_group.setdefault(chunk_group(s), []).append(d)
    median = {g: statistics.median(v) for g, v in by_group.items() if len(v) > 1}
    slow = []
    for i, (s, d) in enumerate(zip(steps, dur)):
        usual = median.get(chunk_group(s))
        if usual is not None and d > factor * usual:
            idle = max(0.0, (s["t0"] - steps[i - 1]["t1"]) * 1e3) if i else 0.0
            slow.append((d, usual, idle, s))
    slow.sort(key=lambda x: x[0], reverse=True)
    t00 = steps[0]["t0"] if steps else 0.0
    lines = [
        f"{len(slow)} steps took over {factor:g}x the median of the steps with as many prompt "
        "chunks",
        "| at (s) | ms | their median ms | decode rows | prompt chunks | idle before (ms) | "
        "host (ms) | launch call / its CPU (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, usual, idle, s in slow[:top]:
        call = f"{(s['ret'] - s['t0']) * 1e3:,.1f}" if "ret" in s else "n/a"
        cpu = f"{s['cpu'] * 1e3:,.1f}" if "cpu" in s else "n/a"
        lines.append(
            f"| {s['t0'] - t00:.3f} | {d:,.1f} | {usual:,.1f} | {s['decode']} | "
            f"{len(s['chunks'])} | {idle:,.1f} | {s['host'] * 1e3:,.1f} | {call} / {cpu} |"
        )
    return lines


SIZES = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 1 << 30))


def busy_periods(reqs: list[Req]) -> list[list[Req]]:
    """The requests (with a first token) in chains of overlapping arrival → first token
    (their server-side part: `done`), in arrival order."""
    done = [r for r in reqs if r.done is not None]
    return agents.busy_periods(
        done, lambda r: r.arrival, lambda r: r.arrival if r.done is None else r.done
    )


def period_lines(reqs: list[Req]) -> list[str]:
    periods = busy_periods(reqs)
    lines = [
        "| requests in a busy period | periods | requests | arrivals spread p50 (ms) | "
        "length p50 (ms) | server p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lo, hi in SIZES:
        group = [p for p in periods if lo <= len(p) <= hi]
        if not group:
            continue
        spread = [(p[-1].arrival - p[0].arrival) * 1e3 for p in group]
        length = [(max(r.done or 0.0 for r in p) - p[0].arrival) * 1e3 for p in group]
        server = [r.parts["server"] * 1e3 for p in group for r in p if "server" in r.parts]
        label = str(lo) if lo == hi else f"{lo}+" if hi > 1 << 20 else f"{lo}-{hi}"
        cell = f"{pct(server, 50):,.1f}" if server else "n/a"
        lines.append(
            f"| {label} | {len(group)} | {sum(map(len, group))} | {pct(spread, 50):,.1f} | "
            f"{pct(length, 50):,.1f} | {cell} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="the --trace-steps file")
    p.add_argument("--agents", type=Path, help="the bench agents JSON of the same server")
    args = p.parse_args(argv)
    try:
        steps, reqs = read_trace(args.trace)
        matched = match_turns(reqs, args.agents) if args.agents else 0
    except (OSError, ValueError, KeyError) as exc:
        print(f"trace_report: {exc}", file=sys.stderr)
        return 1
    for req in reqs.values():
        req.parts = split(req)
    done = [r for r in reqs.values() if "server" in r.parts]
    groups = {
        "first": [r for r in done if r.turn == 0],
        "resumed": [r for r in done if r.turn is not None and r.turn > 0],
        "all": done,
    }
    if args.agents:
        print(f"{len(done)} requests with a first token; {matched} matched to the client's turns")
    print("\n".join(table(groups)))
    print()
    print("\n".join(step_lines(steps)))
    print()
    print("\n".join(slow_steps(steps)))
    print()
    print("\n".join(period_lines(done)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
