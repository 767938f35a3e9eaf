"""How long a full garbage collection holds the server, before and after `gc.freeze()`.

    python bench/gc_pause.py                          # the demo model on CPU
    python bench/gc_pause.py --model /tmp/m8b --device cuda --dtype bfloat16

CPython's collector stops every thread (the step thread included) while it runs. A full
(generation 2) collection walks every tracked object, and a server's start-up leaves a few
hundred thousand of them (the model's modules, the tokenizer, the web framework's routes and
schemas), alive for the whole run. `ds4pool serve` moves them out of the collector's reach
once it has started (`serve.freeze_startup_objects`); this builds the same engine and app,
serves --requests prompts through the engine (objects a running server makes) and times a
full collection (min of three); then freezes, serves as many again and times it again: one
process, side by side.
Prints the tracked objects and the full collection's ms (min of three).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.api.app import create_app  # noqa: E402
from ds4pool.api.config import ServerConfig  # noqa: E402
from ds4pool.engine import Engine, EngineConfig  # noqa: E402
from ds4pool.sched.request import Request  # noqa: E402
from ds4pool.serve import freeze_startup_objects  # noqa: E402


def full_collection_ms(rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=32, help="prompts served before timing")
    args = ap.parse_args()
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    engine = Engine(cfg)
    create_app(ServerConfig(engine=cfg), engine, own_engine=False)  # the routes' objects
    vocab = engine.loaded.config.vocab_size

    def serve(turn: int) -> None:
        streams = [
            engine.submit(
                Request(
                    session_id=f"s{i}",
                    prompt_ids=[4 + (i * 31 + j * 7 + turn) % (vocab - 4) for j in range(300)],
                    max_tokens=8,
                )
            )
            for i in range(args.requests)
        ]
        for s in streams:
            s.collect(timeout=600)

    try:
        serve(0)
        rows = [("as started, then serving", len(gc.get_objects()), full_collection_ms())]
        freeze_startup_objects()
        serve(1)  # what serving makes after the freeze is collected as before
        rows.append(("frozen, then serving", len(gc.get_objects()), full_collection_ms()))
    finally:
        engine.close()
    print(f"\n## full collection, {args.model} on {args.device}\n")
    print("| heap | tracked objects | full collection ms |")
    print("|---|---:|---:|")
    for name, n, ms in rows:
        print(f"| {name} | {n:,} | {ms:.1f} |")


if __name__ == "__main__":
    main()
