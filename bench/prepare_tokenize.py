"""Step-thread time of preparing a long text prompt: tokenized in `SessionLease.prepare` (what
the step thread did before sched/pretokenize.py) vs found pre-tokenized (what it does now).

    python bench/prepare_tokenize.py --words 2000 --repeats 5

Each repetition prepares a new session's first turn (the whole prompt is new text) on the
demo model's pool; the time is that of `prepare` alone, min over the repetitions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds4pool.machine import cpu_name  # noqa: E402
from ds4pool.model.demo import ensure_demo_model  # noqa: E402
from ds4pool.model.loader import load_model  # noqa: E402
from ds4pool.model.runner import ModelRunner  # noqa: E402
from ds4pool.sched.pretokenize import PromptPieces  # noqa: E402
from tests.pool_helpers import make_pool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=2000, help="words of the prompt's body")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    loaded = load_model(str(ensure_demo_model()), torch.device("cpu"), torch.float32)
    tok = loaded.tokenizer

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    body = " ".join(f"word{j % 97} file_{j}.py" for j in range(args.words))
    text = tok.apply_chat_template([{"role": "user", "content": body}])
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    print(f"# {cpu_name()}")
    for ahead in (False, True):
        best, num_tokens = float("inf"), 0
        for i in range(args.repeats):
            pool = make_pool(loaded, runner)
            lease = pool.acquire("bench", f"s{i}")
            pieces = PromptPieces(text, encode)
            if ahead:  # what the pretokenize thread does before admission
                start = pool.text_resume("bench", f"s{i}", text)
                assert start is None  # leased: the thread would wait; a new session starts at 0
                pieces.fill(0)
            t0 = time.perf_counter()
            m = lease.prepare(prompt_text=text, tokenize=pieces.tokenize)
            best = min(best, time.perf_counter() - t0)
            num_tokens = len(m.token_ids)
            lease.release()
        mode = "pre-tokenized" if ahead else "tokenized in prepare"
        print(f"{num_tokens} tokens, {mode}: {best * 1000:.1f} ms on the step thread")


if __name__ == "__main__":
    main()
