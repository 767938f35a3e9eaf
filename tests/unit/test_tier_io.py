"""Tier I/O off the step path: spills through the writer thread, drops that never wait for a
write, snapshot reads ahead of the request, and no lost or stale KV when they race."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.pool import SessionPool
from ds4pool.kv.session import SessionBusyError, SessionNotFoundError
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.sched.request import Request
from tests.pool_helpers import make_pool, turn

BLOCK = 16
SESSION_BYTES = 45 * 4096  # the demo model: 4 KiB of fp32 KV per token


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=64, block_size=BLOCK)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class Gate:
    """Holds every disk write of a tier until opened (a slow disk, deterministically)."""

    def __init__(self, disk: DiskTier) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        write = disk.write

        def gated(snapshot):  # type: ignore[no-untyped-def]
            self.entered.set()
            assert self.opened.wait(30), "a write was held for 30 s"
            return write(snapshot)

        disk.write = gated  # type: ignore[method-assign]


def returns_while_held(fn: Callable[[], object], timeout: float = 10.0) -> None:
    """fn() finishes on another thread while the gate stays closed."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), "the call waited for a disk write"
    if errors:
        raise errors[0]


def prefill(pool: SessionPool, runner: ModelRunner, key: str, prompt: list[int]) -> torch.Tensor:
    s = pool.acquire("t", key)
    try:
        return turn(pool, runner, s, prompt_ids=prompt).logits
    finally:
        s.release()


def test_ram_overflow_spills_through_the_writer_and_stays_restorable(
    loaded: LoadedModel, runner: ModelRunner, tmp_path: Path
) -> None:
    reference = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    expected = prefill(make_pool(loaded, reference), reference, "a", ids(45, 1) + ids(20, 2))
    pool = make_pool(loaded, runner, tmp_path, ram_bytes=SESSION_BYTES + 1)
    assert pool.disk is not None
    gate = Gate(pool.disk)
    prefill(pool, runner, "a", ids(45, 1))
    prefill(pool, runner, "b", ids(45, 3))
    prefill(pool, runner, "c", ids(45, 4))
    pool.evict("t", "a", "ram")  # write-behind of a starts and is held
    assert gate.entered.wait(10)
    # b into RAM pushes a out of the LRU, c pushes b: both spill, nobody waits for the disk
    returns_while_held(lambda: pool.evict("t", "b", "ram"))
    returns_while_held(lambda: pool.evict("t", "c", "ram"))
    assert [pool.get("t", k).tier for k in "abc"] == ["ram"] * 3  # type: ignore[union-attr]
    assert pool.usage().ram_bytes <= SESSION_BYTES + 1
    pool.check_integrity()
    # the spilling copy is restorable as it is: a's next turn reuses all 45 tokens
    s = pool.acquire("t", "a")
    got = turn(pool, runner, s, prompt_ids=ids(45, 1) + ids(20, 2))
    s.release()
    assert got.num_reused == 45
    assert torch.allclose(got.logits, expected, atol=1e-4)
    gate.opened.set()
    assert pool.writer is not None and pool.writer.drain()
    pool.check_integrity()
    # b's spill landed: only its index entry stays; a went up, c is in the LRU
    assert [pool.get("t", k).tier for k in "abc"] == ["device", "disk", "ram"]  # type: ignore[union-attr]
    s = pool.acquire("t", "b")
    assert turn(pool, runner, s, prompt_ids=ids(45, 3) + [7]).num_reused == 45
    s.release()
    pool.close()


def test_a_drop_never_waits_for_a_write_and_is_never_resurrected(
    loaded: LoadedModel, runner: ModelRunner, tmp_path: Path
) -> None:
    pool = make_pool(loaded, runner, tmp_path)
    assert pool.disk is not None
    gate = Gate(pool.disk)
    prefill(pool, runner, "a", ids(45, 1))
    prefill(pool, runner, "keep", ids(45, 2))
    pool.evict("t", "a", "ram")  # its write-behind snapshot is being written
    assert gate.entered.wait(10)
    returns_while_held(lambda: pool.drop("t", "a"))
    assert pool.get("t", "a") is None
    gate.opened.set()
    assert pool.writer is not None and pool.writer.drain()
    assert not pool.disk.path_for("t", "a").exists()
    pool.close()
    again = make_pool(loaded, ModelRunner(loaded, num_blocks=64, block_size=BLOCK), tmp_path)
    assert [i.session_id for i in again.list_sessions()] == ["keep"]
    again.close()


def test_a_disk_session_is_read_ahead_not_on_the_step_thread(
    loaded: LoadedModel, runner: ModelRunner, tmp_path: Path
) -> None:
    pool = make_pool(loaded, runner, tmp_path)
    assert pool.disk is not None
    prefill(pool, runner, "ref", ids(45, 1))
    expected = prefill(pool, runner, "ref", ids(45, 1) + ids(20, 2))  # never left the device
    prefill(pool, runner, "a", ids(45, 1))
    pool.evict("t", "a", "disk")
    assert pool.get("t", "a").tier == "disk"  # type: ignore[union-attr]
    readers: list[str] = []
    read = pool.disk.read

    def recorded(tenant: str, session_id: str):  # type: ignore[no-untyped-def]
        readers.append(threading.current_thread().name)
        return read(tenant, session_id)

    pool.disk.read = recorded  # type: ignore[method-assign]
    assert pool.prefetch("t", "a")
    assert pool.prefetcher.drain()
    assert not pool.prefetch("t", "a")  # done: read, and placed on the device (free blocks)
    assert pool.get("t", "a").tier == "device"  # type: ignore[union-attr]
    s = pool.acquire("t", "a")
    got = turn(pool, runner, s, prompt_ids=ids(45, 1) + ids(20, 2))
    s.release()
    assert got.num_reused == 45 and torch.equal(got.logits, expected)
    assert readers == ["ds4pool-prefetch"]
    pool.check_integrity()
    pool.close()


