"""SessionPool: tiers, budgets, LRU, prefix reuse, durability and faults, on the demo model."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest
import torch

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv import disk_files
from ds4pool.kv.pool import PoolObserver, SessionPool
from ds4pool.kv.session import InvalidSessionIdError, SessionBusyError
from ds4pool.kv.transfer import gather_to_host
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner
from tests.hf_models import tiny_loaded
from tests.pool_helpers import device_kv, make_pool, turn

BLOCK = 16


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=64, block_size=BLOCK)


@pytest.fixture(scope="module")
def mla_loaded() -> LoadedModel:
    """A tiny DeepSeek-V3: its cache is one latent plane per token ("mla" layout)."""
    return tiny_loaded(1024, seed=5, arch="deepseek-v3")


@pytest.fixture(params=["demo", "mla"])
def any_loaded(request: pytest.FixtureRequest, loaded: LoadedModel) -> LoadedModel:
    return loaded if request.param == "demo" else request.getfixturevalue("mla_loaded")


def ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Recorder(PoolObserver):
    def __init__(self) -> None:
        self.moves: list[tuple[str, str, str]] = []
        self.errors: list[str] = []

    def session_moved(self, src: str, dst: str, reason: str) -> None:
        self.moves.append((src, dst, reason))

    def snapshot_error(self, kind: str) -> None:
        self.errors.append(kind)


def two_turns(pool: SessionPool, runner: ModelRunner, evict: str | None, key: str = "a"):
    first, second = ids(45, 1), ids(20, 2)
    s = pool.acquire("t", key)
    turn(pool, runner, s, prompt_ids=first)
    s.release()
    if evict:
        pool.evict("t", key, evict)
        assert pool.get("t", key).tier == evict  # type: ignore[union-attr]
    s = pool.acquire("t", key)
    result = turn(pool, runner, s, prompt_ids=first + second)
    s.release()
    return result


def test_evicted_sessions_give_bitwise_identical_logits(
    any_loaded: LoadedModel, tmp_path: Path
) -> None:
    loaded = any_loaded
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    never = two_turns(make_pool(loaded, runner), runner, None)
    assert never.num_reused == 45 and never.num_computed == 20
    for tier in ("ram", "disk"):
        r = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
        pool = make_pool(loaded, r, tmp_path / tier)
        got = two_turns(pool, r, tier)
        assert got.num_reused == 45, tier
        assert torch.equal(got.logits, never.logits), tier
        pool.check_integrity()
        pool.close()


def test_kv_round_trips_the_tiers_bitwise(any_loaded: LoadedModel, tmp_path: Path) -> None:
    # device → RAM → device → disk → device → (restart) disk → device: the same bytes
    r = ModelRunner(any_loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(any_loaded, r, tmp_path)

    def restored_kv(pool: SessionPool, r: ModelRunner) -> torch.Tensor:
        """The session back on the device, read out as [L, P, T, H, D]: P = 2 (K and V) or
        1 (the MLA latent)."""
        s = pool.acquire("t", "a")
        s.restore()
        assert s.session.block_table is not None
        kv = gather_to_host(device_kv(r), s.session.block_table.blocks, s.session.num_computed)
        s.release()
        return kv.view(torch.uint8)

    s = pool.acquire("t", "a")
    turn(pool, r, s, prompt_ids=ids(45, 1))
    s.release()
    want = restored_kv(pool, r)
    assert want.shape[1] == (1 if any_loaded.config.mla else 2)
    for tier in ("ram", "disk"):
        pool.evict("t", "a", tier)
        assert torch.equal(restored_kv(pool, r), want), tier
    pool.close()
    r = ModelRunner(any_loaded, num_blocks=64, block_size=BLOCK)  # a new process, in effect
    pool = make_pool(any_loaded, r, tmp_path)
    assert torch.equal(restored_kv(pool, r), want), "restart"
    pool.check_integrity()
    pool.close()


def test_gqa_snapshots_do_not_load_into_an_mla_model(
    loaded: LoadedModel, mla_loaded: LoadedModel, tmp_path: Path
) -> None:
    for written, running in ((loaded, mla_loaded), (mla_loaded, loaded)):
        d = tmp_path / written.config.architecture
        r = ModelRunner(written, num_blocks=64, block_size=BLOCK)
        pool = make_pool(written, r, d)
        s = pool.acquire("t", "a")
        turn(pool, r, s, prompt_ids=ids(45, 1))
        s.release()
        pool.close()
        rec = Recorder()
        other = make_pool(running, ModelRunner(running, num_blocks=64, block_size=BLOCK), d, rec)
        assert other.get("t", "a") is None and rec.errors == ["fingerprint"]
        other.close()


def test_session_survives_a_restart(loaded: LoadedModel, tmp_path: Path) -> None:
    first, second = ids(45, 1), ids(20, 2)
    r1 = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(loaded, r1, tmp_path)
    s = pool.acquire("t", "agent-7")
    turn(pool, r1, s, prompt_ids=first)
    s.release()
    pool.close()  # clean shutdown flushes

    r2 = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)  # a new process, in effect
    pool2 = make_pool(loaded, r2, tmp_path)
    info = pool2.get("t", "agent-7")
    assert info is not None and info.tier == "disk" and info.num_computed == 45
    s = pool2.acquire("t", "agent-7")
    got = turn(pool2, r2, s, prompt_ids=first + second)
    s.release()
    assert got.num_reused == 45 and got.num_computed == 20

    r3 = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    never = two_turns(make_pool(loaded, r3), r3, None)
    assert torch.equal(got.logits, never.logits)
    pool2.close()


def test_text_prefix_path_reuses_tokens_across_bpe_boundary(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    tok = loaded.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    pool = make_pool(loaded, runner)
    user = {"role": "user", "content": "show the result"}
    turn1 = tok.apply_chat_template([user])
    s = pool.acquire("t", "chat")
    first = turn(pool, runner, s, prompt_text=turn1)
    # The model generated "print" as two tokens, "p" + "rint"; the canonical encoding of
    # "print" is one token. The session keeps the tokens the model really produced.
    generated = enc("p") + enc("rint")
    s.commit(first.token_ids + generated, turn1 + "print", len(first.token_ids))
    s.release()

    # Turn 2: the client re-sends the history; re-tokenizing it whole merges "print".
    turn2 = tok.apply_chat_template(
        [user, {"role": "assistant", "content": "print"}, {"role": "user", "content": "again"}]
    )
    cached = first.token_ids + generated
    assert enc(turn2)[: len(cached)] != cached, "needs a merge across the old/new boundary"
    s = pool.acquire("t", "chat")
    got = turn(pool, runner, s, prompt_text=turn2)
    s.release()
    assert got.token_ids[: len(cached)] == cached  # the exact cached tokens are kept
    # KV existed for the prompt; the generated tokens (no KV yet) and the new text are
    # computed: nothing of the history is prefilled again.
    assert got.num_reused == len(first.token_ids)
    assert got.num_computed == len(got.token_ids) - len(first.token_ids)
    assert got.token_ids[len(cached) :] == enc(turn2[len(turn1 + "print") :])


def test_token_prefix_reuse_truncates_past_divergence(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    pool = make_pool(loaded, runner)
    base = ids(40, 5)
    s = pool.acquire("t", "x")
    turn(pool, runner, s, prompt_ids=base)
    s.release()
    s = pool.acquire("t", "x")
    got = turn(pool, runner, s, prompt_ids=base[:30] + ids(10, 6))  # edited history
    s.release()
    assert got.num_reused == 30 and got.num_computed == 10
    s = pool.acquire("t", "x")
    got = turn(pool, runner, s, prompt_ids=base[:30] + ids(10, 6))  # identical prompt
    s.release()
    assert got.num_reused == 39  # all but the last token, which must be recomputed
    pool.check_integrity()


def indexed_session(pool: SessionPool, runner: ModelRunner, key: str) -> list[int]:
    """An idle session of three full blocks, every one indexed (as the scheduler offers
    them); returns its prompt."""
    base = ids(48, 1)
    s = pool.acquire("t", key)
    turn(pool, runner, s, prompt_ids=base)
    s.offer(base, [], len(base))
    s.release()
    return base


@pytest.mark.parametrize("num_blocks", [8, 64])
def test_a_fork_inside_an_indexed_block_on_a_full_device_keeps_every_token(
    loaded: LoadedModel, num_blocks: int
) -> None:
    """A prompt diverging inside the session's own indexed (full) block needs a fresh block
    for the copy-on-write. On a full device an idle session is demoted for it, as for any
    other allocation, instead of the reuse being rounded down to whole blocks (the crash
    test's rare 'cached 208, the reference 213': the same fork reused 5 tokens less than on
    a roomy device)."""
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK)
    pool = make_pool(loaded, runner)
    base = indexed_session(pool, runner, "a")
    s = pool.acquire("t", "idle")
    turn(pool, runner, s, prompt_ids=ids(80, 2))  # five blocks: with 8, the device is full
    s.release()
    s = pool.acquire("t", "a")
    got = turn(pool, runner, s, prompt_ids=base[:40] + ids(10, 3))  # diverges in block 2
    s.release()
    assert got.num_reused == 40 and got.num_computed == 10
    pool.check_integrity()
    # the old branch stays indexed: a session with the base prompt shares its three blocks
    s = pool.acquire("t", "b")
    assert s.prepare(prompt_ids=[*base, 7]).num_cached == 48
    s.release()


def test_a_fork_with_no_block_to_be_had_writes_in_place_what_only_the_index_shares(
    loaded: LoadedModel,
) -> None:
    """The same fork where nothing can be demoted (the other session is in flight): the
    diverging block, held by this session and the block index alone, is taken out of the
    index and written in place; every token of the common start is kept and the old
    branch's cached third block is what goes."""
    runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK)
    pool = make_pool(loaded, runner)
    base = indexed_session(pool, runner, "a")
    busy = pool.acquire("t", "busy")  # five blocks, held: the device is full
    turn(pool, runner, busy, prompt_ids=ids(80, 2))
    s = pool.acquire("t", "a")
    fork = base[:40] + ids(5, 3)  # diverges in block 2 and fits in three blocks
    got = turn(pool, runner, s, prompt_ids=fork)
    assert got.num_reused == 40 and got.num_computed == 5
    pool.check_integrity()
    s.release()
    busy.release()
    fresh_runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK)
    fresh = make_pool(loaded, fresh_runner)
    ref = turn(fresh, fresh_runner, fresh.acquire("t", "ref"), prompt_ids=fork)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    b = pool.acquire("t", "b")  # the first two blocks of the old branch are still indexed
    assert b.prepare(prompt_ids=[*base, 7]).num_cached == 32
    b.release()
    s = pool.acquire("t", "a")  # and the session's KV is its new prompt's
    assert s.prepare(prompt_ids=[*fork, 7]).num_cached == 45
    s.release()
    pool.check_integrity()


