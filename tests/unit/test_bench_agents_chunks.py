"""`ds4pool bench agents`' summary: ITL is timed between streamed chunks, and a chunk may
carry several tokens (a server holding an incomplete UTF-8 character back): the report
counts chunks per token and warns when ITL is not per token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ds4pool.bench.agents import (
    TurnResult,
    Workload,
    ahead_note,
    chunk_note,
    client_note,
    prompts_ahead,
    resumed_waves,
    sse_data,
    summarize,
    waves_note,
)

W = Workload(
    agents=2, turns=1, system_tokens=10, user_tokens=5, gen_tokens=8,
    think_min=0, think_max=0, seed=0, model="m",
)  # fmt: skip


def _turn(agent: int, tokens: int, chunks: int, gap: float) -> TurnResult:
    # `chunks` chunks `gap` apart carry `tokens` tokens: e2e - ttft spans the chunks
    return TurnResult(
        agent=agent, turn=0, start=0.0, ttft=0.1, e2e=0.1 + gap * (chunks - 1),
        gaps=[gap] * (chunks - 1), completion_tokens=tokens, usage_reported=True,
    )  # fmt: skip


def test_one_token_a_chunk_is_per_token_itl() -> None:
    r = summarize([_turn(0, 8, 8, 0.02), _turn(1, 8, 8, 0.02)], 1.0, W)
    assert r["content_chunks"] == 16 and r["tokens_per_chunk"] == 1.0
    assert chunk_note({**r, "label": "x"}) is None
    assert abs(r["itl_s"]["p50"] - r["tpot_s"]["p50"]) < 1e-9


def test_two_tokens_a_chunk_is_flagged_and_tpot_stays_per_token() -> None:
    # the same 8 tokens a turn, 0.02 s apart, streamed in 4 chunks of 2: gaps of 0.04 s
    r = summarize([_turn(0, 8, 4, 0.04), _turn(1, 8, 4, 0.04)], 1.0, W)
    assert r["content_chunks"] == 8 and r["tokens_per_chunk"] == 2.0
    assert abs(r["itl_s"]["p50"] - 0.04) < 1e-9  # per chunk: twice the token gap
    assert abs(r["tpot_s"]["p50"] - 0.12 / 7) < 1e-9  # (e2e - ttft) / (tokens - 1)
    note = chunk_note({**r, "label": "srv"})
    assert note is not None and note.startswith("srv: 16 tokens came in 8 content chunks")
    assert "2.00 a chunk" in note


def test_a_few_held_characters_stay_within_the_slack() -> None:
    r = summarize([_turn(0, 21, 20, 0.02)], 1.0, W)  # 1.05 tokens a chunk
    assert chunk_note({**r, "label": "x"}) is None
    r = summarize([_turn(0, 22, 20, 0.02)], 1.0, W)  # 1.10
    assert chunk_note({**r, "label": "x"}) is not None


def _t(agent: int, turn: int, start: float, ttft: float | None) -> dict:
    return {"agent": agent, "turn": turn, "start": start, "ttft": ttft}


def test_resumed_turns_are_split_by_the_prompts_ahead_of_them() -> None:
    # agent 0's second turn is sent while agents 1 and 2 still wait for a first token (2
    # ahead); agent 1's second turn while only agent 3 does (1 ahead); agent 2's when none
    # does; agent 3's second turn failed (no TTFT): it is left out
    turns = [
        _t(0, 0, 0.0, 0.5), _t(1, 0, 0.9, 0.3), _t(2, 0, 0.95, 0.4), _t(3, 0, 1.6, 0.5),
        _t(0, 1, 1.0, 0.65), _t(1, 1, 1.7, 0.1), _t(2, 1, 3.0, 0.05), _t(3, 1, 3.1, None),
    ]  # fmt: skip
    pairs = sorted(prompts_ahead(turns))
    assert pairs == [(0, 0.05), (1, 0.1), (2, 0.65)]
    note = ahead_note({"label": "srv", "turns": turns})
    assert note is not None and note.startswith("srv: resumed turns found 1 other prompts (p50)")
    assert "TTFT p50 75 ms for the 2 with at most one ahead, 650 ms for the 1 with more" in note
    assert ahead_note({"label": "srv", "turns": turns[:4]}) is None  # no resumed turn


def test_resumed_turns_in_waves() -> None:
    # eight agents' second turns sent 10 ms apart, each waiting 200 ms: one wave (each sent
    # before the previous one's first token); a ninth sent after the wave's last first token
    # is a period of its own; first turns and a turn without a TTFT do not count
    turns = [_t(i, 1, 1.0 + i * 0.01, 0.2) for i in range(8)]
    turns += [_t(8, 1, 1.5, 0.05), _t(9, 0, 1.0, 0.3), _t(10, 1, 1.2, None)]
    waves = resumed_waves(turns)
    assert [len(w) for w in waves] == [8, 1]
    note = waves_note({"label": "srv", "turns": turns})
    assert note == (
        "srv: 9 resumed turns in 2 busy periods (the largest 8); 8 in 1 waves of 8+, "
        "each sent within 70 ms (p50)"
    )
    assert waves_note({"label": "srv", "turns": turns[-2:]}) is None  # nothing resumed, timed


def test_sse_payloads_across_reads() -> None:
    """The bench's SSE reader: events split at any byte, CRLF lines, comments and other
    fields skipped, a multi-line payload joined, an unfinished last event dropped (SSE spec)."""
    stream = (
        b": keep-alive\r\n\r\n"
        b'data: {"a": 1}\r\n\r\n'
        b"event: x\ndata: line one\ndata: line two\n\n"
        b"data: [DONE]\n\n"
        b"data: tail"
    )

    async def collect(size: int) -> list[bytes]:
        async def raw() -> AsyncIterator[bytes]:
            for i in range(0, len(stream), size):
                yield stream[i : i + size]

        return [e async for e in sse_data(raw())]

    want = [b'{"a": 1}', b"line one\nline two", b"[DONE]"]
    for size in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(size)) == want, size


def test_a_busy_client_is_flagged_per_process() -> None:
    base = {"label": "srv", "wall_s": 10.0}
    assert client_note({**base, "client_cpu_s": 4.0}) is None  # 40% of one core
    note = client_note({**base, "client_cpu_s": 7.5})
    assert note is not None and note.startswith("srv: the client was busy 75% of the run")
    # four processes sharing 7.5 s of CPU: under half of each one's core
    assert client_note({**base, "client_cpu_s": 7.5, "client_procs": 4}) is None
    note = client_note({**base, "client_cpu_s": 30.0, "client_procs": 4})
    assert note is not None and "each of 4 client processes was busy 75%" in note
    assert client_note({"label": "old", "wall_s": 10.0}) is None  # reports before the field
