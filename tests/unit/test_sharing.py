"""Sessions sharing prefix blocks through the block index, end to end on the demo model (CPU):
what is reused, what stays private, and that every reply is exactly what a cold engine gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Request

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def engine(loaded: LoadedModel, **kw: object) -> Engine:
    kw.setdefault("kv_device_gb", 0.05)
    return Engine(EngineConfig(**kw), loaded=loaded)  # type: ignore[arg-type]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def run(e: Engine, prompt: list[int], sid: str | None, tenant: str = "t") -> tuple[list[int], int]:
    """(generated ids, cached prompt tokens) of one greedy request."""
    req = Request(tenant=tenant, session_id=sid, prompt_ids=prompt, max_tokens=6, sampling=GREEDY)
    _, out, final = e.submit(req).collect(timeout=120)
    assert final.error is None and final.usage is not None, final.error
    e.pool.check_integrity()
    return out, final.usage.cached_tokens


def cold(loaded: LoadedModel, prompt: list[int]) -> list[int]:
    e = engine(loaded)
    try:
        return run(e, prompt, None)[0]
    finally:
        e.close()


def test_sessions_share_a_system_prompt_and_reply_exactly(loaded: LoadedModel) -> None:
    system = ids(0, 100)  # 6 full blocks of 16 and 4 tokens
    a, b = system + ids(1, 20), system + ids(2, 30)
    e = engine(loaded)
    try:
        out_a, cached_a = run(e, a, "a")
        out_b, cached_b = run(e, b, "b")
        usage = e.pool.usage()
    finally:
        e.close()
    assert cached_a == 0 and cached_b == 96  # b took a's six full system blocks
    assert usage.device_blocks_indexed > 0
    assert out_a == cold(loaded, a) and out_b == cold(loaded, b)


def test_a_tenant_never_reuses_another_tenants_blocks(loaded: LoadedModel) -> None:
    prompt = ids(3, 80)
    e = engine(loaded)
    try:
        run(e, prompt, "x", tenant="a")
        out_b, cached_b = run(e, prompt, "x", tenant="b")
        _, cached_a2 = run(e, prompt, "y", tenant="a")
    finally:
        e.close()
    assert cached_b == 0  # the same tokens under another tenant: computed again
    assert cached_a2 == 64  # and the same tenant's other session does share them
    assert out_b == cold(loaded, prompt)


def test_one_session_with_two_interleaved_conversations_keeps_both(loaded: LoadedModel) -> None:
    main1, title = ids(4, 200), ids(5, 60)  # opencode: a title request under the same id
    e = engine(loaded)
    try:
        out1, _ = run(e, main1, "agent")
        run(e, title, "agent")
        main2 = main1 + out1 + ids(6, 40)
        out2, cached = run(e, main2, "agent")
        title2 = title + ids(7, 10)
        _, cached_title = run(e, title2, "agent")
    finally:
        e.close()
    assert cached >= 0.9 * len(main1), cached  # the main conversation came back warm
    assert cached_title >= 48  # and so did the title one
    assert out2 == cold(loaded, main2)


def test_a_fork_inside_a_shared_block_copies_it(loaded: LoadedModel) -> None:
    base = ids(8, 64)  # four full blocks, indexed
    fork = base[:40] + ids(9, 20)  # diverges inside block 2 (tokens 32..47)
    e = engine(loaded)
    try:
        run(e, base, "f")
        run(e, base + ids(10, 5), "other")  # a second holder of the same blocks
        out, cached = run(e, fork, "f")
        back, cached_back = run(e, base + ids(11, 3), "f")  # the old branch is still indexed
    finally:
        e.close()
    assert cached == 40  # its own 2.5 blocks: the half block was copied, not shared
    assert cached_back >= 64
    assert out == cold(loaded, fork) and back == cold(loaded, base + ids(11, 3))


def test_a_restore_shares_what_is_on_the_device(loaded: LoadedModel) -> None:
    system = ids(12, 96)
    a, b = system + ids(13, 10), system + ids(14, 10)
    e = engine(loaded)
    try:
        out_a, _ = run(e, a, "a")
        run(e, b, "b")
        e.pool.evict("t", "a", "ram")
        before = e.pool.usage().device_blocks_used
        a2 = a + out_a + ids(15, 5)
        out_a2, cached = run(e, a2, "a")
        after = e.pool.usage()
    finally:
        e.close()
    assert cached == len(a) + len(out_a) - 1  # everything the session had
    assert after.device_blocks_used - before <= 3  # the system blocks were b's, not copies
    assert out_a2 == cold(loaded, a2)
