"""Mistral tool calls, in both of its tokenizers' forms:
  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]   (v3)
  [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}                                  (v11+)
In the array form each element is a call: it opens when its name is complete and ends when
the next element starts (or the array closes). Once a call of the array is announced, later
elements that are not valid calls are skipped."""

from __future__ import annotations

import json

from ds4pool.output.deltas import Delta
from ds4pool.output.jsonstream import (
    MISSING,
    Malformed,
    Partial,
    Throttle,
    parse_growing,
    parse_partial,
)
from ds4pool.output.markers import partial_suffix
from ds4pool.output.tools.base import Calls, CallStream
from ds4pool.output.tools.block import BlockParser
from ds4pool.output.tools.hermes import arguments_of, call_arguments

ARGS = "[ARGS]"
_MAX_NAME = 256  # a v11 name longer than this without [ARGS] is not a call
_decoder = json.JSONDecoder()


class MistralParser(BlockParser):
    START = "[TOOL_CALLS]"

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._enter()

    def _enter(self) -> None:
        self._done = 0  # array elements ended or skipped
        self._announced = 0  # calls announced in this block
        self._open: CallStream | None = None  # the call of element `_done`, or the v11 call
        self._named = False  # v11 form: `_open`'s arguments are streaming
        self._throttle = Throttle()

    def _block(self, out: list[Delta], final: bool) -> bool:
        if self._named:
            return self._named_args(out, final)
        body = self._buf.lstrip()
        if not body:
            return self._reject(out) if final else False
        if body.startswith("["):
            return self._array(out, body, len(self._buf) - len(body), final)
        return self._named_start(out, body, final)

    # --- [{"name": ..., "arguments": ...}, ...] ------------------------------------------

    def _array(self, out: list[Delta], body: str, offset: int, final: bool) -> bool:
        items, end = _complete_value(body) if self._may_close("]", final) else (MISSING, -1)
        if isinstance(items, list):
            self._update(out, Partial(items, items), complete=True)
            return self._leave(offset + end) if self._announced else self._reject(out)
        if not (final or self._throttle.due(len(body))):
            return False
        if self._open is not None and self._stream_open(out, body) and not final:
            return False
        try:
            partial = parse_partial(body)
        except Malformed:
            partial = None
        if partial is not None and isinstance(partial.finished, list):
            self._update(out, partial, complete=False)
        elif self._announced == 0:
            return self._reject(out)
        if self._announced == 0 and self._done > 0:
            return self._reject(out)  # the first element is no call
        if final:
            if self._open is not None:
                out += self._open.end()
                self._open = None
            return self._leave(len(self._buf)) if self._announced else self._reject(out)
        return False

    def _stream_open(self, out: list[Delta], body: str) -> bool:
        """Stream the open element's arguments with the cheaper parse; True while it is still
        the last element (False: it ended, or the parse failed, and the full parse decides)."""
        assert self._open is not None
        try:
            grown = parse_growing(body)
        except Malformed:
            return False
        if grown is None or not isinstance(grown.value, list) or len(grown.value) <= self._done:
            return False
        if len(grown.value) > self._done + 1:  # the next element began: this one is complete
            out += self._open.end(call_arguments(grown.value[self._done]))
            self._open = None
            self._done += 1
            return False
        args = arguments_of(grown.value[self._done])
        out += self._open.stream_growing(args, grown.open_string)
        return True

    def _update(self, out: list[Delta], partial: Partial, complete: bool) -> None:
        """Open, stream and end the calls of the array's elements seen so far."""
        finished, value = partial.finished, partial.value
        while self._done < len(finished):
            k = self._done
            item = finished[k]
            growing = k == len(finished) - 1 and not complete
            if self._open is None:
                name = item.get("name") if isinstance(item, dict) else None
                if name is None and growing:
                    return
                if not self.calls.known(name):
                    self._done += 1
                    continue
                self._open = self.calls.open(name)
                self._announced += 1
                out.append(self._open.start)
            if growing:
                current = value[k] if k < len(value) else None
                out += self._open.stream(arguments_of(current), arguments_of(item))
                return
            out += self._open.end(call_arguments(item))
            self._open = None
            self._done += 1

    # --- name[ARGS]{...} ------------------------------------------------------------------

    def _named_start(self, out: list[Delta], body: str, final: bool) -> bool:
        i = body.find(ARGS)
        if i < 0:
            name = body[: len(body) - partial_suffix(body, (ARGS,))]
            undecided = len(name) <= _MAX_NAME and not any(c in name for c in ' \n{["')
            return False if undecided and not final else self._reject(out)
        name = body[:i].strip()
        if not self.calls.known(name):
            return self._reject(out)
        self._open = self.calls.open(name)
        self._announced += 1
        out.append(self._open.start)
        self._buf = body[i + len(ARGS) :]
        self._named = True
        return self._named_args(out, final)

    def _named_args(self, out: list[Delta], final: bool) -> bool:
        assert self._open is not None
        raw = self._buf.lstrip()
        args, end = _complete_value(raw) if self._may_close("}", final) else (MISSING, -1)
        if args is MISSING and not final:
            out += self._open.stream_text(raw)
            return False
        if args is MISSING:
            out += self._open.stream_text(raw, force=True)
        out += self._open.end(args)
        self._open, self._named = None, False
        return self._leave(len(self._buf) - len(raw) + end if end >= 0 else len(self._buf))


def _complete_value(text: str) -> tuple[object, int]:
    """(the complete JSON value `text` starts with, where it ends), (MISSING, -1) if none."""
    try:
        return _decoder.raw_decode(text)
    except ValueError:
        return MISSING, -1
