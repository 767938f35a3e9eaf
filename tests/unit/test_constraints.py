"""Constraint specs compiled by xgrammar against real vocabularies: what they let through."""

from __future__ import annotations

from typing import Any

import pytest

from ds4pool.model.grammar import GrammarCache, GrammarError, GrammarSpec
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.constraints import (
    ConstraintError,
    after_open_reasoning,
    json_schema_spec,
    parse_tools,
    reasoning_open,
)
from ds4pool.output.detect import detect_tool_format
from ds4pool.output.tool_grammar import at_most_one_call_spec, tool_call_spec
from tests.real_tokenizers import real_tokenizer_dir

xgr = pytest.importorskip("xgrammar")

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
)
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
EXPECTED = {  # one call of get_weather, as each model's template writes it
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "deepseek_v3": DS
    + 'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
}
TOKENIZER = {
    "hermes": "qwen3",
    "llama3_json": "llama3_1",
    "mistral": "qwen3",
    "qwen3_coder": "qwen3",
}
TOKENIZER["deepseek_v3"] = "deepseek_v3"

_cache: dict[str, tuple[Tokenizer, GrammarCache]] = {}


def grammars(name: str) -> tuple[Tokenizer, GrammarCache]:
    if name not in _cache:
        tok = Tokenizer.from_dir(real_tokenizer_dir(name))
        _cache[name] = (tok, GrammarCache(tok, tok.vocab_size + 64))  # padded model vocab
    return _cache[name]


def matches(cache: GrammarCache, tok: Tokenizer, spec: GrammarSpec, text: str) -> bool:
    """Does the grammar accept exactly `text` (as the tokenizer encodes it) and then eos?"""
    m = xgr.GrammarMatcher(cache.compile(spec).compiled)
    ids = tok.encode(text, add_special_tokens=False)
    return all(m.accept_token(i) for i in ids) and m.accept_token(tok.eos_token_ids[0])


def test_detects_the_format_of_real_templates() -> None:
    qwen, ds = grammars("qwen3")[0], grammars("deepseek_v3")[0]
    assert detect_tool_format(qwen.chat_template_text(), ()) == "hermes"
    assert detect_tool_format(ds.chat_template_text(), ()) == "deepseek_v3"
    assert detect_tool_format("{{ messages }}", ()) == "none"


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_forced_tool_call_matches_the_model_format(fmt: str) -> None:
    tok, cache = grammars(TOKENIZER[fmt])
    is_token = lambda s: tok.token_to_id(s) is not None  # noqa: E731
    spec = tool_call_spec(fmt, TOOLS, is_token)
    assert matches(cache, tok, spec, EXPECTED[fmt])
    wrong_name = EXPECTED[fmt].replace("get_weather", "get_weathr")
    assert not matches(cache, tok, spec, wrong_name)
    missing_arg = (
        EXPECTED[fmt]
        .replace('"city": "Paris"', "")
        .replace("<parameter=city>\nParis\n</parameter>\n", "")
    )
    assert not matches(cache, tok, spec, missing_arg)
    only_now = tool_call_spec(fmt, TOOLS, is_token, name="now")
    assert not matches(cache, tok, only_now, EXPECTED[fmt])


def test_parallel_calls_and_parallel_false() -> None:
    tok, cache = grammars("qwen3")
    is_token = lambda s: tok.token_to_id(s) is not None  # noqa: E731
    two = EXPECTED["hermes"] + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert matches(cache, tok, tool_call_spec("hermes", TOOLS, is_token), two)
    single = tool_call_spec("hermes", TOOLS, is_token, parallel=False)
    assert matches(cache, tok, single, EXPECTED["hermes"])
    assert not matches(cache, tok, single, two)
    assert not matches(cache, tok, single, "Sure! " + EXPECTED["hermes"])


def test_json_schema_whitespace_is_fixed() -> None:
    tok, cache = grammars("qwen3")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = json_schema_spec(schema, "response_format.json_schema.schema")
    assert matches(cache, tok, spec, '{"a": 1}')
    assert not matches(cache, tok, spec, '{\n  "a": 1\n}')
    assert not matches(cache, tok, spec, '{"a": 1, "b": 2}')  # strict: no unlisted keys