def test_budgets_hold_and_lru_order(loaded: LoadedModel, tmp_path: Path) -> None:
    runner = ModelRunner(loaded, num_blocks=12, block_size=BLOCK)  # room for ~4 sessions
    per_session = 40 * runner.kv_bytes // (12 * BLOCK)  # 40 tokens of KV
    rec = Recorder()
    pool = make_pool(
        loaded, runner, tmp_path, rec, ram_bytes=3 * per_session + 1, disk_bytes=20 * per_session
    )
    for i in range(60):
        s = pool.acquire("t", f"s{i}")
        turn(pool, runner, s, prompt_ids=ids(40, i))
        s.release()
        pool.check_integrity()
        usage = pool.usage()
        assert usage.device_blocks_used <= 12
        assert usage.ram_bytes <= 3 * per_session + 1
        pool.writer.drain()  # type: ignore[union-attr]
        assert pool.disk.used_bytes <= pool.disk.budget_bytes  # type: ignore[union-attr]
    usage = pool.usage()
    # The most recent sessions are on the device, the next ones in RAM, older on disk,
    # the oldest gone: LRU at every tier.
    newest = [f"s{i}" for i in range(59, 55, -1)]
    assert [pool.get("t", k).tier for k in newest] == ["device"] * 4  # type: ignore[union-attr]
    ram = {i.session_id for i in pool.list_sessions(tier="ram")}
    assert ram == {"s53", "s54", "s55"}
    assert pool.get("t", "s0") is None  # deleted from disk long ago
    assert usage.disk_sessions > 0 and ("disk", "none", "disk_full") in rec.moves
    assert ("device", "ram", "pressure") in rec.moves and ("ram", "disk", "ram_full") in rec.moves
    pool.close()


