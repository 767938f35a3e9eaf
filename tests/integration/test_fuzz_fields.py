"""Any JSON value in any field of any route's body gets an answer below 500 (issue 14: the class
of bugs behind `chat_template_kwargs: {"self": 1}` and Anthropic tool_result lists of
strings, closed rather than patched one by one).

tests/reliability/test_hostile.py fuzzes with schemathesis, which draws bodies from the OpenAPI
schema: values of the declared types, or wrong at the top. The fields declared as free objects
(`tools`, `tool_choice`, `response_format`, Anthropic content blocks, Responses items) are
where the handlers' own parsing runs, and the schema says nothing about their insides. Here a
valid body per route is the base, and hypothesis puts an arbitrary JSON value at one path
(a top-level field, or one inside those objects), or deletes it.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4pool.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
    ResponsesRequest,
)
from tests.integration.conftest import Server

ADMIN = "fuzz-admin"
Path = tuple[str | int, ...]

TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}
A_TOOL = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
R_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
USER = {"role": "user", "content": "hi"}
CALL = {"name": "f", "arguments": "{}"}
TEXT = [{"type": "input_text", "text": "hi"}]

# route → (a valid body, the paths inside it where values are put)
BASES: dict[str, tuple[dict[str, Any], list[Path]]] = {
    "/v1/chat/completions": (
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c1", "type": "function", "function": CALL}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                USER,
            ],
            "max_tokens": 2,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
            "chat_template_kwargs": {"enable_thinking": False},
            "stream_options": {"include_usage": True},
        },
        [
            ("messages", 1, "content", 0, "type"),
            ("messages", 1, "content", 0, "text"),
            ("messages", 2, "tool_calls", 0),
            ("messages", 2, "tool_calls", 0, "function"),
            ("messages", 2, "tool_calls", 0, "function", "name"),
            ("messages", 2, "tool_calls", 0, "function", "arguments"),
            ("tools", 0),
            ("tools", 0, "type"),
            ("tools", 0, "function"),
            ("tools", 0, "function", "name"),
            ("tools", 0, "function", "parameters"),
            ("tool_choice", "type"),
            ("tool_choice", "function"),
            ("tool_choice", "function", "name"),
            ("response_format", "type"),
            ("response_format", "json_schema"),
            ("response_format", "json_schema", "schema"),
            ("chat_template_kwargs", "enable_thinking"),
            ("stream_options", "include_usage"),
        ],
    ),
    "/v1/completions": ({"prompt": "hello", "max_tokens": 2}, [("response_format", "type")]),
    "/v1/messages": (
        {
            "model": "m",
            "max_tokens": 2,
            "system": [{"type": "text", "text": "s"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "t"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": ["ok"]}],
                },
            ],
            "tools": [A_TOOL],
            "tool_choice": {"type": "tool", "name": "f"},
            "thinking": {"type": "disabled"},
        },
        [
            ("system", 0),
            ("system", 0, "text"),
            ("messages", 0, "content", 0),
            ("messages", 0, "content", 0, "type"),
            ("messages", 0, "content", 0, "text"),
            ("messages", 1, "content", 1, "name"),
            ("messages", 1, "content", 1, "input"),
            ("messages", 1, "content", 1, "id"),
            ("messages", 2, "content", 0, "content"),
            ("messages", 2, "content", 0, "content", 0),
            ("messages", 2, "content", 0, "tool_use_id"),
            ("tools", 0),
            ("tools", 0, "name"),
            ("tools", 0, "type"),
            ("tools", 0, "input_schema"),
            ("tool_choice", "type"),
            ("tool_choice", "name"),
            ("thinking", "type"),
        ],
    ),
    "/v1/messages/count_tokens": (
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                }
            ],
            "tools": [A_TOOL],
        },
        [
            ("messages", 0, "content", 0, "content"),
            ("messages", 0, "content", 0, "type"),
            ("tools", 0),
            ("tools", 0, "input_schema"),
        ],
    ),
    "/v1/responses": (
        {
            "input": [
                {"type": "message", "role": "user", "content": TEXT},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "instructions": "s",
            "max_output_tokens": 2,
            "tools": [R_TOOL],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            "reasoning": {"effort": "low"},
        },
        [
            ("input", 0),
            ("input", 0, "type"),
            ("input", 0, "role"),
            ("input", 0, "content"),
            ("input", 0, "content", 0, "type"),
            ("input", 0, "content", 0, "text"),
            ("input", 1, "name"),
            ("input", 1, "arguments"),
            ("input", 1, "call_id"),
            ("input", 2, "output"),
            ("tools", 0),
            ("tools", 0, "type"),
            ("tools", 0, "name"),
            ("tools", 0, "parameters"),
            ("tool_choice", "type"),
            ("tool_choice", "name"),
            ("text", "format"),
            ("text", "format", "type"),
            ("text", "format", "schema"),
        ],
    ),
    "/admin/sessions/default/fuzz/evict": ({"to": "ram"}, []),
}
STRUCTS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
}


def _fields(struct: Any) -> list[str]:
    import msgspec

    return [f.name for f in msgspec.structs.fields(struct)]


def _paths(route: str) -> list[Path]:
    base, inner = BASES[route]
    top = _fields(STRUCTS[route]) if route in STRUCTS else list(base)
    messages = [
        ("messages", i, f)
        for i in range(len(base.get("messages", [])))
        for f in _fields(ChatMessage)
    ]
    return [(f,) for f in top] + inner + messages  # fmt: skip


# values that reach deeper branches than random text: the words the handlers look for
WORDS = st.sampled_from(
    ["", "none", "auto", "required", "any", "tool", "function", "text", "json_schema",
     "json_object", "user", "assistant", "system", "developer", "tool_use", "tool_result",
     "message", "function_call", "function_call_output", "input_text", "enabled", "disabled",
     "ram", "disk", "f", "self", "messages", "{", "[]", "<think>", "a" * 300]
)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=40_000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | WORDS
)
KEYS = WORDS | st.text(max_size=6)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
DELETE = object()
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def put(body: dict[str, Any], path: Path, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node: Any = out
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return out  # the path does not exist in this base: the base as it is
    try:
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        pass
    return out


CASES = st.sampled_from(list(BASES)).flatmap(
    lambda route: st.tuples(st.just(route), st.sampled_from(_paths(route) or [("to",)]),
                            st.just(DELETE) | JSON, st.booleans())
)  # fmt: skip


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    # cut each generation at 0.5 s: a fuzzed max_tokens makes a valid, long request
    return serve(request_timeout_s=0.5, admin_token=ADMIN, max_body_mb=1)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        body = {"messages": [USER], "max_tokens": 1}  # the session the admin route moves
        r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "fuzz"})
        assert r.status_code == 200, r.text
        yield c


def test_any_json_value_in_any_field_is_never_a_5xx(server: Server, client: httpx.Client) -> None:
    failures: list[str] = []
    seen: Counter[str] = Counter()
    started = time.monotonic()

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=CASES)
    def check(case: tuple[str, Path, Any, bool]) -> None:
        route, path, value, stream = case
        body = put(BASES[route][0], path, value)
        if stream and route in STREAMING:
            body["stream"] = True
        r = client.post(route, content=json.dumps(body).encode(),
                        headers={"content-type": "application/json"})  # fmt: skip
        seen[f"{route} {r.status_code}"] += 1
        if r.status_code >= 500 or "Traceback" in r.text:
            failures.append(f"{route} {path}={value!r}: {r.status_code} {r.text[:200]}")
        elif r.status_code >= 400 and not r.headers["content-type"].startswith("application/json"):
            failures.append(f"{route} {path}: {r.status_code} not JSON")

    check()
    seconds = time.monotonic() - started
    print(f"{sum(seen.values())} requests in {seconds:.1f} s:", dict(sorted(seen.items())))
    assert not failures, "\n".join(failures[:20])
    assert any(s.endswith(" 200") for s in seen) and any(s.endswith(" 400") for s in seen), seen
    assert seconds < 60, seconds
    assert httpx.get(server.url + "/health").status_code == 200
    server.engine.pool.check_integrity()
