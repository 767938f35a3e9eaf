"""Admission waits for a running request that is computing the same prompt prefix.

Agents of one deployment send one system prompt (thousands of tokens) and their first turns
arrive together. The block index shares a prompt's full blocks once a step has computed them
(sched/writeback.py offers them as it settles the step), but a prompt admitted while another
is still computing that prefix finds none of it and computes it again, beside the first:
32 / 64 agents' first turns (a ~2.5k-token shared prefix) computed it ~7 / ~13 times on an
H100 with the default 2,048-token step, once per agent with 4,096 (docs/BENCHMARKS.md, run
I), and every copy is prompt work the other prompts and the decoders wait behind.

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


def may_lead(r: Seq, min_shared: int = MIN_SHARED) -> bool:
    """r runs and has at least min_shared tokens of its prompt still to offer: a build
    looks for leaders among these only (few: the prompts being prefilled)."""
    return r.state is State.RUNNING and len(r.prompt_ids) - r.offered > min_shared


def known_tokens(seq: Seq) -> Sequence[int] | None:
    """seq's prompt tokens from position 0, where they are known before admission and no
    session KV of its own can cover their start."""
    req = seq.req
    if req.prompt_ids is not None:
        return req.prompt_ids if req.session_id is None else None
    return seq.pieces.ids_at(0) if seq.pieces is not None else None


def leader(
    seq: Seq, leaders: Sequence[Seq], block_size: int, min_shared: int = MIN_SHARED
) -> Seq | None:
    """The request among `leaders` (running ones that `may_lead`) computing a prefix of
    seq's prompt, >= min_shared tokens of whole blocks it has not offered yet, that seq
    should wait for; None: admit it now. One slice comparison per leader that could share
    that much (the prefix up to those blocks): a waiting request is asked every build."""
    tokens = known_tokens(seq)
    if tokens is None or len(tokens) <= min_shared:
        return None
    limit = len(tokens) - 1  # its last token is computed whatever is shared
    for r in leaders:
        if r.tenant != seq.tenant:
            continue
        prompt = r.prompt_ids
        # the shared blocks must reach `need` for min_shared of them to be still unoffered
        need = -(-(r.offered + min_shared) // block_size) * block_size
        if need > min(limit, len(prompt)) or prompt[:block_size] != tokens[:block_size]:
            continue
        if prompt[:need] == tokens[:need]:
            return r
    return None
