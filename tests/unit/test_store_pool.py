"""Two session pools (replicas) over one shared store: a session moves between them through
the store, with the same logits as if it never moved; a live foreign lease keeps a replica
from writing; a lease that moved back makes a replica drop its stale copy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ds4pool.kv.pool import PoolObserver, SessionPool
from ds4pool.model.device import select_device
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner
from tests.pool_helpers import make_pool, turn

BLOCK = 16


class Recorder(PoolObserver):
    def __init__(self) -> None:
        self.claims: list[str] = []
        self.foreign = 0
        self.io: dict[str, int] = {"read": 0, "write": 0}

    def lease_claimed(self, claim: str) -> None:
        self.claims.append(claim)

    def foreign_restored(self) -> None:
        self.foreign += 1

    def store_io(self, op: str, num_bytes: int) -> None:
        self.io[op] += num_bytes


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), select_device("cpu"), torch.float32)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def serve(pool: SessionPool, prompt: list[int], sid: str = "agent-1"):  # noqa: ANN201
    pool.open_from_store("t", sid)
    s = pool.acquire("t", sid)
    got = turn(pool, pool_runner(pool), s, prompt_ids=prompt)
    s.release()
    return got


_RUNNERS: dict[int, ModelRunner] = {}  # each replica's runner, by its pool (test-local)


def pool_runner(pool: SessionPool) -> ModelRunner:
    return _RUNNERS[id(pool)]


def make_replica(loaded: LoadedModel, store: Path, name: str, ttl: float = 30.0) -> SessionPool:
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    pool = make_pool(loaded, runner, store, Recorder(), replica_id=name, lease_ttl_s=ttl)
    _RUNNERS[id(pool)] = runner
    return pool


def test_a_session_moves_to_another_replica_through_the_store(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    first, second = ids(45, 1), ids(20, 2)
    a = make_replica(loaded, tmp_path, "a", ttl=0.2)
    serve(a, first)
    assert a.flush() == 1  # persisted under a's lease
    a.close()  # releases the lease: b takes the session at once
    b = make_replica(loaded, tmp_path, "b")
    assert b.get("t", "agent-1") is None  # b indexes only its own snapshots
    got = serve(b, first + second)
    assert got.num_reused == 45 and got.num_computed == 20
    rec = b.observer
    assert isinstance(rec, Recorder)
    assert rec.foreign == 1 and rec.io["read"] > 0 and rec.claims[0] == "acquired"

    lone = make_replica(loaded, tmp_path / "alone", "z")
    serve(lone, first)  # the same two turns on one replica (the same chunks: bitwise equal)
    never = serve(lone, first + second)
    assert torch.equal(got.logits, never.logits)
    for p in (b, lone):
        p.close()


def test_a_live_foreign_lease_means_serve_without_persisting(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    prompt = ids(40, 3)
    a = make_replica(loaded, tmp_path, "a")
    b = make_replica(loaded, tmp_path, "b")
    serve(a, prompt)
    a.flush()
    before = a.disk.path_for("t", "agent-1").read_bytes()  # type: ignore[union-attr]
    got = serve(b, prompt + ids(10, 4))  # a still holds the lease: b reads a's snapshot
    assert got.num_reused == 40
    assert b.flush() == 0  # b writes nothing over a's session
    assert a.disk.path_for("t", "agent-1").read_bytes() == before  # type: ignore[union-attr]
    assert "foreign" in b.observer.claims  # type: ignore[attr-defined]
    a.close()
    b.close()


def test_a_lease_taken_over_after_expiry_replaces_the_stale_local_copy(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    t1, t2, t3 = ids(32, 5), ids(16, 6), ids(16, 7)
    a = make_replica(loaded, tmp_path, "a", ttl=0.05)
    b = make_replica(loaded, tmp_path, "b", ttl=0.05)
    serve(a, t1)
    a.flush()
    time.sleep(0.2)  # a's lease runs out (a stopped using the session)
    got = serve(b, t1 + t2)  # b takes over, restores a's snapshot, extends it
    assert got.num_reused == 32
    assert b.flush() == 1
    assert "taken_over" in b.observer.claims  # type: ignore[attr-defined]
    time.sleep(0.2)
    # back on a: its own copy (32 tokens) is stale; it must load b's 48-token snapshot
    back = serve(a, t1 + t2 + t3)
    assert back.num_reused == 48 and back.num_computed == 16
    a.close()
    b.close()


def test_store_metrics_count_takeovers_foreign_restores_bytes_and_errors(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    from ds4pool.metrics import Metrics

    def value(m: Metrics, name: str, **labels: str) -> float:
        got = m.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got

    ma, mb = Metrics(), Metrics()
    runners = [ModelRunner(loaded, num_blocks=64, block_size=BLOCK) for _ in range(2)]
    a = make_pool(
        loaded, runners[0], tmp_path, ma.pool_observer(), replica_id="a", lease_ttl_s=0.05
    )
    b = make_pool(
        loaded, runners[1], tmp_path, mb.pool_observer(), replica_id="b", lease_ttl_s=0.05
    )
    _RUNNERS[id(a)], _RUNNERS[id(b)] = runners
    prompt = ids(40, 8)
    serve(a, prompt)
    a.flush()
    written = value(ma, "ds4pool_store_bytes_total", op="write")
    assert written == a.disk.info("t", "agent-1").num_bytes  # type: ignore[union-attr]
    time.sleep(0.2)
    serve(b, prompt + ids(8, 9))
    assert value(mb, "ds4pool_store_lease_claims_total", result="taken_over") == 1
    assert value(mb, "ds4pool_store_foreign_restores_total") == 1
    assert value(mb, "ds4pool_store_bytes_total", op="read") == written
    # a lease the store cannot read (here: a file where its directory should be)
    a.tiers.store.leases.path_for("t", "other").write_text("x")  # type: ignore[union-attr]
    a.open_from_store("t", "other")
    assert value(ma, "ds4pool_store_errors_total", kind="lease") == 1
    a.close()
    b.close()
