"""Grammar-constrained decoding with xgrammar: compile once, match per sequence, mask per step.

A `GrammarSpec` (what to obey, as text) is compiled by `GrammarCache` into a `Constraint`
(the compiled grammar, immutable and shareable between requests). Each constrained sequence
owns a `GrammarState` (an xgrammar matcher): before a step that samples it, `fill()` writes
the next token's bitmask; after the step, `accept()` advances it by the sampled token.

Bitmask layout (xgrammar's): int32 words [W], W = ceil(V / 32); bit b of word w set means
token 32 * w + b is allowed. V is the model's vocabulary (the logits' width), which may be
larger than the tokenizer's: ids the tokenizer lacks are never allowed.

xgrammar is imported lazily (it takes seconds, and unconstrained use never needs it); it is
thread-safe for compilation, and a matcher is only ever touched by the step thread.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from cachetools import LRUCache

from ds4pool.errors import Ds4poolError
from ds4pool.model.device import upload

if TYPE_CHECKING:
    from ds4pool.model.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "structural_tag")


class GrammarError(Ds4poolError):
    """A schema or grammar the client sent cannot be compiled; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, as text (hashable: the compile cache's key).

    kind "json_schema": `source` is a JSON Schema document; "json_object": any JSON object
    (`source` is ""); "structural_tag": `source` is an xgrammar structural tag (JSON).
    `param` is the request field it came from, named in compile errors.
    """

    kind: str
    source: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar attached to a Request (`compiled`: an xgrammar CompiledGrammar)."""

    spec: GrammarSpec
    compiled: Any = field(compare=False, repr=False)
    utf8: Utf8Guard | None = field(default=None, compare=False, repr=False)


class GrammarCache:
    """Compiles specs for one tokenizer and model vocabulary; an LRU by spec, bounded in bytes.

    Thread-safe: the API compiles in worker threads, never on the event loop.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = _tokenizer_info(xgr, tokenizer, vocab_size)
        self.utf8 = Utf8Guard(info.decoded_vocab, vocab_size)
        # xgrammar's own cache is unbounded by default: ours is bounded by compiled bytes
        # (0.1-0.6 MB for typical schemas and tool sets at a 152k vocabulary)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: LRUCache[GrammarSpec, Constraint] = LRUCache(
            maxsize=max_bytes, getsizeof=lambda c: max(1, c.compiled.memory_size_bytes)
        )
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Constraint:
        """The compiled constraint for `spec`; GrammarError if xgrammar rejects it."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's rejections
            raise GrammarError(f"{spec.param}: {_first_line(exc)}", spec.param) from None
        constraint = Constraint(spec, compiled, self.utf8)
        if compiled.memory_size_bytes < self._cache.maxsize:  # else LRUCache would raise
            with self._lock:
                self._cache[spec] = constraint
        return constraint

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            # any_whitespace=False: fixed separators, so random or confused weights cannot
            # spend max_tokens on indentation; strict_mode: no unlisted properties.
            return c.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        return c.compile_structural_tag(spec.source)


def _tokenizer_info(xgr: Any, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary, from the `tokenizers` backend (no transformers)."""
    backend = tokenizer.backend
    encoded = [""] * vocab_size  # "" for padding ids past the tokenizer: never allowed
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    # vocab type (byte-level, byte-fallback, raw) and prefix space, read from tokenizer.json
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=[i for i in tokenizer.eos_token_ids if i < vocab_size],
        add_prefix_space=meta["add_prefix_space"],
    )


# Lead bytes whose second byte UTF-8 restricts beyond 80..BF, and the second bytes that are
# not UTF-8 after them: E0 80..9F and F0 80..8F are overlong forms, ED A0..BF a surrogate
# (U+D800-DFFF), F4 90..BF past U+10FFFF.
_BAD_SECOND: dict[int, range] = {
    0xE0: range(0x80, 0xA0),
    0xED: range(0xA0, 0xC0),
    0xF0: range(0x80, 0x90),
    0xF4: range(0x90, 0xC0),
}


class Utf8Guard:
    """What xgrammar lets through that is not UTF-8: after a lead byte that restricts its
    second byte (_BAD_SECOND) it may allow any continuation byte. A JSON string takes a
    surrogate (ED A0..BF xx) for one character; a string with a length bound (maxLength, the
    rule that counts characters) also overlong E0 80..9F xx and F0 80..8F xx xx. Any decoder
    makes two to four U+FFFD of such a "character", so a random model exceeded a schema's
    maxLength (seen: a 12-character bound, 14 characters out, in 6 of 3,900 forced tool calls
    of the demo model). Its masks remove, for a constrained row, every token holding such a
    pair, and after a token ending in one of those lead bytes every token starting with a
    second byte it does not allow. Every other invalid sequence (C0, C1, F5..FF, a lone
    continuation byte) xgrammar rejects itself."""

    _INSIDE = re.compile(rb"\xe0[\x80-\x9f]|\xed[\xa0-\xbf]|\xf0[\x80-\x8f]|\xf4[\x90-\xbf]")

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        words = (vocab_size + 31) // 32
        inside: list[int] = []  # tokens holding a lead byte and a second byte it forbids
        starts: dict[int, list[int]] = {lead: [] for lead in _BAD_SECOND}
        self.lead_at_end: dict[int, int] = {}  # token → the restricting lead byte it ends in
        for i, t in enumerate(decoded_vocab):
            if not t:
                continue
            for lead, bad in _BAD_SECOND.items():
                if t[0] in bad:
                    starts[lead].append(i)
            if t[-1] in _BAD_SECOND:
                self.lead_at_end[i] = t[-1]
            if self._INSIDE.search(t):
                inside.append(i)
        self.anywhere = _clear_bits(inside, words)  # [1, W]: applies in every state
        self.after = {lead: _clear_bits(inside + starts[lead], words) for lead in _BAD_SECOND}

    def mask(self, lead: int | None) -> torch.Tensor:
        """The mask after output ending in `lead` (a lone restricting lead byte), or None."""
        return self.anywhere if lead is None else self.after[lead]


def _clear_bits(tokens: list[int], words: int) -> torch.Tensor:
    """int32 [1, W], all bits set but those of `tokens`."""
    keep = torch.ones(words * 32, dtype=torch.int64)
    keep[torch.tensor(tokens, dtype=torch.int64)] = 0
    packed = (keep.view(words, 32) << torch.arange(32)).sum(1)  # < 2^32 in int64
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)[None]


class GrammarState:
    """One sequence's position in its grammar. Used by the step thread only."""

    def __init__(self, constraint: Constraint, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(constraint.compiled)
        # [1, W] host buffer, refilled before every step that samples this sequence; the
        # runner copies it out during that step, before the next fill.
        self.bitmask = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)
        self.dead_end = False
        self._utf8 = constraint.utf8
        self._lead: int | None = None  # the output ends with this lone lead byte (Utf8Guard)

    def fill(self) -> torch.Tensor | None:
        """The next token's bitmask [W] (a view of the reused buffer), or None when every
        token is allowed (nothing to mask). Sets `dead_end` when no token is allowed (an
        unsatisfiable schema): the request must end, a fully masked row cannot sample."""
        if not self._matcher.fill_next_token_bitmask(self.bitmask):
            return None
        if self._utf8 is not None:
            self.bitmask &= self._utf8.mask(self._lead)
        self.dead_end = not bool(self.bitmask.any())
        return self.bitmask[0]

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar forbids it (a masking bug)."""
        if not self._matcher.accept_token(token):
            return False
        if self._utf8 is not None:
            self._lead = self._utf8.lead_at_end.get(token)
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())

    @property
    def completed(self) -> bool:
        """The output so far is a complete match (a stop token would be accepted now)."""
        return bool(self._matcher.is_completed())


# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0])[:300]


def apply_token_bitmask(
    logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]
) -> torch.Tensor:
    """logits with [rows[k], v] = -inf wherever masks[k] (host int32 [W]) clears token v's bit.

    logits [R, V] on the device. One host → device upload (pinned on CUDA), no readback;
    rows outside `rows` are copied unchanged, so unconstrained rows sample as they would
    alone. Out of place: `logits` may be a buffer the caller (a CUDA graph) reuses.
    """
    num_vocab = logits.shape[1]
    host = torch.stack(masks)  # [M, W]
    assert host.shape[1] * 32 >= num_vocab, (host.shape, num_vocab)
    device = logits.device
    index = upload(torch.tensor(rows, dtype=torch.int64), device)  # after the forward: pinned
    sub = logits.index_select(0, index)  # [M, V]
    if device.type == "cpu":
        # xgrammar's C++ loop: ~3x faster here than the tensor ops (which expand to [M, V])
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(sub, host, vocab_size=num_vocab)
    else:
        words = upload(host, device)
        sub.masked_fill_(forbidden_tokens(words, num_vocab), float("-inf"))
    return logits.index_copy(0, index, sub)


# bit b of a word, as int32 (bit 31 is the sign bit)
_BITS = [1 << b if b < 31 else -(1 << 31) for b in range(32)]


def forbidden_tokens(words: torch.Tensor, num_vocab: int) -> torch.Tensor:
    """bool [M, V], True where the bitmask words [M, W] clear the token's bit (elementwise
    tensor ops on the words' device: no host sync, no custom kernel to compile)."""
    bits = upload(torch.tensor(_BITS, dtype=torch.int32), words.device)
    return (words.unsqueeze(-1) & bits).eq(0).flatten(1)[:, :num_vocab]  # [M, W, 32] → [M, V]