def test_in_flight_and_pinned_sessions_are_never_demoted(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK)
    pool = make_pool(loaded, runner, tmp_path)
    busy = pool.acquire("t", "busy")
    turn(pool, runner, busy, prompt_ids=ids(40, 1))  # 3 blocks, still in flight
    s = pool.acquire("t", "pinned")
    turn(pool, runner, s, prompt_ids=ids(40, 2))
    s.release()
    pool.set_pinned("t", "pinned", True)
    other = pool.acquire("t", "other")
    with pytest.raises(OutOfBlocksError, match="in flight or pinned"):
        turn(pool, runner, other, prompt_ids=ids(40, 3))  # needs 3, only 2 free
    assert pool.get("t", "busy").tier == "device"  # type: ignore[union-attr]
    assert pool.get("t", "pinned").tier == "device"  # type: ignore[union-attr]
    other.release()
    pool.set_pinned("t", "pinned", False)
    other = pool.acquire("t", "other")
    turn(pool, runner, other, prompt_ids=ids(40, 3))  # now the unpinned one can go
    assert pool.get("t", "pinned").tier == "ram"  # type: ignore[union-attr]
    other.release()
    busy.release()
    pool.check_integrity()
    pool.close()


def test_a_second_request_waits_then_times_out(loaded: LoadedModel, runner: ModelRunner) -> None:
    pool = make_pool(loaded, runner)
    s = pool.acquire("t", "one")
    with pytest.raises(SessionBusyError, match="busy"):
        pool.acquire("t", "one", timeout=0.05)
    s.release()
    pool.acquire("t", "one", timeout=0.05).release()
    # Same id, other tenant: a different session, not busy.
    pool.acquire("u", "one", timeout=0.05).release()
    assert {(i.tenant, i.session_id) for i in pool.list_sessions()} == {("t", "one"), ("u", "one")}


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 129, "naïve", "a b", "~eph", "\x00"])
def test_invalid_session_ids(loaded: LoadedModel, runner: ModelRunner, bad: str) -> None:
    pool = make_pool(loaded, runner)
    with pytest.raises(InvalidSessionIdError, match="invalid session id"):
        pool.acquire("t", bad)


