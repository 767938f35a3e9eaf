"""Tokenization of prompt text before admission, on a thread of its own.

A prompt given as text is tokenized from where it continues its session (kv/prefix.py: the
text after the session's, or after the last mark it still agrees with). Done at admission,
that is a BPE run over up to the whole prompt on the step thread, which every decoding
session waits for (~0.1 s per 10k tokens of the demo tokenizer on this VM). The
`Pretokenizer` does it once the request is submitted: it asks the pool where the prompt
would continue (`SessionPool.text_resume`: a comparison of text under the pool lock),
tokenizes that piece with no lock held and leaves it in the request's `PromptPieces`. The
scheduler admits the request once that is done, and `SessionLease.prepare` then finds the
piece and only compares ids. A piece from another offset (the session changed in between:
a request of the same session ran first) is tokenized by `prepare` itself, outside the pool
lock, so the result is the same either way: tokenize(text[c:]) depends on c alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

RETRY_S = 0.005  # a session being brought up from disk: ask again for its resume point


class PromptPieces:
    """A prompt's text and its tokenizations from char offsets, filled ahead of admission."""

    def __init__(self, text: str, encode: Callable[[str], list[int]]) -> None:
        self.text = text
        self._encode = encode
        self._ids: dict[int, list[int]] = {}  # offset c → ids of text[c:]
        self.done = threading.Event()  # the pretokenizer has finished with it

    def fill(self, start: int) -> None:
        self._ids[start] = self._encode(self.text[start:])

    def tokenize(self, piece: str) -> list[int]:
        """The lease's tokenize: ids of `piece`, which is text[c:] for some c (taken from
        the pieces when filled for that c, else tokenized here)."""
        start = len(self.text) - len(piece)
        ids = self._ids.pop(start, None)  # used once: a retry tokenizes again
        return ids if ids is not None else self._encode(piece)

    def ids_at(self, start: int) -> list[int] | None:
        """The ids of text[start:] if filled (left for `tokenize`), else None."""
        return self._ids.get(start) if self.done.is_set() else None

    @property
    def filled(self) -> list[int]:
        """The offsets filled so far (for tests and logs)."""
        return sorted(self._ids)


# (tenant, session_id, text) → where its new tokens start; None: not known yet
ResumeAt = Callable[[str, str | None, str], int | None]
# (tenant, session_id) → True while the session is being brought up (its tokens unread)
Pending = Callable[[str, str | None], bool]


class Pretokenizer:
    def __init__(self, resume_at: ResumeAt, pending: Pending) -> None:
        self._resume_at = resume_at
        self._pending = pending
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, str, str | None, PromptPieces]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None  # started by the first text prompt

    def submit(self, tenant: str, session_id: str | None, pieces: PromptPieces) -> None:
        """Queue a prompt's tokenization (O(1): called on the event loop)."""
        with self._cond:
            if self._stopping:
                pieces.done.set()  # prepare() tokenizes it
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ds4pool-tokenize", daemon=True
                )
                self._thread.start()
            self._queue.append((0.0, tenant, session_id, pieces))
            self._cond.notify_all()

    def stop(self) -> None:
        """Finish: what is still queued is tokenized by prepare() (nothing waits on it)."""
        with self._cond:
            self._stopping = True
            for *_, pieces in self._queue:
                pieces.done.set()
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                not_before, tenant, session_id, pieces = self._queue.popleft()
                wait = not_before - time.monotonic()
                if wait > 0:  # the head waits on a read from disk: let others go first
                    self._queue.append((not_before, tenant, session_id, pieces))
                    if all(t > time.monotonic() for t, *_ in self._queue):
                        self._cond.wait(min(wait, RETRY_S))
                    continue
            try:
                start = self._resume_at(tenant, session_id, pieces.text)
                if start is None and self._pending(tenant, session_id):
                    with self._cond:
                        self._queue.append((time.monotonic() + RETRY_S, tenant, session_id, pieces))
                    continue
                if start is not None:
                    pieces.fill(start)
            except Exception:  # prepare() tokenizes it and reports what is wrong
                log.exception("pretokenize: tokenizing a prompt ahead failed")
            pieces.done.set()
