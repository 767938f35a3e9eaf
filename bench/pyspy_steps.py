"""What the step thread did during its slow launches: a py-spy chrome trace of the server
beside its `--trace-steps` file.

    py-spy record --threads --idle --native --rate 200 --format chrometrace -o CT.json \\
        -- python3 -m ds4pool serve ... --trace-steps TRACE.jsonl
    python bench/pyspy_steps.py CT.json TRACE.jsonl [--min-ms 60] [--out SUMMARY.json]

The trace says how long each step's launch call took (`t0` → `ret`) and with `"cpu"` how
much of it the step thread ran; it cannot say what the rest was. py-spy samples every thread's
stack, native frames included, so that during a launch the step thread shows where it waits:
taking the GIL back (`take_gil` under `PyEval_RestoreThread`: another thread held it), in the
CUDA driver (a launch queue full, an allocation), or running (Python, torch's dispatcher).
For the GIL waits it also says which other threads were running meanwhile, by their deepest
Python frame. Prints, for the eager launches longer than --min-ms and for all eager
launches together, the step thread's time by state, then the other threads' running frames
during its GIL waits.

py-spy's times start with the recording; the offset onto the trace's clock is found by
lining the step thread's `ModelRunner.launch` frames up with the trace's launch calls (the
offset with the most overlap). py-spy stops the process for each sample (--native needs it):
at 200 samples a second that slows it by a few percent, and a state shorter than 5 ms is
seen only sometimes.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# taking the GIL back: CPython's own frames where the build names them, pybind11's (torch's
# bindings release the GIL around each op) where CPython's are not symbolised
GIL_FRAMES = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyGILState_Ensure",
              "gil_scoped_release::~", "gil_scoped_acquire::gil_scoped_acquire")  # fmt: skip
WAIT_LEAVES = ("epoll_wait", "pthread_cond_", "sem_wait", "sem_timedwait", "futex", "poll",
               "select", "nanosleep", "accept", "recv", "read")  # fmt: skip
# blocking calls seen by their Python frame (their native leaf is often an unnamed libc address)
PY_WAITS = ("Condition.wait", "Event.wait", "Queue.get", "SimpleQueue.get", "Thread.join",
            "EpollSelector.select", "Semaphore.acquire", "_wait_for_tstate_lock")  # fmt: skip
STEP_FRAME = "Worker._run"
LAUNCH_FRAME = "ModelRunner.launch"


@dataclass(frozen=True)
class Frame:
    name: str
    file: str


@dataclass
class Segment:
    start: float  # s, py-spy's clock
    end: float
    stack: tuple[Frame, ...]  # outermost first


class Timeline:
    """Segments that do not overlap, in order of start: what of them lies in [lo, hi)."""

    def __init__(self, segs: list[Segment]) -> None:
        self.segs = segs
        self.starts = [s.start for s in segs]

    def overlap(self, lo: float, hi: float) -> list[tuple[float, Segment]]:
        """(seconds inside [lo, hi), segment) of every segment that reaches into it."""
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        res = []
        while i < len(self.segs) and self.segs[i].start < hi:
            d = min(self.segs[i].end, hi) - max(self.segs[i].start, lo)
            if d > 0:
                res.append((d, self.segs[i]))
            i += 1
        return res


def segments(events: list[dict[str, Any]]) -> dict[str, Timeline]:
    """Each thread's stack over time: spans in which py-spy saw the same stack. A thread is
    keyed by its name event ("thread (TID): NAME"), pthread ids being reused."""
    open_: dict[int, list[Frame]] = collections.defaultdict(list)
    since: dict[int, float] = {}
    label: dict[int, str] = {}
    out: dict[str, list[Segment]] = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):  # stable: B/E order within a ts kept
        tid, ts = e["tid"], e["ts"] / 1e6
        stack = open_[tid]
        if stack and tid in since and ts > since[tid]:
            out[label.get(tid, str(tid))].append(Segment(since[tid], ts, tuple(stack)))
        since[tid] = ts
        if e["ph"] == "B":
            if not stack:
                label[tid] = e["name"]
            stack.append(Frame(e["name"], (e.get("args") or {}).get("filename", "")))
        elif stack:
            stack.pop()
    return {name: Timeline(segs) for name, segs in out.items()}


def state(stack: tuple[Frame, ...]) -> str:
    """The step thread's state in a sample: gil (taking the GIL back), driver (in libcuda),
    wait (blocked elsewhere), run."""
    if taking_gil(stack):
        return "gil"
    if any("libcuda" in f.file for f in stack):
        return "driver"
    return "wait" if in_wait_call(stack) else "run"


def in_wait_call(stack: tuple[Frame, ...]) -> bool:
    """The leaf is a blocking call (epoll, a condition variable, a futex, a read, ...)."""
    return bool(stack) and stack[-1].name.startswith(WAIT_LEAVES)


def taking_gil(stack: tuple[Frame, ...]) -> bool:
    return any(g in f.name for f in stack for g in GIL_FRAMES)


def python_leaf(stack: tuple[Frame, ...]) -> str:
    for f in reversed(stack):
        if f.file.endswith(".py"):
            return f"{f.name} ({Path(f.file).name})"
    return stack[-1].name if stack else "?"


def running(stack: tuple[Frame, ...]) -> bool:
    """Not blocked: running Python, or native code (which may or may not hold the GIL: the
    report names the library of its leaf)."""
    if not stack or taking_gil(stack) or in_wait_call(stack):
        return False
    return not python_leaf(stack).startswith(PY_WAITS)


def where(stack: tuple[Frame, ...]) -> str:
    """The deepest Python frame, and the library of a native leaf below it."""
    leaf = stack[-1]
    lib = "" if leaf.file.endswith(".py") else f" in {Path(leaf.file).name or '?'}"
    return python_leaf(stack) + lib


def fit_offset(launches: list[tuple[float, float]], trace: list[tuple[float, float]]) -> float:
    """trace time - py-spy time: the offset that lines the most launch time up."""
    spans = sorted(launches, key=lambda x: x[1] - x[0], reverse=True)[:30]
    longest = sorted(trace, key=lambda x: x[1] - x[0], reverse=True)[:30]
    windows = Timeline([Segment(a, b, ()) for a, b in sorted(trace)])

    def score(off: float) -> float:
        return sum(d for a, b in launches for d, _ in windows.overlap(a + off, b + off))

    candidates = [t[0] - s[0] for t in longest for s in spans]
    return max(candidates, key=score) if candidates else 0.0


def runs_the_steps(thread: Timeline) -> bool:
    return any(f.name == STEP_FRAME for s in thread.segs for f in s.stack)


def launch_spans(segs: list[Segment]) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    for s in segs:
        if any(f.name == LAUNCH_FRAME for f in s.stack):
            if spans and abs(spans[-1][1] - s.start) < 1e-9:
                spans[-1] = (spans[-1][0], s.end)
            else:
                spans.append((s.start, s.end))
    return spans


def analyse(
    ct: list[dict[str, Any]], steps: list[dict[str, Any]], min_ms: float, every: bool = False
) -> dict[str, Any]:
    threads = segments(ct)
    step_key = next((k for k, t in threads.items() if runs_the_steps(t)), None)
    if step_key is None:
        raise SystemExit("no thread with Worker._run in the py-spy trace")
    step_thread = threads[step_key]
    for s in steps:  # where launch and wait are one call (CPU), the window is the whole step
        s.setdefault("ret", s["t1"])
    eager = [s for s in steps if s.get("eager") or every]
    windows = [(s["t0"], s["ret"]) for s in steps]
    off = fit_offset(launch_spans(step_thread.segs), windows)
    others = {k: v for k, v in threads.items() if k != step_key}

    def window(lo: float, hi: float) -> tuple[collections.Counter[str], collections.Counter[str]]:
        by_state: collections.Counter[str] = collections.Counter()
        holders: collections.Counter[str] = collections.Counter()
        for d, seg in step_thread.overlap(lo - off, hi - off):
            st = state(seg.stack)
            by_state[st] += d
            if st == "gil":
                for name, other in others.items():
                    for d2, s2 in other.overlap(max(lo - off, seg.start), min(hi - off, seg.end)):
                        if running(s2.stack):
                            holders[f"{name.split(': ', 1)[-1]}: {where(s2.stack)}"] += d2
        return by_state, holders

    slow = []
    total_state: collections.Counter[str] = collections.Counter()
    total_holders: collections.Counter[str] = collections.Counter()
    for s in eager:
        by_state, holders = window(s["t0"], s["ret"])
        total_state.update(by_state)
        total_holders.update(holders)
        ms = (s["ret"] - s["t0"]) * 1e3
        if ms >= min_ms:
            slow.append({
                "at": s["t0"], "launch_ms": ms, "cpu_ms": (s.get("cpu") or 0) * 1e3,
                "decode": s.get("decode"), "chunks": len(s.get("chunks") or []),
                "state_ms": {k: v * 1e3 for k, v in by_state.items()},
                "others_ms": {k: v * 1e3 for k, v in holders.most_common(6)},
            })  # fmt: skip
    return {
        "offset_s": off,
        "eager_launches": len(eager),
        "eager_state_ms": {k: v * 1e3 for k, v in total_state.items()},
        "eager_others_ms": {k: v * 1e3 for k, v in total_holders.most_common(12)},
        "slow": slow,
    }


def _states(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


def report(res: dict[str, Any], min_ms: float) -> str:
    t0 = res["slow"][0]["at"] if res["slow"] else 0.0
    lines = [
        f"{res['eager_launches']} eager launches; offset py-spy → trace {res['offset_s']:.3f} s",
        f"all eager launches, step thread ms by state: {_states(res['eager_state_ms'])}",
        "others running while it waited for the GIL (ms): "
        + "; ".join(f"{k} {v:.1f}" for k, v in res["eager_others_ms"].items()),
        "",
        "| at (s) | launch ms | its CPU ms | decode rows | chunks | step thread ms by state "
        "| others running during its GIL waits (ms) |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in res["slow"]:
        others = "; ".join(f"{k} {v:.1f}" for k, v in s["others_ms"].items())
        lines.append(
            f"| {s['at'] - t0:.3f} | {s['launch_ms']:.1f} | {s['cpu_ms']:.1f} | {s['decode']} "
            f"| {s['chunks']} | {_states(s['state_ms'])} | {others} |"
        )
    if not res["slow"]:
        lines.append(f"(no eager launch took {min_ms:g} ms or more)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chrometrace", type=Path)
    p.add_argument("trace", type=Path, help="the server's --trace-steps file")
    p.add_argument("--min-ms", type=float, default=60.0, help="slow: a launch call this long")
    p.add_argument("--out", type=Path, help="also write the summary as JSON")
    p.add_argument("--all", action="store_true", help="every step, not only eager launches")
    args = p.parse_args(argv)
    ct = json.loads(args.chrometrace.read_text())
    events = ct if isinstance(ct, list) else ct.get("traceEvents", [])
    steps = [line for line in map(json.loads, args.trace.read_text().splitlines()) if "t0" in line]
    res = analyse(events, steps, args.min_ms, args.all)
    print(report(res, args.min_ms))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
