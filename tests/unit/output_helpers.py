"""Feeding model text to an output processor in chunks and reading back what a client sees."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

from ds4pool.model.tokenizer import IncrementalDecoder, Tokenizer
from ds4pool.output.deltas import (
    Delta,
    Finish,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from ds4pool.output.message import OutputMessage, assemble
from ds4pool.output.processor import OutputProcessor
from ds4pool.output.tools import PARSERS, Calls

TOOLS = ("get_weather", "read_file", "write_file")
# the schema types of the tools' parameters (formats with untyped values need them)
PARAM_TYPES = {
    "get_weather": {
        "city": "string",
        "days": "integer",
        "units": "null",
        "tags": "array",
        "deep": "object",
    },
    "write_file": {"path": "string", "content": "string"},
}


def tool_processor(fmt: str, names: Iterable[str] = TOOLS) -> OutputProcessor:
    return OutputProcessor(tools=PARSERS[fmt](Calls(frozenset(names), param_types=PARAM_TYPES)))


def feed_chunks(proc: OutputProcessor, chunks: Iterable[str], reason: str = "stop") -> list[Delta]:
    out: list[Delta] = []
    for chunk in chunks:
        out += proc.feed(chunk)
    return out + proc.finish(reason)


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def token_chunks(tok: Tokenizer, text: str) -> list[str]:
    """`text` as the scheduler streams it: encoded, then decoded id by id."""
    decoder = IncrementalDecoder(tok)
    ids = tok.encode(text, add_special_tokens=False)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def check_contract(deltas: list[Delta]) -> OutputMessage:
    """The ordering guarantees of ds4pool.output.deltas; returns the assembled message."""
    assert isinstance(deltas[-1], Finish)
    assert sum(isinstance(d, Finish) for d in deltas) == 1
    started: dict[int, str] = {}
    args: dict[int, str] = {}
    ended: set[int] = set()
    for d in deltas:
        if isinstance(d, ToolCallStart):
            assert d.index == len(started) and d.id not in started.values()
            started[d.index] = d.id
            args[d.index] = ""
        elif isinstance(d, ToolCallArgs):
            assert d.index in started and d.index not in ended
            args[d.index] += d.text
        elif isinstance(d, ToolCallEnd):
            assert d.index in started and d.index not in ended
            assert args[d.index] == d.arguments
            assert isinstance(json.loads(d.arguments), dict)
            ended.add(d.index)
    assert ended == set(started)
    return assemble(deltas)


def calls_of(msg: OutputMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))
