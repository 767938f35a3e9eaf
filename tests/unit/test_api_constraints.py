"""The API-side translation of response_format / text.format / tool_choice into specs (the
Responses helpers have no route yet on this branch: they are checked here directly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4pool.api.constraints import responses_spec, text_format_spec
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.constraints import ConstraintError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)  # its template writes Hermes tool calls


def consts(node: object) -> list[str]:
    """Every const_string of a structural tag."""
    if isinstance(node, dict):
        own = [node["value"]] if node.get("type") == "const_string" else []
        return own + [c for v in node.values() for c in consts(v)]
    if isinstance(node, list):
        return [c for v in node for c in consts(v)]
    return []


def test_text_format_shapes() -> None:
    assert text_format_spec(None) is None and text_format_spec({"type": "text"}) is None
    spec = text_format_spec({"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True})
    assert spec is not None and spec.kind == "json_schema" and json.loads(spec.source) == SCHEMA
    assert spec.param == "text.format.schema"
    for bad, param in (
        ({"type": "json_schema", "schema": SCHEMA}, "text.format.name"),
        ({"type": "xml"}, "text.format.type"),
        ("json", "text.format.type"),
    ):
        with pytest.raises(ConstraintError) as exc:
            text_format_spec(bad)
        assert exc.value.param == param


def test_responses_tool_choice(tok: Tokenizer) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA}
    assert responses_spec(tok, None, "auto", TOOLS) is None
    assert responses_spec(tok, fmt, "auto", TOOLS).kind == "json_schema"  # type: ignore[union-attr]
    forced = responses_spec(tok, fmt, {"type": "function", "name": "ls"}, TOOLS)
    assert forced is not None and forced.kind == "structural_tag"
    assert '\n{"name": "ls", "arguments": ' in consts(json.loads(forced.source))
    assert responses_spec(tok, None, "required", TOOLS, parallel_tool_calls=False) is not None
    with pytest.raises(ConstraintError, match="no tool named 'rm'") as exc:
        responses_spec(tok, None, {"type": "function", "name": "rm"}, TOOLS)
    assert exc.value.param == "tool_choice"
    with pytest.raises(ConstraintError, match="requires tools"):
        responses_spec(tok, None, "required", None)
