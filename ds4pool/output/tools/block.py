"""Parsers whose calls sit in blocks opened by a marker (Hermes, Mistral, DeepSeek-V3).

Text outside blocks passes through, less a tail that may be the start of the marker. Inside a
block the format's `_block` consumes what it can and says when the block is left; a block it
rejects before announcing a call is given back as text: the marker as text, and its body scanned
again as ordinary text.
"""

from __future__ import annotations

from abc import abstractmethod

from ds4pool.output.deltas import Delta
from ds4pool.output.markers import partial_suffix, split_at
from ds4pool.output.tools.base import Calls, ToolParser, text


class BlockParser(ToolParser):
    START: str  # the marker that opens a block

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._buf = ""  # received, not consumed yet
        self._in_block = False
        self._chunk = ""  # the latest chunk: a JSON value can only complete in the one closing it

    def feed(self, chunk: str) -> list[Delta]:
        self._buf += chunk
        self._chunk = chunk
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        self._chunk = ""
        return self._run(final=True)

    def _may_close(self, bracket: str, final: bool) -> bool:
        """Whether a complete-value check (O(length)) can succeed now: only at the end or when
        the latest chunk holds the closing bracket."""
        return final or bracket in self._chunk

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._in_block:
                if not self._block(out, final):
                    return out  # waits for more text
                continue
            cut = split_at(self._buf, self.START)
            if cut is None:
                keep = 0 if final else partial_suffix(self._buf, (self.START,))
                out += text(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            out += text(cut[0])
            self._buf, self._in_block = cut[1], True
            self._enter()

    def _reject(self, out: list[Delta]) -> bool:
        """Give the block back as text (its body is scanned again as text)."""
        out += text(self.START)
        self._in_block = False
        return True

    def _leave(self, consumed: int) -> bool:
        self._buf = self._buf[consumed:]
        self._in_block = False
        return True

    def _enter(self) -> None:
        """A block just opened (reset per-block state)."""

    @abstractmethod
    def _block(self, out: list[Delta], final: bool) -> bool:
        """Consume block text from `self._buf`, appending deltas to `out`; True once the block
        is left (then `_in_block` is False), False to wait for more. With `final` it must
        leave the block."""
