"""Admission waits for a running request that is computing the same prompt prefix.

Agents of one deployment send one system prompt (thousands of tokens) and their first turns
arrive together. The block index shares a prompt's full blocks once a step has computed them
(sched/writeback.py offers them as it settles the step), but a prompt admitted while another
is still computing that prefix finds none of it and computes it again, beside the first:
32 agents' first turns (2,400-token system prompt) computed it ~9 times on an H100 with a
2,048-token step, 64 agents' ~50 times with 4,096 (docs/BENCHMARKS.md, run I), and every
copy is prompt work the other prompts and the decoders wait behind.

A waiting request whose tokens are known before admission (given as ids without a session,
or a text prompt tokenized from its start: a new session) and that shares at least
`min_shared` tokens of whole blocks with a running request's prompt beyond what that request
has offered to the index yet waits in the queue, holding nothing, until they are offered;
its admission then matches them like any cached prefix. The leader runs, so it gets there
(its chunks come before admissions); a leader that stops running (finished, preempted,
cancelled) releases its followers at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from ds4pool.sched.request import State
from ds4pool.sched.seq import Seq

MIN_SHARED = 256  # tokens: a shorter shared part is not worth a step's wait


def shared_len(a: Sequence[int], b: Sequence[int], block_size: int, limit: int) -> int:
    """Tokens of whole blocks at the start of a and b that are equal, at most `limit`."""
    n = 0
    while n + block_size <= limit and a[n : n + block_size] == b[n : n + block_size]:
        n += block_size
    return n


def known_tokens(seq: Seq) -> Sequence[int] | None:
    """seq's prompt tokens from position 0, where they are known before admission and no
    session KV of its own can cover their start."""
    req = seq.req
    if req.prompt_ids is not None:
        return req.prompt_ids if req.session_id is None else None
    return seq.pieces.ids_at(0) if seq.pieces is not None else None


def leader(
    seq: Seq, running: Sequence[Seq], block_size: int, min_shared: int = MIN_SHARED
) -> Seq | None:
    """The running request computing a prefix of seq's prompt (>= min_shared tokens not
    offered yet), which seq should wait for; None: admit it now."""
    tokens = known_tokens(seq)
    if tokens is None or len(tokens) <= min_shared:
        return None
    limit = len(tokens) - 1  # its last token is computed whatever is shared
    for r in running:
        if r.state is not State.RUNNING or r.tenant != seq.tenant or r.offered > limit:
            continue
        prompt = r.prompt_ids
        if prompt[:block_size] != tokens[:block_size]:
            continue
        shared = shared_len(tokens, prompt, block_size, min(limit, len(prompt)))
        if shared - r.offered >= min_shared:
            return r
    return None
