"""The event loop's CPU time per streamed chunk and per request, by HTTP implementation and
event loop (`ds4pool serve --http / --loop`).

    python bench/http_cost.py                       # the demo model on CPU, 3 rounds
    python bench/http_cost.py --streams 64 --gen 128 --requests 64 --prompt-tokens 3500

The server's event loop (its main thread) parses every request, runs the handler and writes
every streamed chunk; all of it holds the GIL that the step thread needs for each launch
(bench/gil_convoy.py, docs/BENCHMARKS.md "The step thread and the GIL"). uvicorn does the
HTTP/1.1 parsing and framing in h11 (pure Python) or httptools (C), on asyncio's loop or
uvloop. For each --variant this starts a fresh server and measures, from /proc, the CPU
seconds of its main thread while

    stream    --streams concurrent requests stream --gen tokens each (short prompts), per
              chunk received;
    requests  --requests concurrent requests of an agent-sized conversation (--prompt-tokens,
              the chat template rendered and tokenized in worker threads, as always) whose
              prompt the server has cached (each session sent it once before, unmeasured), one
              token each: the API's part of a resumed turn, per request.

Variants alternate within each round (--rounds), every number a median over rounds. The
model's own compute is not the measure: any model works (the demo model on CPU by default).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.agents_compare import free_port, stop, wait_ready  # noqa: E402
from bench.gil_convoy import agent_messages  # noqa: E402
from ds4pool.bench.agents import sse_data  # noqa: E402

VARIANTS = ["h11/asyncio", "httptools/asyncio", "h11/uvloop", "httptools/uvloop"]


def main_thread_cpu(pid: int) -> float:
    """Seconds the process's main thread has run on a CPU (Linux schedstat: nanoseconds,
    where /proc's stat counts 10 ms ticks)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


async def _request(client: httpx.AsyncClient, body: dict[str, Any], session: str) -> int:
    chunks = 0
    headers = {"X-Session-Id": session}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for data in sse_data(r.aiter_bytes()):
            chunks += data != b"[DONE]"
    return chunks


async def _load(url: str, bodies: list[dict[str, Any]], tag: str) -> int:
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        got = await asyncio.gather(
            *(_request(client, b, f"{tag}-{i}") for i, b in enumerate(bodies))
        )
    return sum(got)


def measure(url: str, pid: int, bodies: list[dict[str, Any]], tag: str) -> tuple[float, int]:
    """(main-thread CPU seconds, chunks) of one concurrent load."""
    before = main_thread_cpu(pid)
    chunks = asyncio.run(_load(url, bodies, tag))
    return main_thread_cpu(pid) - before, chunks


def stream_bodies(n: int, gen: int) -> list[dict[str, Any]]:
    return [
        {
            "model": "m",
            "messages": [{"role": "user", "content": f"agent {i}: list the files"}],
            "max_tokens": gen,
            "ignore_eos": True,
            "stream": True,
        }
        for i in range(n)
    ]


def request_bodies(n: int, prompt_tokens: int) -> list[dict[str, Any]]:
    # one conversation for every session: the server computes its prefix once (shared
    # prefix blocks), and the handler's work is the same as for n different ones
    messages = agent_messages(random.Random(0), prompt_tokens)
    return [
        {
            "model": "m",
            "messages": messages,
            "max_tokens": 1,
            "ignore_eos": True,
            "stream": True,
        }
        for _ in range(n)
    ]


def run_variant(
    variant: str, args: argparse.Namespace, rnd: int, log_dir: Path
) -> dict[str, float]:
    http, loop = variant.split("/")
    port = free_port()
    argv = [sys.executable, "-m", "ds4pool", "serve", "--model", args.model]
    argv += ["--device", args.device, "--port", str(port), "--log-level", "warning"]
    argv += ["--http", http, "--loop", loop]
    log = log_dir / f"{variant.replace('/', '_')}-{rnd}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log, 300)
        streams = stream_bodies(args.streams, args.gen)
        measure(url, proc.pid, streams[:4], "warm")  # compiles, first allocations
        s_cpu, s_chunks = measure(url, proc.pid, streams, "s")
        reqs = request_bodies(args.requests, args.prompt_tokens)
        measure(url, proc.pid, reqs, "r")  # the prompts' KV, unmeasured
        r_cpu = sum(measure(url, proc.pid, reqs, "r")[0] for _ in range(args.passes))
        return {
            "stream_us_per_chunk": 1e6 * s_cpu / max(s_chunks, 1),
            "request_us": 1e6 * r_cpu / (args.requests * args.passes),
        }
    finally:
        stop(proc)


def table(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    base = results[VARIANTS[0]] if VARIANTS[0] in results else next(iter(results.values()))

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    lines = [
        f"event loop (main thread) CPU, median of {args.rounds} rounds; model {args.model} on "
        f"{args.device}; {args.streams} streams x {args.gen} tokens; {args.requests} requests "
        f"of ~{args.prompt_tokens} prompt tokens (cached), 1 token each",
        "",
        "| --http / --loop | µs per streamed chunk | vs first | µs per request | vs first |",
        "|---|---:|---:|---:|---:|",
    ]
    b_chunk, b_req = med(base, "stream_us_per_chunk"), med(base, "request_us")
    for variant, rows in results.items():
        c, r = med(rows, "stream_us_per_chunk"), med(rows, "request_us")
        lines.append(f"| {variant} | {c:,.0f} | {c / b_chunk:.2f}x | {r:,.0f} | {r / b_req:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--gen", type=int, default=64, help="tokens per stream")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=3500)
    p.add_argument("--passes", type=int, default=3, help="measured passes of the requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--variant", action="append", choices=VARIANTS, help="(repeatable) default: all four"
    )
    args = p.parse_args(argv)
    variants = args.variant or VARIANTS
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for v in variants:
                t = time.monotonic()
                results[v].append(run_variant(v, args, rnd, Path(tmp)))
                print(f"round {rnd} {v}: {results[v][-1]} ({time.monotonic() - t:.0f} s)",
                      file=sys.stderr)  # fmt: skip
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