def test_bad_input_names_the_field() -> None:
    tok, cache = grammars("qwen3")
    with pytest.raises(GrammarError) as exc:
        cache.compile(GrammarSpec("json_schema", '{"type": "no-such-type"}', "response_format"))
    assert exc.value.param == "response_format"
    assert "/project" not in str(exc.value)
    with pytest.raises(ConstraintError) as cexc:
        parse_tools([{"type": "function", "function": {"name": "a b"}}])
    assert cexc.value.param == "tools[0].function.name"
    with pytest.raises(ConstraintError, match="no tool named 'x'"):
        tool_call_spec("hermes", TOOLS, lambda s: False, name="x")
    with pytest.raises(ConstraintError, match="requires tools"):
        tool_call_spec("hermes", [], lambda s: False)
    with pytest.raises(ConstraintError, match="no tool-call format"):
        tool_call_spec(None, TOOLS, lambda s: False)


def test_auto_without_parallel_calls_allows_text_then_one_call() -> None:
    for fmt in ("hermes", "deepseek_v3"):  # a text marker, a special-token marker
        tok, cache = grammars(TOKENIZER[fmt])
        spec = at_most_one_call_spec(fmt, TOOLS, lambda s, t=tok: t.token_to_id(s) is not None)
        call = EXPECTED[fmt]
        assert matches(cache, tok, spec, "Let me check. " + call)
        assert matches(cache, tok, spec, "No tool needed.") and matches(cache, tok, spec, call)
        assert not matches(cache, tok, spec, call + call)
        assert not matches(cache, tok, spec, call + " and more text")
    with pytest.raises(ConstraintError) as exc:
        at_most_one_call_spec("none", TOOLS, lambda s: False)
    assert exc.value.param == "parallel_tool_calls"


def test_length_bounded_strings_stay_valid_json() -> None:
    """maxLength alone would let a raw tab into the string (xgrammar#800): not with ours."""
    tok, cache = grammars("qwen3")
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
    }
    spec = json_schema_spec(schema, "schema")
    assert matches(cache, tok, spec, '{"s": "abcd"}')
    assert not matches(cache, tok, spec, '{"s": "a\tb"}')
    assert not matches(cache, tok, spec, '{"s": "a"}') and not matches(
        cache, tok, spec, '{"s": "abcde"}'
    )
    assert schema["properties"]["s"]["maxLength"] == 4  # the caller's schema is not modified


def test_compile_cache_is_bounded_in_bytes() -> None:
    tok = grammars("qwen3")[0]
    cache = GrammarCache(tok, tok.vocab_size, max_bytes=300_000)  # ~2 small grammars
    specs = [
        json_schema_spec({"type": "object", "properties": {f"k{i}": {}}}, "s") for i in range(4)
    ]
    first = cache.compile(specs[0])
    assert cache.compile(specs[0]) is first  # a hit: not compiled again
    for spec in specs[1:]:
        cache.compile(spec)
    assert cache.compile(specs[0]) is not first  # evicted by the byte bound, compiled again


def test_constraint_starts_after_a_reasoning_block_the_prompt_opened() -> None:
    tok, cache = grammars("qwen3")
    user = [{"role": "user", "content": "hi"}]
    closed = tok.apply_chat_template(user, enable_thinking=False)  # "<think>\n\n</think>\n\n"
    assert not reasoning_open(closed) and reasoning_open(closed + "<think>\n")
    assert not reasoning_open(tok.apply_chat_template(user))  # the model may open one itself
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = after_open_reasoning(json_schema_spec(schema, "schema"))
    assert matches(cache, tok, spec, 'So a is one.</think>\n\n{"a": 1}')
    assert not matches(cache, tok, spec, '{"a": 1}')  # still inside the reasoning block
    assert not matches(cache, tok, spec, "done.</think>\n\nno JSON")
    call = tool_call_spec("hermes", TOOLS, lambda s: tok.token_to_id(s) is not None)
    assert matches(cache, tok, after_open_reasoning(call), "hmm</think>\n\n" + EXPECTED["hermes"])


