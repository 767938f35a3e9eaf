"""`ds4pool bench agents`: N simulated coding agents against a running server.

Each agent is one session (`X-Session-Id: agent-<i>-<seed>`) whose conversation grows turn
by turn, as a coding agent's does: a system prompt of S tokens shared by every agent, then
per turn a tool-result-like user message of U tokens and a streamed completion of exactly
G tokens (greedy, `max_tokens=G`, `ignore_eos`), sent back as the assistant message of the
next turn. Between turns an agent "thinks" for a seeded random pause. All agents start at
the same moment. The client streams `/v1/chat/completions` over httpx (async, with
`stream_options={"include_usage": True}`) and parses the SSE lines itself, so the same
workload drives any OpenAI-compatible server (`--no-session-header`, `--no-ignore-eos`,
`--extra-body`). It runs on one core, or on P with `--client-procs P` (the agents dealt to P
processes, their clocks started at one barrier): the report gives its CPU time over the
measured part (`client_cpu_s`), and a note warns when it was busy more than half the run
(its own delays are then part of what it measures).

Text is synthetic "code": lines of words drawn from a seeded vocabulary of identifiers,
keywords, operators and numbers. Token counts are approximated by words: the demo model's
byte-level BPE gives about TOKENS_PER_WORD tokens per word on this text (override with
`--tokens-per-word`); the report gives the real prompt sizes from `usage`. `--seed`
fixes every text and pause, so two runs (on two servers) send identical requests.

Measured per turn: TTFT (request sent → first content chunk), end-to-end time,
inter-token latency (gaps between content chunks), usage (prompt, cached =
`prompt_tokens_details.cached_tokens`, 0 when the server reports none, completion).
ITL is per token only where every chunk carries one token: a server that holds an incomplete
UTF-8 character back (ds4pool, vLLM) sends two ids of one character in one chunk, so the
report gives `tokens_per_chunk` and the bench warns when it is above 1.05 (TPOT, a turn's
mean time per token after the first, is per token either way).
Aggregate gen tok/s = completion tokens of all turns / wall time of the whole run (think
pauses included). The clock starts after a warm-up (`--warmup-requests`, default
min(agents, 4)): that many concurrent first turns of the same size with texts of their own
and no session, so that a fresh server's one-off costs (kernels compiled on first use) are
not counted as the workload's. ds4pool's
`ds4pool_session_moves_total` and `ds4pool_restore_decisions_total` (a returning session's KV
read back or recomputed) are scraped from `/metrics` once the warm-up is over and at the end
(n/a elsewhere), and so are the step histograms' counts and sums: `server_steps` says how
many steps the measured part took, their mean wall and host ms, sequences and tokens a step,
the steps whose decoders held prompts to a work cap, and the requests' mean queue wait
(printed as one line).
Session ids repeat for a repeated seed: use a new `--seed` (or restart) per run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from ds4pool.errors import Ds4poolError
from ds4pool.machine import cpu_name, cpu_topology
from ds4pool.progress import Progress

# Tokens per word of code_text() under the demo model's byte-level BPE (6.00-6.05 measured on
# 20,000 words for seeds 0, 1, 2; a real BPE with a code-heavy vocabulary gives fewer).
TOKENS_PER_WORD = 6.0
SESSION_HEADER = "X-Session-Id"

_KEYWORDS = (
    "def", "return", "if", "else", "elif", "for", "in", "import", "from", "class", "self",
    "None", "True", "False", "with", "as", "try", "except", "raise", "lambda", "yield",
    "assert", "not", "and", "or", "is", "while", "pass", "async", "await",
)  # fmt: skip
_SYLLABLES = (
    "get", "set", "load", "save", "path", "file", "node", "tree", "item", "list", "key",
    "value", "buf", "size", "count", "index", "parse", "token", "block", "cache", "session",
    "pool", "read", "write", "user", "config", "error", "test", "data", "line", "name",
    "text", "time", "step", "batch", "queue", "state", "result", "handle", "check",
)  # fmt: skip
_OPS = ("=", "==", "+", "-", "(", ")", ":", ",", "[", "]", "->", ".", "#", "{", "}")
_NUMBERS = ("0", "1", "2", "8", "16", "42", "100", "255", "1024")


@dataclass(frozen=True)
class Workload:
    """Everything that determines the requests (identical across servers for one seed)."""

    agents: int
    turns: int
    system_tokens: int
    user_tokens: int
    gen_tokens: int
    think_min: float
    think_max: float
    seed: int
    model: str
    session_header: bool = True
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokens_per_word: float = TOKENS_PER_WORD


@dataclass
class TurnResult:
    """One request: times in seconds (start relative to the run's start)."""

    agent: int
    turn: int
    start: float
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    reply_sha256: str = ""  # first 16 hex digits: do two servers generate the same text?
    error: str | None = None


# ------------------------------------------------------------------ synthetic code text


def make_vocab(seed: int, size: int = 400) -> list[str]:
    """A seeded vocabulary of identifiers (snake_case and camelCase) plus keywords etc."""
    rng = random.Random(f"vocab:{seed}")
    idents: set[str] = set()
    while len(idents) < size:
        parts = [rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            idents.add("_".join(parts))
        else:
            idents.add(parts[0] + "".join(p.title() for p in parts[1:]))
    return sorted(idents) + list(_KEYWORDS) + list(_OPS) + list(_NUMBERS)


def code_text(rng: random.Random, vocab: Sequence[str], n_tokens: int, tpw: float) -> str:
    """About n_tokens tokens of code-like lines (n_tokens / tpw words)."""
    n_words = max(1, round(n_tokens / tpw))
    lines: list[str] = []
    line: list[str] = []
    depth, width = 0, rng.randint(4, 12)
    for _ in range(n_words):
        line.append(rng.choice(vocab))
        if len(line) >= width:
            lines.append("    " * depth + " ".join(line))
            line, depth, width = [], rng.randint(0, 2), rng.randint(4, 12)
    if line:
        lines.append("    " * depth + " ".join(line))
    return "\n".join(lines)


def system_prompt(w: Workload, vocab: Sequence[str]) -> str:
    return code_text(random.Random(f"system:{w.seed}"), vocab, w.system_tokens, w.tokens_per_word)


# ------------------------------------------------------------------ one turn, one agent


async def run_turn(
    client: Any, w: Workload, messages: list[dict[str, str]], sid: str, res: TurnResult
) -> str:
    """Stream one chat completion, filling `res`; returns the generated text. `client` is an
    httpx.AsyncClient on the server's URL. The SSE lines are parsed here with json.loads, not
    through the openai SDK's models: with them the client took 0.63-0.72 ms of its one core
    per chunk (requests included; 0.28-0.30 ms now, 64 agents on a 2-core VM), more than a
    core at the ~1,700 chunks/s of 64 agents on an H100 (docs/BENCHMARKS.md, run H)."""
    headers = {SESSION_HEADER: sid} if w.session_header else {}
    body: dict[str, Any] = {
        "model": w.model,
        "messages": messages,
        "max_tokens": w.gen_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **w.extra_body,
    }
    if w.ignore_eos:
        body["ignore_eos"] = True
    parts: list[str] = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {r.status_code}: {text[:200]}")
        async for event in sse_data(r.aiter_raw()):
            if event == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(event)
            if chunk.get("error"):
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            if chunk.get("usage"):
                _take_usage(res, chunk["usage"])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    parts.append(content)
                    stamps.append(now)
    res.e2e = time.perf_counter() - t0
    if not stamps:
        if res.completion_tokens:  # generated, but nothing to time: say why
            raise RuntimeError(
                f"the stream ended without any content ({res.completion_tokens} tokens "
                "generated that decode to no text: does the model's vocab_size exceed its "
                "tokenizer's? ids without a token decode to nothing)"
            )
        raise RuntimeError("the stream ended without any content")
    res.ttft = stamps[0] - t0
    res.gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if not res.usage_reported:
        res.completion_tokens = len(stamps)  # no usage: chunks stand in for tokens
    reply = "".join(parts)
    res.reply_sha256 = hashlib.sha256(reply.encode()).hexdigest()[:16]
    return reply


async def sse_data(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream, from its raw bytes as they come
    (an event's lines may span reads; a payload of several `data:` lines is one event,
    joined by newlines; other fields and comments are skipped; an event the stream ends in,
    before its blank line, is dropped, as the SSE spec says)."""
    buf = b""
    data: list[bytes] = []
    async for piece in raw:
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif not line and data:  # a blank line ends the event
                yield b"\n".join(data)
                data = []


def _take_usage(res: TurnResult, usage: dict[str, Any]) -> None:
    res.usage_reported = True
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = int(details.get("cached_tokens") or 0)


async def run_agent(
    i: int,
    client: Any,
    w: Workload,
    system: str,
    vocab: Sequence[str],
    t_start: float,
    out: list[TurnResult],
    progress: Progress,
) -> None:
    """One agent's turns; a failed turn ends the agent (its later turns are skipped)."""
    text_rng = random.Random(f"user:{w.seed}:{i}")
    think_rng = random.Random(f"think:{w.seed}:{i}")
    sid = f"agent-{i}-{w.seed}"
    messages = [{"role": "system", "content": system}]
    for turn in range(w.turns):
        if turn:
            await asyncio.sleep(think_rng.uniform(w.think_min, w.think_max))
        user = code_text(text_rng, vocab, w.user_tokens, w.tokens_per_word)
        messages.append({"role": "user", "content": user})
        res = TurnResult(agent=i, turn=turn, start=time.perf_counter() - t_start)
        out.append(res)
        try:
            reply = await run_turn(client, w, messages, sid, res)
        except Exception as exc:  # noqa: BLE001 - any failure is counted, not raised
            res.error = f"{type(exc).__name__}: {exc}"[:300]
            progress.advance(w.turns - turn)
            return
        messages.append({"role": "assistant", "content": reply})
        progress.advance()


WARMUP_GEN_TOKENS = 8  # per warm-up request: enough for decode steps of all of them


async def warm_up(client: Any, w: Workload, vocab: Sequence[str], requests: int) -> None:
    """`requests` concurrent first turns of the workload's size (system + user tokens), each
    with texts of its own and no session, before the clock starts: a fresh server's first
    steps pay one-off costs (GPU kernels compiled for the prompt shapes a start-up capture
    did not meet: 2-4 s on the H200, docs/BENCHMARKS.md run F) that are not the workload's.
    The texts share nothing with the measured ones beyond the chat template's first tokens,
    so no measured prompt is found cached because of them."""
    warm = Workload(
        **{**asdict(w), "session_header": False, "gen_tokens": min(w.gen_tokens, WARMUP_GEN_TOKENS)}
    )
    sizes = (w.system_tokens, w.user_tokens)

    async def one(k: int) -> None:
        rng = random.Random(f"warmup:{w.seed}:{k}")
        system, user = (code_text(rng, vocab, n, w.tokens_per_word) for n in sizes)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        await run_turn(client, warm, messages, "", TurnResult(agent=-1 - k, turn=0, start=0.0))

    await asyncio.gather(*(one(k) for k in range(requests)))


def http_client(url: str, api_key: str, timeout_s: float) -> Any:
    import httpx

    return httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=timeout_s,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


@dataclass(frozen=True)
class Measured:
    """The measured part's turns, wall time, and the client's CPU seconds in it (summed over
    its processes)."""

    turns: list[TurnResult]
    wall: float
    cpu: float


async def run_workload(
    url: str,
    w: Workload,
    api_key: str,
    timeout_s: float,
    warmup: int,
    show_progress: bool,
    measured: Callable[[], Awaitable[None]] | None = None,
    procs: int = 1,
) -> Measured:
    """All agents concurrently after `warmup` unmeasured requests (`warm_up`). `measured` is
    awaited between the two (the server's counters before the measured part). With `procs`
    > 1 the agents are dealt to that many client processes (`run_sharded`)."""
    client = http_client(url, api_key, timeout_s)
    if warmup:
        await warm_up(client, w, make_vocab(w.seed), warmup)
    if measured is not None:
        await measured()
    if procs > 1:
        await client.aclose()
        return await asyncio.to_thread(run_sharded, url, w, api_key, timeout_s, procs)
    try:
        return await run_agents_of(client, w, range(w.agents), show_progress)
    finally:
        await client.aclose()


async def run_agents_of(
    client: Any,
    w: Workload,
    agents: Sequence[int],
    show_progress: bool,
    ready: Callable[[], object] | None = None,
) -> Measured:
    """Agents `agents` of the workload concurrently, the clock started once `ready()` (a
    barrier of the other client processes) returns."""
    vocab = make_vocab(w.seed)
    system = system_prompt(w, vocab)
    if ready is not None:
        await asyncio.to_thread(ready)
    out: list[TurnResult] = []
    with Progress("agents", len(agents) * w.turns, enabled=show_progress) as progress:
        t_start, cpu_start = time.perf_counter(), time.process_time()
        await asyncio.gather(
            *(run_agent(i, client, w, system, vocab, t_start, out, progress) for i in agents)
        )
        wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    return Measured(out, wall, cpu)


def run_sharded(url: str, w: Workload, api_key: str, timeout_s: float, procs: int) -> Measured:
    """The agents dealt to `procs` client processes (agent i to process i % procs), each
    with its own event loop and core, their clocks started together at a barrier: one
    process's parsing then does not delay another's streams. The wall time is the longest
    process's; turns' start times are relative to each process's start (one barrier apart)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads running
    with ctx.Manager() as manager, ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        barrier = manager.Barrier(procs)
        futures = [
            pool.submit(_shard, url, w, api_key, timeout_s, range(k, w.agents, procs), barrier)
            for k in range(procs)
        ]
        parts = [f.result() for f in futures]
    return Measured(
        [t for part in parts for t in part.turns],
        max(part.wall for part in parts),
        sum(part.cpu for part in parts),
    )


def _shard(
    url: str, w: Workload, api_key: str, timeout_s: float, agents: range, barrier: Any
) -> Measured:
    async def go() -> Measured:
        client = http_client(url, api_key, timeout_s)
        try:
            return await run_agents_of(client, w, agents, False, barrier.wait)
        finally:
            await client.aclose()

    return asyncio.run(go())


# ------------------------------------------------------------------ server side facts


_SAMPLE_LINE = re.compile(r"^(?P<name>\w+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# counters of the report: metric → (labels joined into the key, the separator)
COUNTERS = {
    "session_moves": ("ds4pool_session_moves_total", ("from", "to"), "->"),
    "restore_decisions": ("ds4pool_restore_decisions_total", ("tier", "choice"), " "),
}


def scrape_metrics(url: str, api_key: str) -> str | None:
    """The server's /metrics text; None where it answers none (another server's metrics
    count as text: the parsers below find none of ds4pool's names in it)."""
    import httpx

    try:
        resp = httpx.get(
            f"{url}/metrics", timeout=10, headers={"Authorization": f"Bearer {api_key}"}
        )
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def counters(text: str | None) -> dict[str, dict[str, float] | None]:
    """Each of COUNTERS summed by its labels ("ram->disk", "disk recompute"); None for a
    counter the server does not export (another server, an older ds4pool)."""
    out: dict[str, dict[str, float] | None] = dict.fromkeys(COUNTERS)
    by_metric = {metric: (key, labels, sep) for key, (metric, labels, sep) in COUNTERS.items()}
    for line in (text or "").splitlines():
        m = _SAMPLE_LINE.match(line)
        if m is None or m.group("name") not in by_metric:
            continue
        key, names, sep = by_metric[m.group("name")]
        labels = dict(_LABEL.findall(m.group("labels")))
        sums = out[key]
        if sums is None:
            sums = out[key] = {}
        cell = sep.join(labels.get(n, "?") for n in names)
        sums[cell] = sums.get(cell, 0.0) + float(m.group("value"))
    return out


# the histograms behind the report's server_steps: key -> ds4pool metric
HISTOGRAMS = {
    "step": "ds4pool_step_duration_seconds",
    "host": "ds4pool_step_host_seconds",
    "rows": "ds4pool_batch_size",
    "tokens": "ds4pool_batch_tokens",
    "budget": "ds4pool_prefill_work_budget",
    "queue_wait": "ds4pool_queue_wait_seconds",
    "ttft": "ds4pool_time_to_first_token_seconds",  # from the request's arrival in the engine
}
_TOTAL_LINE = re.compile(r"^(?P<name>\w+)_(?P<part>count|sum)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def histogram_totals(text: str | None) -> dict[str, tuple[float, float]] | None:
    """(count, sum) of each of HISTOGRAMS, summed over its labels; None where the text has
    none of them (not ds4pool, or no metrics)."""
    by_metric = {metric: key for key, metric in HISTOGRAMS.items()}
    out: dict[str, list[float]] = {}
    for line in (text or "").splitlines():
        m = _TOTAL_LINE.match(line)
        if m is None or m.group("name") not in by_metric:
            continue
        total = out.setdefault(by_metric[m.group("name")], [0.0, 0.0])
        total[m.group("part") == "sum"] += float(m.group("value"))
    return {k: (c, s) for k, (c, s) in out.items()} or None


_THREADS_LINE = re.compile(r"^ds4pool_cpu_threads\s+(?P<value>\S+)")


def scraped_cpu_threads(text: str | None) -> int | None:
    """ds4pool_cpu_threads (the model's CPU threads at the scrape); None for a server without
    it or off CPU (0)."""
    for line in (text or "").splitlines():
        m = _THREADS_LINE.match(line)
        if m is not None:
            return int(float(m.group("value"))) or None
    return None


def server_steps(
    before: dict[str, tuple[float, float]] | None, after: dict[str, tuple[float, float]] | None
) -> dict[str, float | int | None] | None:
    """The server's steps over the measured part, from its histograms' counts and sums:
    how many, their mean wall and host ms, sequences and tokens a step, the steps whose
    decoders held prompts to a work cap (whether or not a prompt waited) and that cap's mean,
    the requests admitted with their mean queue wait, and their mean TTFT as the engine saw it
    (from the request's arrival: what the client's TTFT adds is HTTP, parsing, streaming).
    None for a server without ds4pool's metrics."""
    if before is None or after is None:
        return None

    def delta(key: str) -> tuple[float, float]:
        c0, s0 = before.get(key, (0.0, 0.0))
        c1, s1 = after.get(key, (0.0, 0.0))
        return c1 - c0, s1 - s0

    def mean(key: str, scale: float = 1.0) -> float | None:
        n, total = delta(key)
        return total / n * scale if n > 0 else None

    return {
        "steps": int(delta("step")[0]),
        "step_ms": mean("step", 1e3),
        "host_ms": mean("host", 1e3),
        "rows": mean("rows"),
        "tokens": mean("tokens"),
        "capped_steps": int(delta("budget")[0]),
        "cap": mean("budget"),
        "admitted": int(delta("queue_wait")[0]),
        "queue_wait_ms": mean("queue_wait", 1e3),
        "ttft_ms": mean("ttft", 1e3),
    }


def moves_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    delta = {k: int(v - before.get(k, 0.0)) for k, v in after.items()}
    return {k: v for k, v in sorted(delta.items()) if v}


def discover_model(url: str, api_key: str) -> str:
    """The first id of GET /v1/models ('default' when the server lists none)."""
    import httpx

    try:
        resp = httpx.get(
            f"{url}/v1/models", timeout=10, headers={"Authorization": f"Bearer {api_key}"}
        )
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise Ds4poolError(f"cannot list models at {url}/v1/models: {exc}") from None
    return str(data[0]["id"]) if data else "default"


# ------------------------------------------------------------------ the report


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p95, mean, max (linear-interpolated percentiles); None fields when empty."""
    if not values:
        return {"n": 0, "p50": None, "p95": None, "mean": None, "max": None}
    xs = sorted(values)

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "n": len(xs),
        "p50": pct(0.5),
        "p95": pct(0.95),
        "mean": sum(xs) / len(xs),
        "max": xs[-1],
    }


def summarize(turns: list[TurnResult], wall: float, w: Workload) -> dict[str, Any]:
    """The metrics of the report (everything but run metadata)."""
    ok = [t for t in turns if t.error is None]
    first = [t for t in ok if t.turn == 0]
    resumed = [t for t in ok if t.turn > 0]
    completion = sum(t.completion_tokens for t in ok)
    tpot = [
        (t.e2e - t.ttft) / (t.completion_tokens - 1)
        for t in ok
        if t.e2e is not None and t.ttft is not None and t.completion_tokens > 1
    ]
    # a chunk can carry several tokens (a server holds an incomplete UTF-8 character back):
    # ITL is then a gap between chunks, TPOT stays per token; a turn without content failed
    chunks = sum(len(t.gaps) + 1 for t in ok)
    by_turn = {
        str(k): stats([t.ttft for t in ok if t.turn == k and t.ttft is not None])
        for k in range(w.turns)
    }
    return {
        "wall_s": wall,
        "turns_planned": w.agents * w.turns,
        "turns_ok": len(ok),
        "errors": len(turns) - len(ok),
        "turns_skipped": w.agents * w.turns - len(turns),
        "error_samples": sorted({t.error for t in turns if t.error})[:5],
        "ttft_first_s": stats([t.ttft for t in first if t.ttft is not None]),
        "ttft_resumed_s": stats([t.ttft for t in resumed if t.ttft is not None]),
        "ttft_by_turn_s": by_turn,
        "e2e_s": stats([t.e2e for t in ok if t.e2e is not None]),
        "itl_s": stats([g for t in ok for g in t.gaps]),
        "tpot_s": stats(tpot),
        "completion_tokens": completion,
        "content_chunks": chunks,
        "tokens_per_chunk": completion / chunks if chunks else float("nan"),
        "gen_tok_s": completion / wall if wall > 0 else 0.0,
        "usage_reported": all(t.usage_reported for t in ok) if ok else False,
        "prefill": _prefill(first, resumed),
    }


def _prefill(first: list[TurnResult], resumed: list[TurnResult]) -> dict[str, int]:
    def computed(ts: list[TurnResult]) -> int:
        return sum(max(t.prompt_tokens - t.cached_tokens, 0) for t in ts)

    return {
        "prompt_tokens": sum(t.prompt_tokens for t in first + resumed),
        "computed": computed(first) + computed(resumed),
        "reused": sum(t.cached_tokens for t in first + resumed),
        "computed_first": computed(first),
        "reused_first": sum(t.cached_tokens for t in first),
        "computed_resumed": computed(resumed),
        "reused_resumed": sum(t.cached_tokens for t in resumed),
    }


def chunk_note(report: dict[str, Any]) -> str | None:
    """A warning when streamed chunks carried more than one token on average (5% slack):
    the ITL column then times chunks, and comparing it with a server that streams one token
    per chunk is not like with like."""
    per = report.get("tokens_per_chunk")
    if per is None or not per > 1.05:
        return None
    tpot = report["tpot_s"].get("p50")
    tpot_ms = f"{tpot * 1e3:,.0f} ms" if tpot is not None else "n/a"
    return (
        f"{report['label']}: {report['completion_tokens']:,} tokens came in "
        f"{report['content_chunks']:,} content chunks ({per:.2f} a chunk): ITL times chunks, "
        f"not tokens (TPOT p50 {tpot_ms} is per token; a model whose ids all decode to text "
        "alone streams one token a chunk: bench/write_random_model.py --text-ids-only)"
    )


def steps_note(report: dict[str, Any]) -> str | None:
    """One line on the server's steps over the measured part (ds4pool's metrics; None for
    other servers): where a gap or a resumed turn's wait went."""
    st = report.get("server_steps")
    if not st or not st["steps"]:
        return None

    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    busy = st["steps"] * (st["step_ms"] or 0.0) / 1e3
    threads = report.get("server_cpu_threads")
    on = f" on {threads} CPU thread{'s' * (threads != 1)}" if threads else ""
    return (
        f"{report['label']}: {st['steps']:,} steps{on} of {num(st['step_ms'], '.1f')} ms "
        f"({num(st['host_ms'], '.1f')} ms host; {busy:.1f} s in all, the run's wall "
        f"{report['wall_s']:.1f} s), {num(st['rows'], '.1f')} sequences and "
        f"{num(st['tokens'], ',.0f')} tokens a step; {st['capped_steps']:,} steps ran decoders "
        f"under a prompt work cap (mean {num(st['cap'], ',.0f')}); {st['admitted']:,} "
        f"requests admitted after {num(st['queue_wait_ms'], ',.0f')} ms in the queue on average, "
        f"their first token {num(st.get('ttft_ms'), ',.0f')} ms after arrival (the client's "
        f"mean TTFT: {num(_mean_ttft_ms(report), ',.0f')} ms)"
    )


def prompts_ahead(turns: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """(prompts ahead, TTFT) of each resumed turn: how many other requests had been sent and
    had no first token yet when it was sent. A resumed turn's TTFT is its own prompt's work
    plus that queue, and the queue depends on how the agents' turns line up, which the
    server's own pace shapes (agents whose first turns end together stay in step)."""
    timed = [t for t in turns if t.get("ttft") is not None]
    return [
        (sum(1 for u in timed if u is not t and u["start"] <= t["start"] < u["start"] + u["ttft"]),
         t["ttft"])
        for t in timed
        if t["turn"] > 0
    ]  # fmt: skip


WAVE = 8  # resumed turns: a busy period this large is a wave of agents in step


T = TypeVar("T")


def busy_periods(
    items: Iterable[T], start: Callable[[T], float], end: Callable[[T], float]
) -> list[list[T]]:
    """Items in busy periods, by start: one that starts before the end of any earlier one in
    its period joins it (chained). The client's resumed turns (send → first token) here, the
    server's requests (arrival → first token) in bench/trace_report.py."""
    periods: list[list[T]] = []
    last = float("-inf")
    for item in sorted(items, key=start):
        if start(item) > last:
            periods.append([])
        periods[-1].append(item)
        last = max(last, end(item))
    return periods


def resumed_waves(turns: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The resumed turns in busy periods of send → first token. Agents whose turns end
    together arrive as a few large periods; agents spread out as many of one or two."""
    return busy_periods(
        (t for t in turns if t.get("ttft") is not None and t["turn"] > 0),
        lambda t: t["start"],
        lambda t: t["start"] + t["ttft"],
    )


def waves_note(report: dict[str, Any]) -> str | None:
    """One line: how many resumed turns came in waves of WAVE or more and how close
    together their prompts were sent (bench/trace_report.py splits the server's side)."""
    waves = resumed_waves(report.get("turns") or [])
    if not waves:
        return None
    big = [w for w in waves if len(w) >= WAVE]
    n = sum(map(len, waves))
    line = (
        f"{report['label']}: {n} resumed turns in {len(waves)} busy periods (the largest "
        f"{max(map(len, waves))}); {sum(map(len, big))} in {len(big)} waves of {WAVE}+"
    )
    if big:
        spread = stats([w[-1]["start"] - w[0]["start"] for w in big])["p50"]
        line += f", each sent within {spread * 1e3:,.0f} ms (p50)"
    return line


def ahead_note(report: dict[str, Any]) -> str | None:
    """One line: resumed turns' TTFT where at most one other prompt was ahead of them vs
    where more were: like for like across servers whose runs line the agents up differently."""
    pairs = prompts_ahead(report.get("turns") or [])
    if not pairs:
        return None

    def p50_ms(xs: list[float]) -> str:
        return f"{stats(xs)['p50'] * 1e3:,.0f} ms" if xs else "n/a"

    alone = [ttft for k, ttft in pairs if k <= 1]
    queued = [ttft for k, ttft in pairs if k > 1]
    ahead = stats([float(k) for k, _ in pairs])["p50"]
    return (
        f"{report['label']}: resumed turns found {ahead:.0f} other prompts (p50) without a "
        f"first token when sent; TTFT p50 {p50_ms(alone)} for the {len(alone)} with at most "
        f"one ahead, {p50_ms(queued)} for the {len(queued)} with more"
    )


def client_note(report: dict[str, Any]) -> str | None:
    """A warning when the client's processes were busy more than half the measured run (on
    average: agents are dealt evenly)."""
    cpu, wall = report.get("client_cpu_s"), report.get("wall_s")
    procs = report.get("client_procs") or 1
    if cpu is None or not wall or cpu / (wall * procs) <= 0.5:
        return None
    each = f" each of {procs} client processes" if procs > 1 else " the client"
    return (
        f"{report['label']}:{each} was busy {cpu / (wall * procs):.0%} of the run ({cpu:.1f} "
        f"s of CPU in {wall:.1f} s): its own delays are part of the TTFT and ITL it measured "
        "(more --client-procs, or a faster core)"
    )


def report_notes(report: dict[str, Any]) -> list[str]:
    """Every note on a report (chunks, server steps, prompts ahead, waves, the client's load) that
    applies, in that order: `bench agents` and bench/agents_compare.py print the same ones."""
    notes = (
        chunk_note(report),
        steps_note(report),
        ahead_note(report),
        waves_note(report),
        client_note(report),
    )
    return [n for n in notes if n is not None]


def _mean_ttft_ms(report: dict[str, Any]) -> float | None:
    """The client's mean TTFT over all measured turns, first and resumed."""
    parts = [report[k] for k in ("ttft_first_s", "ttft_resumed_s") if report[k].get("n")]
    n = sum(p["n"] for p in parts)
    return sum(p["mean"] * p["n"] for p in parts) / n * 1e3 if n else None


def ms_pair(s: dict[str, Any]) -> str:
    if not s or s.get("p50") is None:
        return "n/a"
    return f"{s['p50'] * 1e3:,.0f} / {s['p95'] * 1e3:,.0f}"


def moves_cell(moves: dict[str, int] | None) -> str:
    if moves is None:
        return "n/a"
    return ", ".join(f"{k} {v}" for k, v in moves.items()) or "none"


TABLE_HEADER = (
    "| run | agents | turns ok | errors | TTFT first p50 / p95 (ms) "
    "| TTFT resumed p50 / p95 (ms) | ITL p50 / p95 (ms) | gen tok/s "
    "| prefill computed / reused (tokens) | session moves | restore decisions |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


def table_row(r: dict[str, Any]) -> str:
    p = r["prefill"]
    return (
        f"| {r['label']} | {r['workload']['agents']} | {r['turns_ok']}/{r['turns_planned']} "
        f"| {r['errors'] + r['turns_skipped']} | {ms_pair(r['ttft_first_s'])} "
        f"| {ms_pair(r['ttft_resumed_s'])} | {ms_pair(r['itl_s'])} | {r['gen_tok_s']:.1f} "
        f"| {p['computed']:,} / {p['reused']:,} | {moves_cell(r['session_moves'])} "
        f"| {moves_cell(r.get('restore_decisions'))} |"
    )


def markdown_table(reports: Sequence[dict[str, Any]]) -> str:
    return "\n".join([TABLE_HEADER, *(table_row(r) for r in reports)])


def plot_report(report: dict[str, Any], path: Path) -> bool:
    """TTFT per turn index, first turns vs resumed ones; False (and a message) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    turns = [t for t in report["turns"] if t["ttft"] is not None]
    rng = random.Random(0)
    for name, sel, color in (("first turn", 0, "tab:red"), ("resumed", 1, "tab:blue")):
        pts = [t for t in turns if (t["turn"] > 0) == bool(sel)]
        ax.scatter(
            [t["turn"] + 1 + rng.uniform(-0.15, 0.15) for t in pts],
            [t["ttft"] * 1e3 for t in pts],
            s=12,
            alpha=0.6,
            color=color,
            label=name,
        )
    med = [
        (int(k) + 1, v["p50"] * 1e3)
        for k, v in report["ttft_by_turn_s"].items()
        if v["p50"] is not None
    ]
    if med:
        ax.plot(*zip(*med), color="black", linewidth=1, label="median")
    ax.set_yscale("log")
    ax.set_xticks(range(1, report["workload"]["turns"] + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{report['label']}: {report['workload']['agents']} agents")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ command line


def add_agents_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--agents", type=int, default=4, help="concurrent agents (sessions)")
    p.add_argument("--turns", type=int, default=4, help="turns per agent")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt size")
    p.add_argument("--user-tokens", type=int, default=200, help="tool result size per turn")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument(
        "--think-s",
        type=float,
        nargs=2,
        default=[0.5, 2.0],
        metavar=("MIN", "MAX"),
        help="pause between an agent's turns (uniform)",
    )
    p.add_argument("--seed", type=int, default=0, help="texts, pauses and session ids")
    p.add_argument("--model", default=None, help="model field (default: first of /v1/models)")
    p.add_argument(
        "--no-session-header",
        dest="session_header",
        action="store_false",
        help=f"do not send {SESSION_HEADER} (servers without sessions)",
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (servers that reject unknown fields)",
    )
    p.add_argument("--extra-body", default="{}", help="JSON object merged into every request")
    p.add_argument(
        "--tokens-per-word",
        type=float,
        default=TOKENS_PER_WORD,
        help="tokens per synthetic word (sizes the texts)",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per-request timeout")
    p.add_argument(
        "--warmup-requests",
        dest="warmup",
        type=int,
        default=None,
        metavar="K",
        help="unmeasured concurrent first turns of the workload's size, with texts of their "
        "own, sent before the clock starts (default: min(agents, 4); 0: none)",
    )
    p.add_argument(
        "--no-warmup", dest="warmup", action="store_const", const=0, help="--warmup-requests 0"
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        metavar="P",
        help="client processes the agents are dealt to (each its own core): for token rates "
        "one process cannot parse without delaying what it measures",
    )
    p.add_argument("--out", type=Path, default=None, help="write <label>.json and <label>.png")
    p.add_argument("--label", default=None, help="run name (default: agents-<N>)")


def workload_from(args: argparse.Namespace, model: str) -> Workload:
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise Ds4poolError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise Ds4poolError("--extra-body must be a JSON object")
    lo, hi = args.think_s
    if args.agents < 1 or args.turns < 1 or args.gen_tokens < 1:
        raise Ds4poolError("--agents, --turns and --gen-tokens must be at least 1")
    if args.system_tokens < 1 or args.user_tokens < 1 or args.tokens_per_word <= 0:
        raise Ds4poolError("--system-tokens, --user-tokens, --tokens-per-word must be > 0")
    if lo < 0 or hi < lo:
        raise Ds4poolError("--think-s needs 0 <= MIN <= MAX")
    if args.warmup is not None and args.warmup < 0:
        raise Ds4poolError("--warmup-requests must be >= 0")
    return Workload(
        agents=args.agents,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        gen_tokens=args.gen_tokens,
        think_min=lo,
        think_max=hi,
        seed=args.seed,
        model=model,
        session_header=args.session_header,
        ignore_eos=args.ignore_eos,
        extra_body=extra,
        tokens_per_word=args.tokens_per_word,
    )


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": cpu_name(),
        "topology": cpu_topology(),  # physical cores vs logical CPUs (hardware threads)
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in load],
    }


def run_agents(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        msg = "ds4pool bench agents needs httpx: pip install httpx"
        raise Ds4poolError(msg) from None
    if args.client_procs < 1:
        raise Ds4poolError("--client-procs must be >= 1")
    url = args.url.rstrip("/")
    model = args.model or discover_model(url, args.api_key)
    w = workload_from(args, model)
    label = args.label or f"agents-{w.agents}"
    machine_before = _machine()
    before: list[str | None] = []  # the server's metrics once the warm-up is over

    async def measured() -> None:
        before.append(await asyncio.to_thread(scrape_metrics, url, args.api_key))

    warmup = min(w.agents, 4) if args.warmup is None else args.warmup
    run = asyncio.run(
        run_workload(
            url,
            w,
            args.api_key,
            args.timeout_s,
            warmup,
            sys.stderr.isatty(),
            measured,
            args.client_procs,
        )
    )
    turns, wall = run.turns, run.wall
    after = scrape_metrics(url, args.api_key)
    start, end = counters(before[0]), counters(after)
    report: dict[str, Any] = {
        "label": label,
        "url": url,
        "date": datetime.now(timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
        "machine_before": machine_before,
        "machine_after": _machine(),
        "workload": asdict(w),
        "warmup_requests": warmup,
        **summarize(turns, wall, w),
        "client_cpu_s": run.cpu,
        "client_procs": args.client_procs,
        **{k: moves_delta(start[k], end[k]) for k in COUNTERS},
        "server_steps": server_steps(histogram_totals(before[0]), histogram_totals(after)),
        "server_cpu_threads": scraped_cpu_threads(after),
        "turns": [asdict(t) for t in sorted(turns, key=lambda t: (t.agent, t.turn))],
    }
    print(markdown_table([report]))
    for note in report_notes(report):
        print(note, file=sys.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{label}.json").write_text(json.dumps(report, indent=1) + "\n")
        if plot_report(report, args.out / f"{label}.png"):
            print(
                f"wrote {args.out / f'{label}.json'} and {args.out / f'{label}.png'}",
                file=sys.stderr,
            )
    failed = report["errors"] + report["turns_skipped"]
    if failed:
        print(f"{failed} turns failed or were skipped: {report['error_samples']}", file=sys.stderr)
    return 1 if failed else 0
