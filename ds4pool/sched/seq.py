"""The scheduler's per-request state: tokens, progress, detokenization and stop handling.

# all_ids = prompt_ids + output_ids
# [0, num_reused)             KV reused from the session (prefix hit)
# [num_reused, num_computed)  KV computed by this request so far
# [num_computed, num_tokens)  still to compute (prompt chunks, or the last sampled token)
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from ds4pool.kv.lease import SessionLease
from ds4pool.model.grammar import GrammarState
from ds4pool.model.tokenizer import IncrementalDecoder, Tokenizer
from ds4pool.sched.pretokenize import PromptPieces
from ds4pool.sched.request import Event, Request, RequestStream, State, Usage


@dataclass
class Seq:
    req: Request
    stream: RequestStream
    seq_id: int = 0  # unique per scheduler: the runner's input batch keys rows by it
    state: State = State.WAITING
    lease: SessionLease | None = None  # its hold on the session, from admission to the end
    pieces: PromptPieces | None = None  # a text prompt's tokens, filled before admission
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_reused: int = 0
    num_computed: int = 0
    # tokens whose full blocks are in the block index for other requests (offered as steps
    # settle; the cached prefix at admission): what a request waiting on it can match
    offered: int = 0
    max_tokens: int = 0
    seed: int = 0
    decoder: IncrementalDecoder | None = None
    text: str = ""  # generated text so far (all of it, stop strings included)
    emitted: int = 0  # chars of `text` already sent to the stream
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    blocked_since: float | None = None  # waiting on a session busy with another request
    reads: int = 0  # bring-ups of its session requested (kv/prefetch.py)
    usage_sent: bool = False  # the first event carries usage (the prompt's counts) too
    grammar: GrammarState | None = None  # set at admission when req.constraint is set

    def __post_init__(self) -> None:
        seed = self.req.sampling.seed
        self.seed = seed if seed is not None else random.getrandbits(63)

    # the queue's protocol
    @property
    def tenant(self) -> str:
        return self.req.tenant

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def arrival(self) -> float:
        return self.req.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode row's one token must not
        cost a copy of its whole context every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def start_decoding(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        if self.req.constraint is not None:
            self.grammar = GrammarState(self.req.constraint, vocab_size)

    def accept(self, token: int, eos_ids: frozenset[int]) -> str | None:
        """Record a sampled token, the part the next step's build needs: the grammar, end
        of sequence, the token in output_ids. A finish reason ("error": the output grammar
        rejects the token, which the mask should have prevented), or None: then
        `settle_text` must follow before the token's text is read."""
        now = time.monotonic()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        if self.grammar is not None:
            if not self.grammar.accept(token):
                return "error"
            if self.grammar.terminated:  # a stop token where the grammar may end
                return "stop"
        elif token in eos_ids and not self.req.ignore_eos:
            return "stop"
        self.output_ids.append(token)
        return None

    @property
    def out_of_tokens(self) -> bool:
        return len(self.output_ids) >= self.max_tokens

    def settle_text(self) -> str | None:
        """The rest for the last accepted token: its text, stop strings, max_tokens; a
        finish reason or None."""
        assert self.decoder is not None
        self.text += self.decoder.push(self.output_ids[-1])
        if self._stop_at() is not None:
            return "stop"
        if self.out_of_tokens:
            # out of tokens exactly where the grammar may end: the output is whole
            return "stop" if self.grammar is not None and self.grammar.completed else "length"
        return None

    def _stop_at(self) -> int | None:
        """Index in `text` where the first stop string starts, if any."""
        hit = self._stop_hit()
        return None if hit is None else hit[0]

    def _stop_hit(self) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `text`, if any."""
        found = [
            (i, s)
            for s in self.req.stop
            if (i := self.text.find(s, max(0, self.emitted - len(s)))) >= 0
        ]
        return min(found) if found else None

    def delta(self, finished: bool) -> str:
        """Text not yet emitted. While running, hold back a tail that could still become
        a stop string; at the end, cut at the first stop string."""
        if finished:
            assert self.decoder is not None
            self.text += self.decoder.flush()
            cut = self._stop_at()
            end = len(self.text) if cut is None else cut
        else:
            hold = max((len(s) - 1 for s in self.req.stop), default=0)
            end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.num_reused,
            completion_tokens=len(self.output_ids),
        )

    def event(self, token_ids: tuple[int, ...], finish: str | None) -> Event:
        text = self.delta(finish is not None)
        hit = self._stop_hit() if finish == "stop" else None
        first, self.usage_sent = not self.usage_sent, True
        return Event(
            text=text,
            token_ids=token_ids,
            finish_reason=finish,
            usage=self.usage() if finish or first else None,
            stop_string=hit[1] if hit else None,
        )
