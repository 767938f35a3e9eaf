"""DeepSeek-V3 tool calls (special tokens, arguments in a JSON code fence):
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
and V3.1's shorter call, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

from __future__ import annotations

from ds4pool.output.deltas import Delta
from ds4pool.output.jsonstream import parse_complete
from ds4pool.output.markers import partial_suffix
from ds4pool.output.tools.base import Calls, CallStream
from ds4pool.output.tools.block import BlockParser

CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```json\n"


class DeepSeekV3Parser(BlockParser):
    START = "<｜tool▁calls▁begin｜>"

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._enter()

    def _enter(self) -> None:
        self._call: CallStream | None = None
        self._announced = 0

    def _block(self, out: list[Delta], final: bool) -> bool:
        while True:
            if self._call is not None:
                if not self._arguments(out, final):
                    return False
                continue
            body = self._buf.lstrip()
            if body.startswith(CALLS_END):
                return self._leave(len(self._buf) - len(body) + len(CALLS_END))
            if body.startswith(CALL_BEGIN):
                opened = self._open(out, body[len(CALL_BEGIN) :], final)
                if opened is None:
                    return False
                if not opened:
                    return self._give_back(out)
                continue
            if not final and (CALL_BEGIN.startswith(body) or CALLS_END.startswith(body)):
                return False
            return self._give_back(out)

    def _give_back(self, out: list[Delta]) -> bool:
        """Unexpected text in the block: reject it, or after announced calls leave it as text."""
        if self._announced:
            self._in_block = False
            return True
        return self._reject(out)

    def _open(self, out: list[Delta], rest: str, final: bool) -> bool | None:
        """Announce the call whose header starts `rest`: True when opened, False if it is no
        call, None while the header is incomplete."""
        head, sep, after = rest.partition(SEP)
        if not sep:
            return None if not final and len(rest) <= 256 else False
        stripped = after.lstrip()
        if stripped.startswith("{"):  # V3.1: the name was before the separator
            name, args_at = head.strip(), len(after) - len(stripped)
        else:
            line, newline, tail = after.partition("\n")
            if not newline:
                return None if not final and len(after) <= 256 else False
            name, args_at = line.strip(), len(line) + 1
            fence = tail.lstrip(" ")
            if fence.startswith(FENCE):
                args_at += len(tail) - len(fence) + len(FENCE)
            elif FENCE.startswith(fence) and not final:
                return None
        if not self.calls.known(name):
            return False
        self._call = self.calls.open(name)
        self._announced += 1
        out.append(self._call.start)
        self._buf = after[args_at:]
        return True

    def _arguments(self, out: list[Delta], final: bool) -> bool:
        """Stream the open call's arguments; True once it is closed."""
        assert self._call is not None
        end = self._buf.find(CALL_END)
        if end < 0 and not final:
            raw = self._buf[: len(self._buf) - partial_suffix(self._buf, (CALL_END,))]
            out += self._call.stream_text(_unfenced(raw))
            return False
        raw = self._buf if end < 0 else self._buf[:end]
        if end < 0:
            out += self._call.stream_text(_unfenced(raw), force=True)
        out += self._call.end(parse_complete(_unfenced(raw)))
        self._call = None
        self._buf = "" if end < 0 else self._buf[end + len(CALL_END) :]
        if end < 0:
            self._in_block = False
        return True


def _unfenced(raw: str) -> str:
    """The arguments without the closing fence (and the blank before it)."""
    return raw.rstrip().rstrip("`").rstrip()
