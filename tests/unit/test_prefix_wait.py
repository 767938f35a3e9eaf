"""Prompts that arrive together with one long shared prefix (agents' first turns with one
system prompt): the later ones wait for the first to index it instead of computing it again
beside it (sched/prefix_wait.py). Demo model, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.prefix_wait import MIN_SHARED, leader, may_lead
from ds4pool.sched.pretokenize import PromptPieces
from ds4pool.sched.request import Request, RequestStream, State
from ds4pool.sched.seq import Seq
from tests.unit.test_sharing import GREEDY, engine, ids

BS = 16


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def together(e: Engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Submitted at once (one build sees them all): (ids, cached tokens) of each."""
    reqs = [Request(tenant="t", prompt_ids=p, max_tokens=5, sampling=GREEDY) for p in prompts]
    streams = [e.submit(r) for r in reqs]
    out = []
    for s in streams:
        _, got, final = s.collect(timeout=120)
        assert final.error is None and final.usage is not None, final.error
        out.append((got, final.usage.cached_tokens))
    e.pool.check_integrity()
    return out


def test_prompts_arriving_together_compute_their_shared_prefix_once(
    loaded: LoadedModel,
) -> None:
    system = ids(0, 700)  # 43 full blocks and 12 tokens
    prompts = [system + ids(10 + i, 40) for i in range(4)]
    solo = []
    for p in prompts:  # each alone on a cold engine: the replies to match
        e = engine(loaded)
        try:
            [(got, cached)] = together(e, [p])
        finally:
            e.close()
        assert cached == 0
        solo.append(got)
    e = engine(loaded, max_batch_tokens=4096)  # room for all four prompts in one step
    try:
        out = together(e, prompts)
    finally:
        e.close()
    assert [got for got, _ in out] == solo  # the same replies
    # the first computes the system prompt; the others wait for it and reuse its full blocks
    assert out[0][1] == 0
    assert [cached for _, cached in out[1:]] == [700 // BS * BS] * 3


def seq(prompt: list[int], *, session: str | None = None, tenant: str = "t") -> Seq:
    req = Request(tenant=tenant, session_id=session, prompt_ids=prompt)
    return Seq(req, RequestStream(req))


def running(prompt: list[int], offered: int, tenant: str = "t") -> Seq:
    r = seq(prompt, tenant=tenant)
    r.state, r.prompt_ids, r.offered = State.RUNNING, prompt, offered
    return r


def test_who_waits_for_whom() -> None:
    system = ids(0, 600)
    lead = running(system + ids(1, 50), offered=0)
    follower = seq(system + ids(2, 50))
    assert leader(follower, [lead], BS) is lead
    # once the leader has offered all but less than MIN_SHARED of the shared blocks: admit
    lead.offered = 600 // BS * BS - MIN_SHARED + BS
    assert leader(follower, [lead], BS) is None
    lead.offered = 0
    # another tenant's blocks are not shared; a leader that stopped running releases it
    # (Room.leaders keeps only those that may_lead)
    assert leader(follower, [running(lead.prompt_ids, 0, tenant="u")], BS) is None
    lead.state = State.WAITING  # preempted
    assert not may_lead(lead)
    lead.state = State.RUNNING
    # too little in common, or tokens not known before admission: no wait
    assert leader(seq(system[:200] + ids(3, 500)), [lead], BS) is None
    assert leader(seq(system + ids(2, 50), session="s"), [lead], BS) is None  # its own KV?
    text = seq([])
    text.req.prompt_ids, text.req.prompt_text = None, "x"
    text.pieces = PromptPieces("x", lambda t: [])
    assert leader(text, [lead], BS) is None  # not tokenized yet
    text.pieces.fill(0)
    text.pieces._ids[0] = follower.req.prompt_ids  # a new session's text, tokenized ahead
    text.pieces.done.set()
    assert leader(text, [lead], BS) is lead


def test_who_may_lead() -> None:
    system = ids(0, 600)
    r = running(system, offered=0)
    assert may_lead(r)
    r.offered = 600 - MIN_SHARED  # what is left to offer is not worth a wait
    assert not may_lead(r)
    r.offered, r.state = 0, State.FINISHED
    assert not may_lead(r)


def test_a_leader_admitted_earlier_in_the_build_is_seen() -> None:
    from ds4pool.sched.admission import Room

    runs: list[Seq] = []
    room = Room(None, runs)  # type: ignore[arg-type]
    assert room.leaders() == []
    lead = running(ids(0, 600), offered=0)
    runs.append(lead)  # admitted by this build
    assert room.leaders() == [lead]
