"""What grammar-constrained decoding costs per step: bitmask fill and masking, and a step.

    python bench/grammar_mask.py                      # demo vocab (1,024) and, if fetched,
                                                      # Qwen3's (151,669; lm_head 151,936)
    python bench/grammar_mask.py --steps 200
    python bench/grammar_mask.py --device cuda        # masking on the GPU (fill stays on CPU)

Part 1 (micro, per vocabulary): N in {1, 16} matchers of one JSON schema, each driven through
a forced generation (fill the mask, take the highest allowed id, accept it; a matcher that
ends is restarted). Per step it times the scheduler's work, `GrammarState.fill()` for all N,
and the runner's, `apply_token_bitmask` on [N, V] float32 logits (on --device: CPU uses
xgrammar's kernel, CUDA one pinned upload plus a few elementwise kernels). Medians over
--steps steps.

Part 2 (end to end, demo model): 16 requests decoding together, all constrained vs none,
median decode-step time from the scheduler's observer hook.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.demo import ensure_demo_model
from ds4pool.model.grammar import GrammarCache, GrammarState, apply_token_bitmask
from ds4pool.model.loader import load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.constraints import json_schema_spec
from ds4pool.sched.request import Request
from ds4pool.sched.scheduler import SchedulerObserver

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
                "required": ["id", "name"],
            },
        }
    },
    "required": ["items"],
}


def micro(
    tok: Tokenizer, vocab: int, n: int, steps: int, device: torch.device
) -> tuple[float, float]:
    cache = GrammarCache(tok, vocab)
    constraint = cache.compile(json_schema_spec(SCHEMA, "schema"))
    states = [GrammarState(constraint, vocab) for _ in range(n)]
    logits = torch.randn(n, vocab, device=device)
    fills, applies = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = [s.fill() for s in states]
        t1 = time.perf_counter()
        masked = apply_token_bitmask(logits, list(range(n)), masks)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        best = masked.argmax(dim=1).tolist()
        for k, s in enumerate(states):
            token = best[k]
            s.accept(token)
            if s.terminated or token in tok.eos_token_ids:
                states[k] = GrammarState(constraint, vocab)
        logits = torch.randn(n, vocab, device=device)
    return statistics.median(fills) * 1e6, statistics.median(applies) * 1e6


class StepTimes(SchedulerObserver):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def step(
        self, batch_size: int, num_tokens: int, seconds: float, host_seconds: float = 0.0
    ) -> None:
        if batch_size == 16 and num_tokens == 16:  # decode steps of all 16
            self.seconds.append(seconds)


def end_to_end(constrained: bool) -> float:
    loaded = load_model(str(ensure_demo_model()), torch.device("cpu"), torch.float32)
    times = StepTimes()
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded, sched_observer=times)
    try:
        c = e.compile_constraint(json_schema_spec(SCHEMA, "schema")) if constrained else None
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "list"}])
        reqs = [
            Request(
                prompt_text=prompt,
                max_tokens=64,
                ignore_eos=True,
                sampling=SamplingParams(temperature=1.0, seed=i),
                constraint=c,
            )
            for i in range(16)
        ]
        for s in [e.submit(r) for r in reqs]:
            s.collect(timeout=600)
    finally:
        e.close()
    return statistics.median(times.seconds) * 1e3 if times.seconds else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    vocabs = [("demo", Tokenizer.from_dir(ensure_demo_model()), 1024)]
    qwen = Path.home() / ".cache/ds4pool/test-tokenizers/qwen3"
    if (qwen / "tokenizer.json").is_file():
        vocabs.append(("qwen3", Tokenizer.from_dir(qwen), 151936))
    print("vocab    V        N   fill us/step  (per seq)  mask us/step")
    for name, tok, vocab in vocabs:
        for n in (1, 16):
            fill, apply = micro(tok, vocab, n, args.steps, device)
            print(f"{name:8} {vocab:<8} {n:<3} {fill:12.1f}  {fill / n:9.1f}  {apply:12.1f}")
    if device.type != "cpu":
        return  # part 2 is the CPU demo engine
    free, forced = end_to_end(False), end_to_end(True)
    print(f"demo model, 16 decoding: step {free:.2f} ms free, {forced:.2f} ms all constrained")
    print(json.dumps({"step_ms_free": free, "step_ms_constrained": forced}))


if __name__ == "__main__":
    main()
