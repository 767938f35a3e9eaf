"""Qwen3-Coder tool calls, XML with untyped values:
<tool_call>\\n<function=write_file>\\n<parameter=path>\\na.py\\n</parameter>\\n...</function>\\n</tool_call>
Values are raw text; the offered tool's schema types them (a "string" parameter, or one the
schema does not type, stays text; others are read as JSON, else kept as text). The arguments
JSON is written here as the values arrive, so string values stream as they are written."""

from __future__ import annotations

import json
from typing import Any

from ds4pool.output.deltas import Delta
from ds4pool.output.markers import partial_suffix
from ds4pool.output.tools.base import Calls, CallStream
from ds4pool.output.tools.block import BlockParser

FUNCTION = "<function="
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
FUNCTION_END = "</function>"
END = "</tool_call>"
_MAX_HEADER = 256  # a name longer than this before ">" is no call


class Qwen3CoderParser(BlockParser):
    START = "<tool_call>"

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._enter()

    def _enter(self) -> None:
        self._call: CallStream | None = None
        self._param: str | None = None  # the parameter whose value is being read
        self._value = ""  # a non-string parameter's raw text so far
        self._started_value = False  # the value's leading newline is behind us
        self._num_params = 0

    def _block(self, out: list[Delta], final: bool) -> bool:
        while True:
            if self._call is None:
                opened = self._open(out, final)
                if opened is not True:
                    return opened is False and self._reject(out)
            elif self._param is not None:
                if not self._read_value(out, final):
                    return self._close(out) if final else False
            else:
                step = self._between(out, final)
                if step is not None:
                    return step

    def _open(self, out: list[Delta], final: bool) -> bool | None:
        """`<function=NAME>`: True when announced, False if no call, None if incomplete."""
        body = self._buf.lstrip()
        if not body.startswith(FUNCTION):
            return None if not final and FUNCTION.startswith(body) else False
        name, gt, rest = body[len(FUNCTION) :].partition(">")
        if not gt:
            return None if not final and len(name) <= _MAX_HEADER else False
        if not self.calls.known(name.strip()):
            return False
        self._call = self.calls.open(name.strip())
        out.append(self._call.start)
        out += self._call.append("{")
        self._buf = rest
        return True

    def _between(self, out: list[Delta], final: bool) -> bool | None:
        """Between parameters: the next `<parameter=KEY>`, or the call's end. Returns True once
        the block is left, False to wait, None to go on reading."""
        assert self._call is not None
        body = self._buf.lstrip()
        if body.startswith(PARAMETER):
            key, gt, rest = body[len(PARAMETER) :].partition(">")
            if not gt:
                return self._close(out) if final else False
            self._param, self._buf = key.strip(), rest
            self._value, self._started_value = "", False
            lead = ", " if self._num_params else ""
            self._num_params += 1
            out += self._call.append(f"{lead}{json.dumps(self._param, ensure_ascii=False)}: ")
            if self._is_string():
                out += self._call.append('"')
            return None
        if body.startswith(FUNCTION_END):
            rest = body[len(FUNCTION_END) :].lstrip()
            if rest.startswith(END):
                return self._close(out, consumed=len(self._buf) - len(rest) + len(END))
            if not final and END.startswith(rest):
                return False
            return self._close(out, consumed=len(self._buf) - len(rest))
        if body.startswith(END):  # </function> left out
            return self._close(out, consumed=len(self._buf) - len(body) + len(END))
        if not final and any(m.startswith(body) for m in (PARAMETER, FUNCTION_END, END)):
            return False
        return self._close(out)  # anything else ends the call; what follows is text

    def _read_value(self, out: list[Delta], final: bool) -> bool:
        """Stream the current value; True once its `</parameter>` was read."""
        assert self._call is not None
        end = self._buf.find(PARAMETER_END)
        if end >= 0:
            piece, self._buf = self._buf[:end], self._buf[end + len(PARAMETER_END) :]
            piece = piece.removesuffix("\n")
        else:
            keep = 0 if final else partial_suffix(self._buf, (PARAMETER_END,))
            piece = self._buf[: len(self._buf) - keep]
            if not final:
                piece = piece.rstrip("\n")  # the newline before </parameter> is no value
            self._buf = self._buf[len(piece) :]
        if not self._started_value:
            piece = piece.removeprefix("\n")
            self._started_value = bool(piece) or end >= 0
        if self._is_string():
            out += self._call.append(json.dumps(piece, ensure_ascii=False)[1:-1])
        else:
            self._value += piece
        if end < 0:
            return False
        self._finish_value(out)
        return True

    def _finish_value(self, out: list[Delta]) -> None:
        assert self._call is not None
        if self._is_string():
            out += self._call.append('"')
        else:
            out += self._call.append(_typed(self._value))
        self._param = None

    def _close(self, out: list[Delta], consumed: int = 0) -> bool:
        """End the call (a value left open is closed as written) and leave the block."""
        assert self._call is not None
        if self._param is not None:
            if not self._is_string():
                self._value += self._buf
                self._buf = ""
            self._finish_value(out)
        out += self._call.append("}")
        out += self._call.end_written()
        self._call = None
        return self._leave(consumed)

    def _is_string(self) -> bool:
        assert self._call is not None and self._param is not None
        kind = self.calls.param_types.get(self._call.start.name, {}).get(self._param)
        return kind in (None, "string")


def _typed(raw: str) -> str:
    """A non-string value's JSON: the text itself if it is JSON, else the text as a string."""
    text = raw.strip()
    try:
        value: Any = json.loads(text)
    except ValueError:
        # the template prints Python values: True / False / None
        value = {"True": True, "False": False, "None": None}.get(text, text)
    return json.dumps(value, ensure_ascii=False)
