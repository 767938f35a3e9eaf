"""How long the step thread's launches take while other threads of the process run Python,
at several GIL switch intervals.

    python bench/gil_convoy.py                                  # the demo model on CPU
    python bench/gil_convoy.py --model /tmp/m8b --device cuda --dtype bfloat16 --eager

A server's step thread launches a step as hundreds of short calls (torch ops, Triton
launches), and each one releases the GIL and takes it back. While another thread of the
process is busy in Python (the API rendering a chat template and tokenizing the prompt of
each request of an agents' wave, the event loop writing the streams), CPython hands the GIL
back to the step thread only after the busy thread has held it for the switch interval
(5 ms by default): a step of many short calls waits up to that long per call (the convoy
effect). `ds4pool serve --gil-switch-us` sets the interval.

For each kind of work beside the step (--work: the API's template + tokenizer call, the
same with the tokenizer's GIL-holding `encode` as ds4pool called it before, the template
alone) and each interval, this times one step (--batch decode rows at --context tokens,
and with --chunk a prompt chunk beside them; graphs off: eager launches) alone, then while
--threads threads do that work to an agent-sized prompt (--prompt-tokens; the model's
template and tokenizer) in a loop; and how many prompts those threads get through a second
(what a shorter interval costs them). One process, every case side by side. Prints a
table. On a small machine pin the tokenizer's and torch's threads to one each
(RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1), or the cores' oversubscription hides the GIL's part.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds4pool.api.prompt import render_chat  # noqa: E402
from ds4pool.bench.agents import code_text, make_vocab  # noqa: E402
from ds4pool.kv.blocks import BlockPool, BlockTable  # noqa: E402
from ds4pool.model.device import select_device  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402
from ds4pool.serve import set_gil_switch  # noqa: E402


def agent_messages(rng: random.Random, tokens: int) -> list[dict[str, str]]:
    """A coding agent's conversation of about `tokens` tokens: a system prompt, then turns."""
    vocab = make_vocab(0)
    system = code_text(rng, vocab, tokens // 2, 1.3)
    msgs = [{"role": "system", "content": system}]
    for _ in range(3):
        msgs.append({"role": "user", "content": code_text(rng, vocab, tokens // 8, 1.3)})
        msgs.append({"role": "assistant", "content": code_text(rng, vocab, tokens // 24, 1.3)})
    msgs.append({"role": "user", "content": code_text(rng, vocab, tokens // 8, 1.3)})
    return msgs


# What the threads beside the step do per prompt: the API's template and tokenizer call
# (ds4pool's Tokenizer.encode, which lets go of the GIL while the tokenizer runs); the same
# through the tokenizer's `encode`, which holds the GIL throughout (ds4pool before session
# 41); the template alone (Python bytecode: the switch interval decides how soon the step
# thread gets the GIL back).
WORK = {
    "render+encode": lambda tok, msgs: tok.encode(render_chat(tok, msgs), False),
    "render+encode(GIL)": lambda tok, msgs: tok.backend.encode(
        render_chat(tok, msgs), add_special_tokens=False
    ),
    "render": lambda tok, msgs: render_chat(tok, msgs),
}


class PromptThreads:
    """`n` threads doing `work` to a prompt in a loop, counting."""

    def __init__(self, tokenizer, messages: list[dict[str, str]], n: int, work: str) -> None:  # noqa: ANN001
        self.tokenizer, self.messages, self.work = tokenizer, messages, WORK[work]
        self.stop = threading.Event()
        self.done = [0] * n
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            self.work(self.tokenizer, self.messages)
            self.done[i] += 1

    def __enter__(self) -> PromptThreads:
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.rate = sum(self.done) / (time.perf_counter() - self.t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8, help="decode rows of the step")
    ap.add_argument("--context", type=int, default=512, help="their context, tokens")
    ap.add_argument("--chunk", type=int, default=0, help="a prompt chunk beside them, tokens")
    ap.add_argument("--threads", type=int, default=1, help="threads preparing prompts")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument(
        "--work", nargs="+", choices=sorted(WORK), default=sorted(WORK),
        help="what the threads do to each prompt",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=20, help="steps timed per case")
    ap.add_argument(
        "--intervals-us", type=float, nargs="+", default=[5000, 1000, 200, 50],
        help="GIL switch intervals, µs (CPython's default: 5000)",
    )  # fmt: skip
    args = ap.parse_args()
    device = select_device(args.device)
    loaded = load_model(args.model, device, getattr(torch, args.dtype))
    # graphs off: a step of many short launches, the case the convoy hits
    r = ModelRunner(loaded, num_blocks=4096 // 16 * (args.batch + 2), cuda_graphs=False)
    pool = BlockPool(r.num_blocks)
    vocab = loaded.config.vocab_size
    tables = [BlockTable(r.block_size) for _ in range(args.batch + 1)]
    for t in tables[: args.batch]:
        t.ensure(pool, args.context + 1)
        r.step([SeqInput([1 % vocab] * args.context, 0, t.blocks)])
    tables[-1].ensure(pool, args.context + args.chunk)

    def step() -> float:
        seqs = [SeqInput([5 % vocab], args.context, t.blocks) for t in tables[: args.batch]]
        if args.chunk:
            seqs.append(SeqInput([7 % vocab] * args.chunk, args.context, tables[-1].blocks))
        t = time.perf_counter()
        r.step(seqs)
        return (time.perf_counter() - t) * 1e3

    messages = agent_messages(random.Random(0), args.prompt_tokens)
    tok = loaded.tokenizer
    n_tok = len(tok.encode(render_chat(tok, messages), False))
    for _ in range(3):
        step()
    what = f"{args.batch} decode rows at {args.context}" + (
        f" + a {args.chunk}-token chunk" if args.chunk else ""
    )
    print(
        f"model {args.model} on {device}, {args.dtype}: a step of {what} (eager) beside "
        f"{args.threads} thread(s) preparing {n_tok}-token prompts; median (p90) of "
        f"{args.steps} steps"
    )
    print(
        "| beside: threads' work | switch interval µs | step alone ms | step beside ms (p90) "
        "| slower | prompts/s beside |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    default = sys.getswitchinterval()
    try:
        for work in args.work:
            for us in args.intervals_us:
                set_gil_switch(us)  # as `ds4pool serve --gil-switch-us` sets it
                alone = [step() for _ in range(args.steps)]
                with PromptThreads(tok, messages, args.threads, work) as busy:
                    time.sleep(0.05)
                    beside = sorted(step() for _ in range(args.steps))
                a, b = statistics.median(alone), statistics.median(beside)
                p90 = beside[int(0.9 * (len(beside) - 1))]
                print(
                    f"| {work} | {us:g} | {a:.1f} | {b:.1f} ({p90:.1f}) | {b / a:.2f}x "
                    f"| {busy.rate:.1f} |"
                )
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
