"""Tenant isolation by timing: does tenant A's cached prefix make tenant B's TTFT faster?

    python bench/tenant_timing.py                       # demo model, CPU, 40 trials
    python bench/tenant_timing.py --trials 100 --prompt-tokens 1024 --out /tmp/tt

The block index keys full blocks by a hash chain salted by tenant (kv/index.py), so B can
neither reuse A's blocks nor learn from its own TTFT that A sent a prompt. This measures it
on a real engine (CPU, float32), requests submitted as the API submits them:

1. Tenant A sends prompt P (its full blocks stay indexed and on the device).
2. Each trial: A sends P again (the control: a prefix hit, so it must be fast, proving a
   cache hit is visible by timing at all), then a NEW tenant B_i sends either P ("same") or
   a random prompt of the same length ("different"), the two arms alternating in a seeded
   random order. A fresh B per trial: B's own blocks must not help B's later trials.
3. Reported: TTFT (submit → first token) per arm, the difference of medians with a
   bootstrap 95% confidence interval, and cached_tokens per arm (B's must all be 0).

TTFT differences within the CI of 0 mean "no measurable difference"; the control's
difference (A's hit vs B's miss) shows what a real leak would look like.
Writes <out>/tenant_timing.json and <out>/tenant_timing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.engine import Engine, EngineConfig  # noqa: E402
from ds4pool.sched.request import Request  # noqa: E402

ARMS = ("same", "different", "control")


@dataclass(frozen=True)
class Sample:
    arm: str  # same: B sends A's prompt; different: B sends another prompt; control: A again
    tenant: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def first_token(engine: Engine, tenant: str, prompt: list[int], session: str | None) -> Sample:
    """TTFT of one request and its usage (the request is run to its end: one token)."""
    t0 = time.perf_counter()
    stream = engine.submit(
        Request(tenant=tenant, session_id=session, prompt_ids=prompt, max_tokens=1)
    )
    ttft: float | None = None
    for event in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        if event.error:
            raise RuntimeError(event.error)
        if event.finished:
            assert event.usage is not None and ttft is not None
            return Sample("", tenant, ttft, event.usage.prompt_tokens, event.usage.cached_tokens)
    raise RuntimeError("the stream ended without a finish")


def run_trials(
    engine: Engine, trials: int, prompt_tokens: int, seed: int, sessions: bool
) -> list[Sample]:
    """A warms P; then `trials` rounds of (A again, B_i same-or-different in random order)."""
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(prompt_tokens)]

    shared = prompt()
    sid = (lambda name: name) if sessions else (lambda name: None)
    first_token(engine, "tenant-a", shared, sid("a-warm"))
    samples: list[Sample] = []
    for i in range(trials):
        arms = ["same", "different"]
        rng.shuffle(arms)
        control = first_token(engine, "tenant-a", shared, sid(f"a-{i}"))
        samples.append(replace(control, arm="control"))
        for arm in arms:
            tenant = f"tenant-b{i}-{arm}"  # a fresh tenant: nothing of its own is cached
            s = first_token(engine, tenant, shared if arm == "same" else prompt(), sid("b"))
            samples.append(replace(s, arm=arm))
    return samples


def bootstrap_median_diff(
    a: list[float], b: list[float], rounds: int, seed: int
) -> tuple[float, float, float]:
    """median(a) - median(b) and its bootstrap 95% interval (percentile method)."""
    rng = random.Random(seed)
    diffs = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
        for _ in range(rounds)
    )
    lo, hi = diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]
    return statistics.median(a) - statistics.median(b), lo, hi


def summarize(samples: list[Sample], seed: int) -> dict[str, object]:
    by = {arm: [s for s in samples if s.arm == arm] for arm in ARMS}
    ttft = {arm: [s.ttft_s for s in group] for arm, group in by.items()}

    def quantiles(xs: list[float]) -> dict[str, float]:
        q = statistics.quantiles(xs, n=20) if len(xs) > 1 else xs * 19
        return {"p05": q[0], "p50": statistics.median(xs), "p95": q[-1]}

    same_vs_diff = bootstrap_median_diff(ttft["same"], ttft["different"], 4000, seed)
    control_vs_diff = bootstrap_median_diff(ttft["control"], ttft["different"], 4000, seed)
    return {
        "ttft_s": {arm: quantiles(xs) for arm, xs in ttft.items()},
        "cached_tokens": {arm: sorted({s.cached_tokens for s in g}) for arm, g in by.items()},
        "prompt_tokens": sorted({s.prompt_tokens for s in samples}),
        "same_minus_different_s": same_vs_diff,
        "control_minus_different_s": control_vs_diff,
    }


def markdown(summary: dict[str, object], meta: dict[str, object]) -> str:
    t = summary["ttft_s"]
    c = summary["cached_tokens"]
    assert isinstance(t, dict) and isinstance(c, dict)

    def ms(x: float) -> str:
        return f"{1000 * x:.1f}"

    def diff(key: str) -> str:
        d, lo, hi = summary[key]  # type: ignore[misc]
        return f"{ms(d)} ms [{ms(lo)}, {ms(hi)}]"

    rows = [
        f"| {arm} | {ms(t[arm]['p05'])} / {ms(t[arm]['p50'])} / {ms(t[arm]['p95'])} "
        f"| {', '.join(map(str, c[arm]))} |"
        for arm in ARMS
    ]
    return "\n".join(
        [
            f"{meta['started']}, {meta['machine']}, load 1m {meta['load_1m']:.1f}; "
            f"{meta['trials']} trials, prompt {meta['prompt_tokens']} tokens, "
            f"sessions: {meta['sessions']}",
            "",
            "| arm | TTFT p05 / p50 / p95 (ms) | cached_tokens seen |",
            "|---|---:|---|",
            *rows,
            "",
            f"median(same) - median(different): {diff('same_minus_different_s')} (95% CI)",
            f"median(control) - median(different): {diff('control_minus_different_s')} (95% CI)",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sessions", action="store_true", help="session-less requests")
    p.add_argument("--kv-gb", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("out/tenant_timing"))
    args = p.parse_args()
    if args.trials < 2 or args.prompt_tokens < 32:
        p.error("need --trials >= 2 and --prompt-tokens >= 32 (two full blocks)")
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cfg = EngineConfig(model=args.model, device="cpu", dtype="float32", kv_device_gb=args.kv_gb)
    engine = Engine(cfg)
    try:
        samples = run_trials(
            engine, args.trials, args.prompt_tokens, args.seed, not args.no_sessions
        )
    finally:
        engine.close()
    summary = summarize(samples, args.seed)
    meta = {
        "started": started,
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "load_1m": os.getloadavg()[0],
        "trials": args.trials,
        "prompt_tokens": args.prompt_tokens,
        "sessions": not args.no_sessions,
        "model": args.model,
    }
    doc = {"meta": meta, "summary": summary, "samples": [asdict(s) for s in samples]}
    (args.out / "tenant_timing.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(summary, meta)
    (args.out / "tenant_timing.md").write_text(md + "\n")
    print(md)
    cached = summary["cached_tokens"]
    assert isinstance(cached, dict)
    leaked = cached["same"] != [0] or cached["different"] != [0]
    return 1 if leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
