"""Matching a new prompt against a leased session: how many leading tokens reuse KV.

The session's own tokens are compared with the prompt's (after the text plan of kv/prefix.py
kept what the text allows), its KV past the common prefix is dropped, and where the block
index holds a longer chain of the prompt's blocks (another session's system prompt, this
session's other branch) the session adopts those blocks instead (kv/sharing.py). Runs under
the pool lock, on a session the caller leases (kv/lease.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4pool.kv.lease_parts import PoolParts, drop_kv, truncate_kv
from ds4pool.kv.prefix import TextPlan
from ds4pool.kv.session import Session


@dataclass(frozen=True)
class Prepared:
    """A new prompt matched against the session's cache (and the block index)."""

    token_ids: list[int]  # the full prompt, cached part first
    num_cached: int  # leading tokens whose KV is reused (prefix hit)
    num_shared: int  # of num_cached, tokens beyond the session's own KV (block index)
    via_text: bool  # the text extended the session's: its tokens were kept as they are


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading items two token lists share. Compared a slice at a time (in C):
    the common case, a prompt that extends the session's tokens, is one comparison, where a
    loop in Python took ~0.3 ms a 3k-token prompt on the step thread."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def match_prompt(
    p: PoolParts,
    s: Session,
    ids: list[int],
    plan: TextPlan | None,
    text_only: str | None,
    priority: int,
) -> Prepared:
    """Leave s holding ids[:num_cached] (KV for all of them) and return the match. text_only:
    the prompt's text when it came as text alone (its end becomes a text mark)."""
    marks = list(plan.marks) if plan is not None else []
    if text_only is not None:
        marks.append((len(ids), len(text_only)))  # the prompt's end
    s.text_marks = list(dict.fromkeys(marks))  # a request matched again repeats some
    common = common_prefix_len(ids, s.token_ids)
    # at least one token must be computed to produce the next token's logits
    reuse = max(0, min(common, s.num_computed, len(ids) - 1))
    if reuse < len(s.token_ids):
        s.text = ""  # the text stood for tokens we no longer keep
    s.priority = priority
    reuse = truncate_kv(p, s, reuse)  # less when a shared half block cannot be copied
    s.token_ids = ids[:reuse]
    own = reuse
    chain = p.sharing.chain_for(s, ids, reuse)
    if chain:
        persisted = min(s.num_persisted, reuse)
        drop_kv(p, s)
        reuse = p.sharing.adopt(s, ids, chain)
        s.num_persisted, s.version = persisted, p.next_version()
    if reuse:
        s.hits += 1
    via_text = plan is not None and plan.via_text
    return Prepared(token_ids=ids, num_cached=reuse, num_shared=reuse - own, via_text=via_text)
