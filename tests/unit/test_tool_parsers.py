"""Each tool-call format, fed as text in many chunkings: calls, arguments, malformed output."""

from __future__ import annotations

import json

import pytest

from ds4pool.output.deltas import TextDelta, ToolCallArgs, ToolCallStart
from tests.unit.output_helpers import (
    calls_of,
    check_contract,
    feed_chunks,
    random_chunks,
    text_of,
    tool_processor,
)

PARIS = {"city": "Paris", "days": 3, "units": None, "tags": ["a", "b"], "deep": {"x": 1.5}}
CODE = {"path": "a.py", "content": 'def f():\n    return {"k": [1, 2]}  # ünï 😀\n'}


def hermes(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def deepseek(*calls: tuple[str, dict]) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```"
        "<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def qwen3_coder(name: str, args: dict) -> str:
    """As Qwen3-Coder's template writes a call (strings raw, other values as JSON)."""
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


CASES = {
    "hermes": (
        "Let me check.\n\n" + hermes("get_weather", PARIS) + "\n" + hermes("write_file", CODE),
        "Let me check.\n\n",
    ),
    "llama3_json": (
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": PARIS})
        + "; "
        + json.dumps({"name": "write_file", "parameters": CODE}),
        "",
    ),
    "mistral": (
        "[TOOL_CALLS]"
        + json.dumps(
            [{"name": "get_weather", "arguments": PARIS}, {"name": "write_file", "arguments": CODE}]
        ),
        "",
    ),
    "deepseek_v3": (
        "I'll look." + deepseek(("get_weather", PARIS), ("write_file", CODE)),
        "I'll look.",
    ),
    "qwen3_coder": (
        "Sure:\n" + qwen3_coder("get_weather", PARIS) + "\n" + qwen3_coder("write_file", CODE),
        "Sure:\n",
    ),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("seed", range(12))
def test_two_calls_in_any_chunking(fmt: str, seed: int) -> None:
    text, before = CASES[fmt]
    chunks = [text] if seed == 0 else random_chunks(text, seed)
    deltas = feed_chunks(tool_processor(fmt), chunks)
    msg = check_contract(deltas)
    assert calls_of(msg) == [("get_weather", PARIS), ("write_file", CODE)]
    assert msg.text == before
    assert msg.finish is not None and msg.finish.reason == "tool_calls"
    assert len({c.id for c in msg.tool_calls}) == 2


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_character_by_character_streams_arguments_as_they_grow(fmt: str) -> None:
    text, _ = CASES[fmt]
    deltas = feed_chunks(tool_processor(fmt), list(text))
    check_contract(deltas)
    pieces = [d.text for d in deltas if isinstance(d, ToolCallArgs) and d.index == 1]
    # the file content streams in many pieces, not in one chunk at the end
    assert len(pieces) > 10
    assert "".join(pieces) == json.dumps(CODE, ensure_ascii=False)


def test_mistral_v11_named_calls() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]read_file[ARGS]{"path": "x"}'
    for seed in range(8):
        msg = check_contract(feed_chunks(tool_processor("mistral"), random_chunks(text, seed)))
        assert calls_of(msg) == [("get_weather", {"city": "Paris"}), ("read_file", {"path": "x"})]


def test_deepseek_v31_calls_without_a_fence() -> None:
    text = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    msg = check_contract(feed_chunks(tool_processor("deepseek_v3"), list(text)))
    assert calls_of(msg) == [("get_weather", {"city": "Oslo"})]


MALFORMED = {
    "qwen3_coder": [
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
        '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>',
        "<tool_call> is how I call tools",
    ],
    "hermes": [
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not offered
        "<tool_call>not json at all</tool_call> and more",
        '<tool_call>\n{"name": "get_wea',  # cut before the name is complete
    ],
    "llama3_json": [
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": 5, "parameters": {}}',
        "{not json}",
        "The answer is {x}",
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
        "[TOOL_CALLS] is a marker",
        "[TOOL_CALLS][oops",
    ],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>rm_rf\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜>garbage",
    ],
}


def test_qwen3_coder_values_typed_by_the_schema() -> None:
    args = {"city": "42", "days": "3", "tags": "not json", "units": "True"}
    msg = check_contract(
        feed_chunks(tool_processor("qwen3_coder"), list(qwen3_coder("get_weather", args)))
    )
    # city is a string even if it looks like a number; tags is not JSON: kept as text;
    # Python's True (what the template prints for a bool) is true
    expected = {"city": "42", "days": 3, "tags": "not json", "units": True}
    assert calls_of(msg) == [("get_weather", expected)]
    text = qwen3_coder("read_file", {"path": "a", "n": "7"})  # no schema: values are text
    msg = check_contract(feed_chunks(tool_processor("qwen3_coder"), [text]))
    assert calls_of(msg) == [("read_file", {"path": "a", "n": "7"})]


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_stay_text(fmt: str, text: str) -> None:
    for chunks in ([text], list(text), random_chunks(text, 3)):
        deltas = feed_chunks(tool_processor(fmt), chunks)
        msg = check_contract(deltas)
        assert msg.tool_calls == []
        assert text_of(deltas) == text
        assert msg.finish is not None and msg.finish.reason == "stop"


def test_json_broken_after_a_valid_name() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": }\n</tool_call>'
    )
    # seen whole (a non-streaming response) it is no call: text
    deltas = feed_chunks(tool_processor("hermes"), [text])
    assert check_contract(deltas).tool_calls == [] and text_of(deltas) == text
    # streamed, the call was announced once its name was complete: it ends with what had
    # parsed before the JSON broke (re-parsing is throttled, so maybe not the last letter)
    msg = check_contract(feed_chunks(tool_processor("hermes"), list(text)))
    [(name, args)] = calls_of(msg)
    assert name == "get_weather" and list(args) == ["city"] and "Oslo".startswith(args["city"])


def test_unknown_name_is_given_back_as_soon_as_it_is_complete() -> None:
    proc = tool_processor("hermes")
    out = proc.feed('<tool_call>\n{"name": "rm_rf", ')
    assert text_of(out) == '<tool_call>\n{"name": "rm_rf", '


def test_text_is_held_only_while_it_may_start_a_marker() -> None:
    proc = tool_processor("hermes")
    assert proc.feed("Hello <tool_") == [TextDelta("Hello ")]
    assert proc.feed("kit") == [TextDelta("<tool_kit")]
    assert proc.feed(" <") == [TextDelta(" ")]
    out = proc.feed('tool_call>{"name": "read_file"')
    assert out[0] == TextDelta("") or isinstance(out[0], ToolCallStart)
    assert [d for d in out if isinstance(d, ToolCallStart)][0].name == "read_file"


def test_text_between_calls_and_blank_space_after_them() -> None:
    text = (
        hermes("read_file", {"path": "a"})
        + "\n\nthen\n"
        + hermes("read_file", {"path": "b"})
        + "\n\n"
    )
    msg = check_contract(feed_chunks(tool_processor("hermes"), list(text)))
    assert [p.kind for p in msg.parts] == ["tool_call", "text", "tool_call"]
    assert msg.text == "\n\nthen\n"


def test_a_call_cut_by_max_tokens_is_closed_with_what_was_written() -> None:
    text = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": "x = 1'
    deltas = feed_chunks(tool_processor("hermes"), list(text), reason="length")
    msg = check_contract(deltas)
    assert calls_of(msg) == [("write_file", {"path": "a.py", "content": "x = 1"})]
    assert msg.finish is not None and msg.finish.reason == "length"


def test_arguments_written_as_a_json_string() -> None:
    text = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a\\"}"}</tool_call>'
    msg = check_contract(feed_chunks(tool_processor("hermes"), [text]))
    assert calls_of(msg) == [("read_file", {"path": "a"})]


FRAGMENTS = [
    "<function=get_weather>",
    "<parameter=days>",
    "<parameter=city>",
    "</parameter>",
    "</function>",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "function",
    "\n```json\n",
    "```",
    '{"name": "read_file", "arguments": {"path": "a"}}',
    '{"name": "read_file", "parameters": {',
    '[{"name": "get_weather", "arguments": {"city": "X"}}',
    '"name"',
    '"read_file"',
    ": ",
    ", ",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    "\\u00",
    "1.5e",
    "true",
    "nul",
    ";",
    "\n",
    "get_weather",
    "text ",
    "😀",
    "<",
    "\ud83d",
]


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_garbage_never_breaks_the_contract(fmt: str) -> None:
    """Whatever the model writes: no exception, the delta guarantees hold, arguments are
    JSON objects, and text that is no call comes back as text."""
    import random

    rng = random.Random(fmt)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        for chunks in ([text], list(text), random_chunks(text, rng.randint(0, 99))):
            deltas = feed_chunks(tool_processor(fmt), chunks, rng.choice(["stop", "length"]))
            msg = check_contract(deltas)
            if not msg.tool_calls:
                assert text_of(deltas) == text


