"""Hermes / Qwen2.5 / Qwen3 tool calls:
<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
One block per call; several blocks per turn, text between them allowed."""

from __future__ import annotations

from typing import Any

from ds4pool.output.deltas import Delta
from ds4pool.output.jsonstream import MISSING, Malformed, parse_complete, parse_partial
from ds4pool.output.markers import partial_suffix
from ds4pool.output.tools.base import Calls, CallStream, stream_body
from ds4pool.output.tools.block import BlockParser

END = "</tool_call>"


def call_arguments(obj: dict[str, Any]) -> Any:
    """A call object's arguments: "arguments" (Hermes, Mistral) or "parameters" (Llama);
    some models write them as a JSON string. None given is no arguments ({})."""
    for key in ("arguments", "parameters"):
        if key in obj:
            args = obj[key]
            return parse_complete(args) if isinstance(args, str) else args
    return {}


def valid_call(obj: Any, calls: Calls) -> bool:
    return (
        isinstance(obj, dict)
        and calls.known(obj.get("name"))
        and isinstance(call_arguments(obj), dict)
    )


class HermesParser(BlockParser):
    START = "<tool_call>"

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._enter()

    def _enter(self) -> None:
        self._call: CallStream | None = None

    def _block(self, out: list[Delta], final: bool) -> bool:
        end = self._buf.find(END)
        if end >= 0 or final:
            body = self._buf if end < 0 else self._buf[:end]
            consumed = len(self._buf) if end < 0 else end + len(END)
            return self._complete(out, body, consumed)
        body = self._buf[: len(self._buf) - partial_suffix(self._buf, (END,))]
        if self._call is not None:
            out += stream_body(self._call, body)
            return False
        try:
            partial = parse_partial(body)
        except Malformed:
            return self._reject(out)
        if partial is None:
            return False
        if not isinstance(partial.finished, dict):
            return self._reject(out)
        name = partial.finished.get("name")
        if name is None:
            return False
        if not self.calls.known(name):
            return self._reject(out)
        self._call = self.calls.open(name)
        out.append(self._call.start)
        out += self._call.stream(arguments_of(partial.value), arguments_of(partial.finished))
        return False

    def _complete(self, out: list[Delta], body: str, consumed: int) -> bool:
        obj = parse_complete(body)
        if obj is MISSING and self._call is not None:  # cut off or broken: what parsed
            out += stream_body(self._call, body, force=True)
        if self._call is None:
            if not valid_call(obj, self.calls):
                return self._reject(out)
            self._call = self.calls.open(obj["name"])
            out.append(self._call.start)
        args = call_arguments(obj) if isinstance(obj, dict) else MISSING
        out += self._call.end(args)
        return self._leave(consumed)


def arguments_of(obj: Any) -> Any:
    """The (partial) arguments of a partial call object, None if there are none yet."""
    if not isinstance(obj, dict):
        return None
    return obj.get("arguments", obj.get("parameters"))
