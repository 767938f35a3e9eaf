"""A Responses API request's `instructions`, `input` items and `tools` → chat-template
messages and tool definitions. Every error names the offending field (`input[3].call_id`).

Items ds4pool understands: messages (roles user, assistant, system, developer; text parts),
`function_call`, `function_call_output` and `reasoning`. Nothing is stored between requests,
so items that point at stored state (`item_reference`) are refused like unknown types.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ds4pool.api.errors import ApiError

log = logging.getLogger("ds4pool.api")

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field)


def to_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """Chat-template messages for `instructions` (the system prompt) and `input`."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    names: dict[str, str] = {}  # call_id → function name, for templates that show it
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "each input item must be an object")
        kind = item.get("type", "message")  # EasyInputMessage has no type
        if kind == "message":
            msg = _message(item, where)
            if msg["role"] == "assistant" and reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            _assistant_turn(out, reasoning).setdefault("tool_calls", []).append(call)
            reasoning = []
        elif kind == "function_call_output":
            out.append(_function_output(item, where, names))
        elif kind == "reasoning":
            reasoning.extend(_reasoning_text(item, where))
        else:
            raise ApiError(
                400,
                f"{where}.type: item type {kind!r} is not supported "
                f"(supported: {', '.join(ITEM_TYPES)})",
                param=f"{where}.type",
            )
    if not out:
        raise bad("input", "at least one input item is required")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad(f"{where}.role", f"role {role!r} is not one of {', '.join(MESSAGE_ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content", "content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        field = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])  # an earlier assistant turn's refusal, as its text
            continue
        if kind not in TEXT_PARTS:
            raise bad(field, f"content part type {kind!r} is not supported (text parts only)")
        if not isinstance(part.get("text"), str):
            raise bad(f"{field}.text", "text must be a string")
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad(f"{where}.{key}", f"{key} is required and must be a string")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": _arguments(item["arguments"])},
    }


def _arguments(text: str) -> dict[str, Any] | str:
    """Templates expect the arguments as an object (transformers' convention) and dump them
    with tojson; text that is not a JSON object is passed as the model wrote it."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return text
    return value if isinstance(value, dict) else text


def _assistant_turn(out: list[dict[str, Any]], reasoning: list[str]) -> dict[str, Any]:
    """The assistant message a function call belongs to: the one just before it (text, then
    calls, as the model wrote them), else a new one."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    out.append(msg)
    return msg


def _function_output(item: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.call_id", "call_id is required and must be a string")
    output = item.get("output")
    if isinstance(output, list):  # a list of content parts: text only
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                raise bad(f"{where}.output[{j}]", "only text output parts are supported")
            texts.append(str(part.get("text") or ""))
        output = "".join(texts)
    if not isinstance(output, str):
        raise bad(f"{where}.output", "output is required: a string or a list of text parts")
    msg: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": output}
    if call_id in names:
        msg["name"] = names[call_id]
    return msg


def _reasoning_text(item: dict[str, Any], where: str) -> list[str]:
    """The readable text of an earlier reasoning item (raw content, else its summary);
    encrypted content cannot be read here and is dropped."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad(f"{where}.{key}", f"{key} must be a list of parts")
        texts = [
            p["text"]
            for p in parts
            if isinstance(p, dict) and p.get("type") == part_type and isinstance(p.get("text"), str)
        ]
        if texts:
            return texts
    return []


def to_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools → the chat shape templates render. Tools of types
    ds4pool cannot run (web_search, file_search, local_shell, custom, mcp, ...) are dropped:
    an agent offers them by default, and refusing the request would make it unusable."""
    if not tools:
        return None
    out, dropped = [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad(where, "each tool must be an object with a type")
        if tool["type"] != "function":
            dropped.append(tool["type"])
            continue
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.name", "a function tool needs a name")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.parameters", "parameters must be a JSON schema object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"{where}.description", "description must be a string")
        function: dict[str, Any] = {"name": name, "description": description or ""}
        function["parameters"] = params if params is not None else {"type": "object"}
        out.append({"type": "function", "function": function})
    if dropped:
        log.info("responses: dropped tools ds4pool cannot run: %s", ", ".join(dropped))
    return out or None