def test_a_long_call_is_reparsed_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop runs the parsers: a 30 kB file written into a call, 4 chars a chunk,
    must not re-parse the growing body on every chunk (quadratic work)."""
    import partial_json_parser

    calls = {"n": 0, "chars": 0}
    real_fix = partial_json_parser.fix

    def counting_fix(text: str, *args: object) -> tuple[str, str]:
        calls["n"] += 1
        calls["chars"] += len(text)
        return real_fix(text, *args)

    monkeypatch.setattr(partial_json_parser, "fix", counting_fix)
    content = 'def f(x):\n    return {"k": [x, "y"]}\n' * 700
    text = hermes("write_file", {"path": "a.py", "content": content})
    deltas = feed_chunks(
        tool_processor("hermes"), [text[i : i + 4] for i in range(0, len(text), 4)]
    )
    assert calls_of(check_contract(deltas)) == [
        ("write_file", {"path": "a.py", "content": content})
    ]
    assert len([d for d in deltas if isinstance(d, ToolCallArgs)]) > 50  # still streamed
    assert calls["n"] < 200 and calls["chars"] < 40 * len(text)


def test_arguments_that_are_a_string_but_not_json_are_no_call() -> None:
    text = '<tool_call>{"name": "read_file", "arguments": "path=a"}</tool_call>'
    deltas = feed_chunks(tool_processor("hermes"), [text])
    assert check_contract(deltas).tool_calls == [] and text_of(deltas) == text