def test_the_step_thread_admits_a_disk_session_after_its_read_ahead(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    def run(e: Engine, prompt: str) -> list[int]:
        stream = e.submit(Request(session_id="s", prompt_text=prompt, max_tokens=6))
        return [t for ev in stream for t in ev.token_ids]

    first, second = "one two three four five six", " and seven eight nine"
    e = Engine(EngineConfig(kv_device_gb=0.01, kv_disk_dir=tmp_path / "a"), loaded=loaded)
    baseline = [run(e, first), run(e, first + second)]
    e.close()
    e = Engine(EngineConfig(kv_device_gb=0.01, kv_disk_dir=tmp_path / "b"), loaded=loaded)
    try:
        out = [run(e, first)]
        e.pool.evict("default", "s", "disk")
        assert e.pool.disk is not None
        readers: list[str] = []
        read = e.pool.disk.read

        def recorded(tenant: str, session_id: str):  # type: ignore[no-untyped-def]
            readers.append(threading.current_thread().name)
            return read(tenant, session_id)

        e.pool.disk.read = recorded  # type: ignore[method-assign]
        out.append(run(e, first + second))
        assert out == baseline  # same completions as a server that never evicted
        assert readers == ["ds4pool-prefetch"]
    finally:
        e.close()


def test_concurrent_demote_restore_and_drop_lose_nothing(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """Turns, evictions (RAM and disk, with RAM overflow spills), read-aheads and drops race
    on six sessions. Every turn's logits match a from-scratch prefill of its prompt (no
    stale or lost KV), and after a restart exactly the sessions not dropped come back, each
    with its newest tokens."""
    runner = ModelRunner(loaded, num_blocks=24, block_size=BLOCK)  # ~5 sessions of 70 tokens
    reference = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    pool = make_pool(loaded, runner, tmp_path, ram_bytes=2 * SESSION_BYTES)
    keys = [f"s{i}" for i in range(6)]
    book_lock = threading.Lock()
    tokens: dict[str, list[int]] = {}  # what each live session holds after its last turn
    failures: list[str] = []
    stop = threading.Event()

    def turns() -> None:
        rng = random.Random(1)
        for n in range(24):
            key = rng.choice(keys)
            pool.prefetch("t", key)
            s = pool.acquire("t", key)
            try:
                with book_lock:
                    prev = tokens.get(key, [])
                    # grows by 8, or goes back to a 20-token prefix (truncation) past 50
                    prompt = (prev if len(prev) < 50 else prev[:20]) + ids(8, n)
                got = turn(pool, runner, s, prompt_ids=prompt)
                with book_lock:
                    tokens[key] = prompt
            finally:
                s.release()
            want = reference.step([SeqInput(prompt, 0, list(range(5)))], return_logits=True)
            assert want.logits is not None
            if not torch.allclose(got.logits, want.logits[0], atol=1e-4):
                failures.append(f"turn {n} of {key}: logits differ (reused {got.num_reused})")
        stop.set()

    def admin(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            key = rng.choice(keys)
            try:
                if rng.random() < 0.25:
                    with book_lock:
                        pool.drop("t", key)
                        tokens.pop(key, None)
                else:
                    pool.evict("t", key, rng.choice(("ram", "disk")))
            except (SessionBusyError, SessionNotFoundError):
                pass
            stop.wait(0.01)

    threads = [threading.Thread(target=turns)] + [
        threading.Thread(target=admin, args=(seed,)) for seed in (2, 3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    pool.check_integrity()
    pool.close()
    again = make_pool(loaded, ModelRunner(loaded, num_blocks=24, block_size=BLOCK), tmp_path)
    assert {i.session_id for i in again.list_sessions()} == set(tokens)
    for key, prompt in tokens.items():
        s = again.acquire("t", key)
        m = s.prepare(prompt_ids=prompt + [5])
        assert m.num_cached == len(prompt), key  # the newest snapshot, whole
        s.release()
    again.close()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    leaked = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {n for n in leaked if n.startswith("ds4pool-")}, leaked


def test_a_disk_session_with_no_ram_tier_gets_its_second_turn(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """--kv-ram-gb 0: a read ahead can never stick in RAM (the session does not fit), so
    the request must not wait for bring-ups over and over: the step thread reads it."""

    def run(e: Engine, prompt: str) -> list[int]:
        stream = e.submit(Request(session_id="s", prompt_text=prompt, max_tokens=6))
        text, ids, final = stream.collect(timeout=30)
        assert final.error is None, final.error
        return ids

    first, second = "one two three four five six", " and seven eight nine"
    e = Engine(EngineConfig(kv_device_gb=0.01, kv_disk_dir=tmp_path / "a"), loaded=loaded)
    baseline = [run(e, first), run(e, first + second)]
    e.close()
    cfg = EngineConfig(kv_device_gb=0.01, kv_ram_gb=0, kv_disk_dir=tmp_path / "b")
    e = Engine(cfg, loaded=loaded)
    try:
        out = [run(e, first)]
        e.pool.evict("default", "s", "disk")
        out.append(run(e, first + second))  # waited forever before the fix
        assert out == baseline
        e.pool.check_integrity()
    finally:
        e.close()
