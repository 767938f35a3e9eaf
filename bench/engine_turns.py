"""Wall time of agents' turns through the engine, no HTTP: N sessions that share a chat
template's start, each sending T turns of a ~100-word message, all at once per turn.

    python bench/engine_turns.py [--agents 32] [--turns 3] [--gen 16] [--model demo]

Prints the wall time, steps and what the pool did (copy-on-write block copies, KV moves),
so that host work beside the model (a session's KV copies, the scheduler) shows against the
same forwards. CPU by default (`--device`); the overlapped loop as `ds4pool serve` runs it
on CUDA (`--overlap on`), to keep the step order of a GPU server.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.engine import Engine, EngineConfig  # noqa: E402
from ds4pool.kv import sharing  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.sched.request import Request  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--overlap", default="on")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, torch.device(args.device), torch.float32)
    copies = {"copy_block": 0}
    real_copy = sharing.copy_block

    def counted(*a: object, **kw: object) -> None:
        copies["copy_block"] += 1
        real_copy(*a, **kw)  # type: ignore[arg-type]

    sharing.copy_block = counted  # type: ignore[assignment]
    engine = Engine(
        EngineConfig(kv_device_gb=0.5, overlap=args.overlap, max_prefill_tokens=512),
        loaded=loaded,
    )
    tok = loaded.tokenizer
    try:
        t0 = time.perf_counter()
        for turn in range(args.turns):
            streams = []
            for i in range(args.agents):
                body = " ".join(f"agent {i} turn {turn} word {j}" for j in range(50))
                text = tok.apply_chat_template([{"role": "user", "content": body}])
                req = Request(
                    session_id=f"a{i}", prompt_text=text, max_tokens=args.gen, ignore_eos=True
                )
                streams.append(engine.submit(req))
            for s in streams:
                assert s.collect(timeout=600)[2].error is None
        wall = time.perf_counter() - t0
        steps = engine.worker.steps
    finally:
        engine.close()
    print("| agents x turns | wall (s) | steps | copy-on-write block copies |")
    print("|---|---:|---:|---:|")
    print(f"| {args.agents} x {args.turns} | {wall:.2f} | {steps} | {copies['copy_block']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