def test_a_string_never_holds_a_surrogate_written_as_utf8() -> None:
    # xgrammar takes ED A0..BF xx (U+D800-DFFF) for one character; decoded it is three U+FFFD,
    # which broke a maxLength: a random model wrote 14 characters under a 12 bound
    from ds4pool.model.grammar import GrammarState

    tok, cache = grammars("qwen3")
    guard = cache.utf8
    vocab = _tokenizer_bytes(tok, cache)
    one = {t: i for i, t in enumerate(vocab) if len(t) == 1}
    spec = json_schema_spec({"type": "string", "maxLength": 4}, "response_format")
    state = GrammarState(cache.compile(spec), cache.vocab_size)

    def allowed(token: int) -> bool:
        mask = state.fill()
        assert mask is not None
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    assert state.accept(tok.encode('"', add_special_tokens=False)[0])
    assert allowed(one[b"\xed"]) and allowed(one[b"\xe2"])
    assert state.accept(one[b"\xed"])
    assert not allowed(one[b"\xa0"]) and not allowed(one[b"\xbf"])  # a surrogate's second byte
    assert allowed(one[b"\x80"]) and allowed(one[b"\x9f"])  # ED 80..9F: U+D000-D7FF, valid
    assert state.accept(one[b"\x80"]) and state.accept(one[b"\x80"])  # U+D000
    assert allowed(one[b"\xa0"]) is False  # a lone continuation byte: xgrammar's own rule
    assert allowed(tok.encode("a", add_special_tokens=False)[0])
    inside = [i for i, t in enumerate(vocab) if guard._INSIDE.search(t)]
    assert all(not allowed(i) for i in inside)


@pytest.mark.parametrize("kind", ["json_schema", "tool_call"])
def test_a_string_never_holds_an_overlong_form_or_a_surrogate(kind: str) -> None:
    # in a string with maxLength xgrammar takes E0 80..9F xx and F0 80..8F xx xx (overlong)
    # for one character, and in any string ED A0..BF xx (a surrogate): the demo model broke
    # a maxLength 12 with three U+FFFD in 6 of 3,900 forced tool calls
    from ds4pool.model.grammar import GrammarState

    tok, cache = grammars("qwen3")
    vocab = _tokenizer_bytes(tok, cache)
    one = {t: i for i, t in enumerate(vocab) if len(t) == 1}
    if kind == "json_schema":
        spec = json_schema_spec({"type": "string", "maxLength": 8}, "response_format")
        opening = '"'
    else:  # a bounded string: xgrammar's rule for it is where the overlong forms got in
        bounded = {"type": "string", "maxLength": 12}
        tools = parse_tools(
            [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": bounded}, "required": ["city"]}}}]
        )  # fmt: skip
        spec = tool_call_spec("hermes", tools, lambda s: tok.token_to_id(s) is not None)
        opening = EXPECTED["hermes"][: EXPECTED["hermes"].index('"city": "') + len('"city": "')]
    bad = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
    good = {0xE0: 0xA0, 0xED: 0x9F, 0xF0: 0x90, 0xF4: 0x8F}
    for lead, (lo, hi) in bad.items():
        state = GrammarState(cache.compile(spec), cache.vocab_size)
        for t in tok.encode(opening, add_special_tokens=False):
            state.fill()
            assert state.accept(t), opening

        assert _allowed(state, one[bytes([lead])])
        assert state.accept(one[bytes([lead])])
        assert not _allowed(state, one[bytes([lo])]), hex(lead)
        assert not _allowed(state, one[bytes([hi])]), hex(lead)
        assert _allowed(state, one[bytes([good[lead]])]), hex(lead)  # valid second bytes stay
        inside = [i for i, t in enumerate(vocab) if cache.utf8._INSIDE.search(t)]
        assert all(not _allowed(state, i) for i in inside)


def _allowed(state: Any, token: int) -> bool:
    mask = state.fill()
    return mask is None or bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _tokenizer_bytes(tok: Tokenizer, cache: GrammarCache) -> list[bytes]:
    from ds4pool.model.grammar import _tokenizer_info

    return list(_tokenizer_info(xgr, tok, cache.vocab_size).decoded_vocab)
