"""SessionLease: the scheduler's handle on a session (prepare, reserve, commit, rollback,
release), and prompt text tokenized off the pool lock and off the step thread."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.lease import BlocksNeverFitError
from ds4pool.kv.pool import SessionPool
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner
from ds4pool.sched.request import Request
from tests.pool_helpers import make_pool, turn

BLOCK = 16


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=24, block_size=BLOCK)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def lock_is_free(pool: SessionPool) -> bool:
    """Neither this thread nor another holds the pool lock now."""
    lock = pool._lock
    if lock._is_owned():  # type: ignore[attr-defined]
        return False
    free: list[bool] = []

    def probe() -> None:
        free.append(lock.acquire(blocking=False))
        if free[0]:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return free[0]


def test_prompt_text_is_tokenized_outside_the_pool_lock(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    pool = make_pool(loaded, runner)
    tok = loaded.tokenizer
    calls: list[bool] = []

    def tokenize(text: str) -> list[int]:
        calls.append(lock_is_free(pool))
        return tok.encode(text, add_special_tokens=False)

    user = {"role": "user", "content": "list the files"}
    turn1 = tok.apply_chat_template([user])
    turn2 = tok.apply_chat_template(
        [user, {"role": "assistant", "content": "ls"}, {"role": "user", "content": "again"}]
    )
    edited = tok.apply_chat_template([{"role": "user", "content": "list the dirs"}])
    for text in (turn1, turn2, edited):  # new, text extension, diverged text
        lease = pool.acquire("t", "chat")
        m = lease.prepare(prompt_text=text, tokenize=tokenize)
        lease.restore()
        lease.reserve(len(m.token_ids))
        lease.commit(m.token_ids, text, len(m.token_ids))
        lease.release()
        pool.check_integrity()
    assert calls == [True, True, True]


def test_rollback_returns_to_the_state_prepare_left(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    pool = make_pool(loaded, runner)
    first = ids(40, 1)
    lease = pool.acquire("t", "a")
    turn(pool, runner, lease, prompt_ids=first)
    lease.release()

    lease = pool.acquire("t", "a")
    m = lease.prepare(prompt_ids=first + ids(30, 2))
    assert m.num_cached == 40 and m.num_shared == 0
    lease.restore()
    lease.reserve(len(m.token_ids))
    lease.commit(m.token_ids + [7, 8], "", len(m.token_ids))  # a step ran, then failed
    lease.rollback()
    lease.release()
    info = pool.get("t", "a")
    assert info is not None and info.num_tokens == info.num_computed == 40
    pool.check_integrity()

    lease = pool.acquire("t", "a")  # the next turn still reuses the first one whole
    assert lease.prepare(prompt_ids=first + [9]).num_cached == 40
    lease.release()


def test_reserve_tells_never_fits_from_held_by_others(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    pool = make_pool(loaded, runner)  # 24 blocks of 16 tokens
    busy = pool.acquire("t", "busy")
    turn(pool, runner, busy, prompt_ids=ids(20 * BLOCK, 1))  # 20 blocks, still leased
    lease = pool.acquire("t", "other")
    m = lease.prepare(prompt_ids=ids(5 * BLOCK, 2))
    lease.restore()
    with pytest.raises(OutOfBlocksError) as held:
        lease.reserve(len(m.token_ids))  # 5 blocks, 4 free: the running one holds the rest
    assert not isinstance(held.value, BlocksNeverFitError)
    with pytest.raises(BlocksNeverFitError, match="the device pool has 24"):
        lease.reserve(25 * BLOCK)
    busy.release()
    lease.reserve(len(m.token_ids))  # the idle one is demoted to make room
    assert len(lease.table().block_ids) == 5
    lease.release()
    pool.check_integrity()


def test_a_lease_is_dead_after_release(loaded: LoadedModel, runner: ModelRunner) -> None:
    pool = make_pool(loaded, runner)
    lease = pool.acquire("t", "a")
    lease.release()
    with pytest.raises(AssertionError, match="after release"):
        lease.prepare(prompt_ids=[5, 6, 7])
    pool.acquire("t", "a", timeout=0.05).release()  # the session itself is free


class WorkerThreadTokenizer:
    """The demo tokenizer, recording the threads its encode() runs on."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.threads: list[str] = []

    def encode(self, text: str, **kw: object) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self._inner.encode(text, **kw)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_the_step_thread_never_tokenizes_a_prompt(loaded: LoadedModel) -> None:
    """A long text prompt and its session's next turn are tokenized before admission (the
    pretokenize thread), so decoding sessions never wait for a prompt's BPE; the text
    extension still reuses the whole first turn."""
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded)
    try:
        tok = WorkerThreadTokenizer(loaded.tokenizer)
        e.scheduler.tokenizer = tok  # type: ignore[assignment]
        body = " ".join(f"line {j} of the file" for j in range(300))
        user = {"role": "user", "content": body}
        text1 = loaded.tokenizer.apply_chat_template([user])
        _, _, first = e.submit(Request(session_id="long", prompt_text=text1, max_tokens=4)).collect(
            timeout=120
        )
        assert first.error is None and first.usage is not None
        text2 = loaded.tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        )
        _, _, second = e.submit(
            Request(session_id="long", prompt_text=text2, max_tokens=4)
        ).collect(timeout=120)
        assert second.error is None and second.usage is not None
        assert second.usage.cached_tokens >= first.usage.prompt_tokens
        assert tok.threads and "ds4pool-worker" not in tok.threads, tok.threads
        assert set(tok.threads) == {"ds4pool-tokenize"}
    finally:
        e.close()


def test_a_disk_sessions_next_turn_is_tokenized_after_its_read_ahead(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """The session's tokens are on disk when its next turn arrives: the pretokenize thread
    waits for the read-ahead, then tokenizes only the new text (the step thread nothing)."""
    e = Engine(EngineConfig(kv_device_gb=0.05, kv_disk_dir=tmp_path), loaded=loaded)
    try:
        tok = WorkerThreadTokenizer(loaded.tokenizer)
        e.scheduler.tokenizer = tok  # type: ignore[assignment]
        user = {"role": "user", "content": " ".join(f"step {j}" for j in range(200))}
        text1 = loaded.tokenizer.apply_chat_template([user])
        _, _, first = e.submit(Request(session_id="cold", prompt_text=text1, max_tokens=4)).collect(
            timeout=120
        )
        assert first.error is None and first.usage is not None
        assert e.pool.evict("default", "cold", "disk").tier == "disk"
        tok.threads.clear()
        text2 = loaded.tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
        )
        _, _, second = e.submit(
            Request(session_id="cold", prompt_text=text2, max_tokens=4)
        ).collect(timeout=120)
        assert second.error is None and second.usage is not None
        assert second.usage.cached_tokens >= first.usage.prompt_tokens
        assert tok.threads == ["ds4pool-tokenize"]  # one piece: the new text only
    finally:
        e.close()
