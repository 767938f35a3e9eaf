"""Llama 3.1 / 3.2 JSON tool calls: the turn starts with `{"name": "f", "parameters": {...}}`
(optionally after <|python_tag|>); several calls are separated by ";". A turn that starts
otherwise is text; a call that turns out malformed is given back as text."""

from __future__ import annotations

import json
from enum import Enum

from ds4pool.output.deltas import Delta
from ds4pool.output.jsonstream import Malformed, parse_partial
from ds4pool.output.tools.base import Calls, CallStream, ToolParser, stream_body, text
from ds4pool.output.tools.hermes import arguments_of, call_arguments, valid_call

PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


class _Mode(Enum):
    START = "start"  # nothing but whitespace seen: a call may still begin
    CALLS = "calls"
    TEXT = "text"


class Llama3JsonParser(ToolParser):
    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._mode = _Mode.START
        self._buf = ""
        self._held = ""  # text of the current call before it was announced (given back if bad)
        self._call: CallStream | None = None
        self._chunk = ""  # the latest chunk: an object can only complete in the one closing it

    def feed(self, chunk: str) -> list[Delta]:
        self._buf += chunk
        self._chunk = chunk
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        self._chunk = ""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Delta]:
        if self._mode is _Mode.START:
            body = self._buf.lstrip()
            if body.startswith(PYTHON_TAG):
                self._held, self._buf = (
                    self._buf[: len(self._buf) - len(body) + len(PYTHON_TAG)],
                    body[len(PYTHON_TAG) :],
                )
                self._mode = _Mode.CALLS
            elif body.startswith("{"):
                self._mode = _Mode.CALLS
            elif not final and PYTHON_TAG.startswith(body):
                return []
            else:
                self._mode = _Mode.TEXT
        if self._mode is _Mode.CALLS:
            out = self._calls(final)
            if self._mode is not _Mode.TEXT:
                return out
        else:
            out = []
        out += text(self._buf)
        self._buf = ""
        return out

    def _to_text(self, out: list[Delta]) -> list[Delta]:
        """The rest is text: the unannounced call's held text and what follows."""
        self._mode = _Mode.TEXT
        self._buf = self._held + self._buf
        self._held = ""
        return out

    def _calls(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            body = self._buf.lstrip()
            if self._call is None:
                skipped = len(body) - len(body.lstrip(";").lstrip())
                self._held += self._buf[: len(self._buf) - len(body) + skipped]
                self._buf = body = body[skipped:]
            if not body:
                return out
            if not body.startswith("{"):
                if self._call is not None:
                    out += self._call.end()
                    self._call = None
                return self._to_text(out)
            try:
                if not (final or "}" in self._chunk):
                    raise ValueError("not closed yet")  # raw_decode is O(length): skip it
                obj, end = _decoder.raw_decode(body)
            except ValueError:
                if not self._stream(out, body, final):
                    return self._to_text(out)
                if final and self._call is not None:
                    out += self._call.end()
                    self._call = None
                    self._buf = ""
                return out
            if self._call is None:
                if not valid_call(obj, self.calls):
                    return self._to_text(out)
                self._call = self.calls.open(obj["name"])
                out.append(self._call.start)
            out += self._call.end(call_arguments(obj) if isinstance(obj, dict) else None)
            self._call, self._held = None, ""
            self._buf = body[end:]

    def _stream(self, out: list[Delta], body: str, final: bool) -> bool:
        """Announce and stream the incomplete call in `body`; False if it is no call."""
        if self._call is not None:
            out += stream_body(self._call, body, force=final)
            return True
        try:
            partial = parse_partial(body)
        except Malformed:
            return False
        if partial is None or not isinstance(partial.finished, dict):
            return partial is None
        name = partial.finished.get("name")
        if name is None:
            return not final
        if not self.calls.known(name):
            return False
        self._call = self.calls.open(name)
        self._held = ""
        out.append(self._call.start)
        out += self._call.stream(arguments_of(partial.value), arguments_of(partial.finished))
        return True