def test_corrupt_snapshot_is_quarantined_and_session_starts_fresh(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    for damage in ("flip", "truncate"):
        d = tmp_path / damage
        runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
        pool = make_pool(loaded, runner, d)
        s = pool.acquire("t", "a")
        turn(pool, runner, s, prompt_ids=ids(45, 1))
        s.release()
        pool.close()
        [snap] = d.glob("*.snap")
        data = bytearray(snap.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            data = data[: len(data) - 100]
        snap.write_bytes(bytes(data))
        rec = Recorder()
        pool2 = make_pool(loaded, runner, d, rec)
        s = pool2.acquire("t", "a")
        got = turn(pool2, runner, s, prompt_ids=ids(45, 1))
        s.release()
        assert got.num_reused == 0, damage  # nothing corrupt was loaded
        assert rec.errors, damage
        assert list((d / "quarantine").glob("*.snap.*.reason")), damage
        pool2.close()


def test_snapshot_of_another_model_is_rejected(loaded: LoadedModel, tmp_path: Path) -> None:
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(loaded, runner, tmp_path)
    s = pool.acquire("t", "a")
    turn(pool, runner, s, prompt_ids=ids(45, 1))
    s.release()
    pool.close()
    other = LoadedModel(**{**loaded.__dict__, "weights_id": "another-model"})
    pool2 = make_pool(other, runner, tmp_path)
    assert pool2.get("t", "a") is None  # never indexed
    assert list((tmp_path / "quarantine").glob("*.snap.*.reason"))
    pool2.close()


def test_disk_full_keeps_serving_and_keeps_the_session_in_ram(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    rec = Recorder()
    pool = make_pool(loaded, runner, tmp_path, rec)

    def disk_full(f, snapshot, **kw):  # type: ignore[no-untyped-def]
        f.write(b"x" * 100)  # part of the file gets out, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    s = pool.acquire("t", "a")
    turn(pool, runner, s, prompt_ids=ids(45, 1))
    s.release()
    monkeypatch.setattr(disk_files, "write_snapshot", disk_full)
    pool.evict("t", "a", "ram")  # write-behind persistence fails in the writer thread
    pool.writer.drain()  # type: ignore[union-attr]
    monkeypatch.undo()
    assert "write" in rec.errors
    assert pool.get("t", "a").tier == "ram"  # type: ignore[union-attr]
    assert not list(tmp_path.glob("*.snap")) and not list(tmp_path.glob(".*.tmp"))
    s = pool.acquire("t", "a")
    got = turn(pool, runner, s, prompt_ids=ids(45, 1) + ids(5, 2))  # still serving
    s.release()
    assert got.num_reused == 45
    pool.close()
    assert list(tmp_path.glob("*.snap"))  # written once the disk had room again


def test_write_behind_triggers_and_drop(loaded: LoadedModel, tmp_path: Path) -> None:
    import time

    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(loaded, runner, tmp_path, persist_idle_s=0.2, persist_every_tokens=40)
    s = pool.acquire("t", "big")
    turn(pool, runner, s, prompt_ids=ids(45, 1))  # 45 new tokens >= 40: persisted at release
    s.release()
    s = pool.acquire("t", "small")
    turn(pool, runner, s, prompt_ids=ids(10, 2))  # below the token trigger
    s.release()
    pool.writer.drain()  # type: ignore[union-attr]
    assert pool.get("t", "big").persisted_tokens == 45  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while pool.get("t", "small").persisted_tokens != 10:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "idle session never persisted"
        time.sleep(0.05)
    assert len(list(tmp_path.glob("*.snap"))) == 2
    # drop: gone from every tier, file included
    pool.drop("t", "big")
    assert pool.get("t", "big") is None
    assert len(list(tmp_path.glob("*.snap"))) == 1
    s = pool.acquire("t", "big")  # the id is free again, as a fresh session
    assert turn(pool, runner, s, prompt_ids=ids(45, 1)).num_reused == 0
    s.release()
    pool.check_integrity()
    pool.close()


def test_flush_and_usage(loaded: LoadedModel, tmp_path: Path) -> None:
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(loaded, runner, tmp_path, persist_idle_s=0, persist_every_tokens=0)
    for i in range(3):
        s = pool.acquire("t", f"s{i}")
        turn(pool, runner, s, prompt_ids=ids(20, i))
        s.release()
    assert not list(tmp_path.glob("*.snap"))  # no trigger fired
    assert pool.flush() == 3
    assert len(list(tmp_path.glob("*.snap"))) == 3
    assert pool.flush() == 0  # nothing changed since
    pool.evict("t", "s0", "ram")
    pool.evict("t", "s1", "disk")
    u = pool.usage()
    assert (u.device_sessions, u.ram_sessions, u.disk_sessions) == (1, 1, 1)
    assert u.device_blocks_used == 2 and u.ram_bytes == 20 * pool.kv_bytes_per_token
    assert u.disk_bytes > 0
    pool.close()
