"""The shared snapshot store: lease files (claim, renew, foreign, take over, release, races)
and replica-mode disk tiers sharing one directory (own index, adopt on a miss, eviction that
never deletes another replica's file)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import DirectoryLockedError
from ds4pool.kv.store import SharedStore, list_store
from ds4pool.kv.store_lease import Claim, LeaseStore, validate_replica_id
from tests.unit.test_disk_tier import FP, same, snap


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def leases(tmp_path: Path, clock: Clock, *names: str, ttl: float = 30.0) -> list[LeaseStore]:
    return [LeaseStore(tmp_path, n, ttl, clock) for n in names]


def test_claim_renew_foreign_and_take_over_after_expiry(tmp_path: Path) -> None:
    clock = Clock()
    a, b = leases(tmp_path, clock, "a", "b")
    first = a.claim("t", "s1")
    assert (first.claim, first.holder, first.previous) == (Claim.ACQUIRED, "a", None)
    assert a.claim("t", "s1").claim is Claim.RENEWED
    seen = b.claim("t", "s1")
    assert (seen.claim, seen.holder, seen.mine) == (Claim.FOREIGN, "a", False)
    clock.now += 29.0
    assert b.claim("t", "s1").claim is Claim.FOREIGN  # still live
    clock.now += 2.0  # a stopped renewing 31 s ago: expired
    took = b.claim("t", "s1")
    assert (took.claim, took.holder, took.previous) == (Claim.TAKEN_OVER, "b", "a")
    assert took.moved_here
    assert a.claim("t", "s1").claim is Claim.FOREIGN  # a lost it
    lease = a.read("t", "s1")
    assert lease is not None and lease.replica == "b" and lease.expires == clock.now + 30.0


def test_release_lets_the_next_replica_take_it_at_once_and_tells_it_who_held_it(
    tmp_path: Path,
) -> None:
    clock = Clock()
    a, b = leases(tmp_path, clock, "a", "b")
    a.claim("t", "s")
    assert not b.release("t", "s")  # not b's to release
    assert a.release("t", "s")
    got = b.claim("t", "s")
    assert (got.claim, got.previous, got.moved_here) == (Claim.ACQUIRED, "a", True)
    a.release("t", "s")  # lost meanwhile: a no-op
    assert b.read("t", "s").replica == "b"  # type: ignore[union-attr]
    again = a.claim("t", "s")
    assert again.claim is Claim.FOREIGN


def test_own_expired_lease_is_reacquired_not_a_takeover(tmp_path: Path) -> None:
    clock = Clock()
    (a,) = leases(tmp_path, clock, "a")
    a.claim("t", "s")
    clock.now += 100
    got = a.claim("t", "s")
    assert (got.claim, got.moved_here) == (Claim.ACQUIRED, False)


def test_lease_files_are_named_by_hash_and_hold_no_session_id(tmp_path: Path) -> None:
    (a,) = leases(tmp_path, Clock(), "a")
    a.claim("tenant-x", "secret-session")
    names = os.listdir(tmp_path / "leases")
    assert len(names) == 1 and len(names[0]) == 64  # the sha256 of the key
    assert os.listdir(tmp_path / "leases" / names[0]) == ["000000000001"]
    raw = (tmp_path / "leases" / names[0] / "000000000001").read_text()
    assert "secret-session" not in raw and "tenant-x" not in raw
    assert json.loads(raw)["replica"] == "a"


def test_a_torn_lease_file_is_taken_over(tmp_path: Path) -> None:
    (a,) = leases(tmp_path, Clock(), "a")
    a.path_for("t", "s").mkdir()
    (a.path_for("t", "s") / "000000000001").write_text('{"replica": "b", "exp')
    got = a.claim("t", "s")
    assert got.mine and a.read("t", "s").replica == "a"  # type: ignore[union-attr]


def test_racing_takeovers_leave_exactly_one_holder(tmp_path: Path) -> None:
    clock = Clock()
    old, *racers = leases(tmp_path, clock, "old", *(f"r{i}" for i in range(6)))
    for round_ in range(20):
        sid = f"s{round_}"
        old.claim("t", sid)
        clock.now += 60  # old's lease expired: everybody races to take it over
        results: dict[str, Claim] = {}
        barrier = threading.Barrier(len(racers))

        def race(
            store: LeaseStore, sid: str, results: dict[str, Claim], barrier: threading.Barrier
        ) -> None:
            barrier.wait()
            results[store.replica_id] = store.claim("t", sid).claim

        threads = [threading.Thread(target=race, args=(r, sid, results, barrier)) for r in racers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [name for name, c in results.items() if c is not Claim.FOREIGN]
        assert len(winners) == 1, results
        assert old.read("t", sid).replica == winners[0]  # type: ignore[union-attr]
    for d in os.listdir(tmp_path / "leases"):  # one generation each, no temp files left
        assert os.listdir(tmp_path / "leases" / d) == ["000000000002"], d


def test_replica_ids_are_safe_file_names() -> None:
    assert validate_replica_id("gpu-0.a_1") == "gpu-0.a_1"
    for bad in ("", "a/b", "..", ".hidden", "x" * 65, "a b"):
        with pytest.raises(ValueError):
            validate_replica_id(bad)


def test_shared_store_renews_active_leases_and_lets_idle_ones_run_out(tmp_path: Path) -> None:
    clock = Clock()
    a = SharedStore(tmp_path, "a", ttl_s=30, clock=clock)
    b = SharedStore(tmp_path, "b", ttl_s=30, clock=clock)
    assert a.claim(("t", "busy")).mine and a.claim(("t", "idle")).mine  # type: ignore[union-attr]
    for _ in range(5):  # 100 s: "busy" is used every 20 s, "idle" never again
        clock.now += 20
        a.touch(("t", "busy"))
        a.renew_active()
    assert not b.may_write(("t", "busy"))
    assert b.may_write(("t", "idle"))
    assert a.held() == [("t", "busy")]
    assert a.release_all() == 1 and b.may_write(("t", "busy"))


# ------------------------------------------------------------------ replica disk tiers


def tier(path: Path, store: SharedStore, budget: int = 1 << 30) -> DiskTier:
    return DiskTier(path, budget, FP, replica_id=store.replica_id, owns=store.owns)


def test_replicas_share_a_directory_but_not_a_replica_id_nor_a_private_tier(
    tmp_path: Path,
) -> None:
    a = tier(tmp_path, SharedStore(tmp_path, "a"))
    b = tier(tmp_path, SharedStore(tmp_path, "b"))
    with pytest.raises(DirectoryLockedError, match="replica 'a'"):
        tier(tmp_path, SharedStore(tmp_path, "a"))
    with pytest.raises(DirectoryLockedError, match="another DiskTier or replica"):
        DiskTier(tmp_path, 1 << 30, FP)
    a.close()
    b.close()
    DiskTier(tmp_path, 1 << 30, FP).close()  # free again once every replica is gone


def test_a_replica_reads_another_replicas_snapshot_on_a_miss_verified(tmp_path: Path) -> None:
    sa, sb = SharedStore(tmp_path, "a"), SharedStore(tmp_path, "b")
    a, b = tier(tmp_path, sa), tier(tmp_path, sb)
    sa.claim(("acme", "agent-1"))
    written = snap("agent-1", version=3)
    a.write(written)
    assert b.read("acme", "agent-1") is None  # not in b's index: b never lists a's files
    entry = b.adopt("acme", "agent-1")
    assert entry is not None and entry.num_tokens == 6
    assert same(b.read("acme", "agent-1"), written)
    assert b.adopt("acme", "nobody") is None
    # a corrupt file is quarantined and reported, never loaded
    errors: list[str] = []
    c = DiskTier(tmp_path, 1 << 30, FP, replica_id="c", on_error=errors.append)
    path = a.path_for("acme", "agent-1")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert c.adopt("acme", "agent-1") is not None  # the header is fine
    assert c.read("acme", "agent-1") is None
    assert errors == ["checksum"] and not path.exists()
    assert len(list((tmp_path / "quarantine").glob("*.reason"))) == 1


def test_a_restart_indexes_only_the_replicas_own_snapshots(tmp_path: Path) -> None:
    sa, sb = SharedStore(tmp_path, "a"), SharedStore(tmp_path, "b")
    a, b = tier(tmp_path, sa), tier(tmp_path, sb)
    sa.claim(("acme", "mine"))
    a.write(snap("mine"))
    sb.claim(("acme", "theirs"))
    b.write(snap("theirs"))
    a.close()
    a2 = tier(tmp_path, SharedStore(tmp_path, "a"))
    assert a2.keys() == [("acme", "mine")]
    assert {(e.tenant, e.session_id, e.holder) for e in list_store(tmp_path)} == {
        ("acme", "mine", "a"),
        ("acme", "theirs", "b"),
    }


def test_eviction_never_deletes_a_file_another_replica_rewrote(tmp_path: Path) -> None:
    size = len(__import__("ds4pool.kv.snapshot", fromlist=["x"]).encode_snapshot(snap("x")))
    sa, sb = SharedStore(tmp_path, "a"), SharedStore(tmp_path, "b")
    a = tier(tmp_path, sa, budget=2 * size)  # room for two snapshots
    b = tier(tmp_path, sb)
    a.write(snap("s1", version=1))
    b.write(snap("s1", version=2))  # b took the session over and rewrote the file
    b.adopt("acme", "s2")
    a.write(snap("s2"))
    a.write(snap("s3"))  # over budget: a evicts s1, which is b's file now
    assert ("acme", "s1") not in a.keys()
    assert same(b.read("acme", "s1"), snap("s1", version=2))
    a.write(snap("s4"))  # evicts s2, a's own: deleted
    assert not a.path_for("acme", "s2").exists()
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".evict") or n.endswith(".tmp")]
    assert leftovers == []


def test_the_cli_lists_the_stores_sessions_with_their_leases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ds4pool.cli import main

    sa = SharedStore(tmp_path, "a")
    a = tier(tmp_path, sa)
    sa.claim(("acme", "agent-1"))
    a.write(snap("agent-1", num_tokens=7))
    a.write(snap("agent-2"))  # written without a lease file: shown without a holder
    assert main(["sessions", "--json", "store", "--kv-disk-dir", str(tmp_path)]) == 0
    rows = {r["session_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["agent-1"]["holder"] == "a" and rows["agent-1"]["lease_live"]
    assert rows["agent-1"]["num_tokens"] == 7 and rows["agent-2"]["holder"] is None
    assert main(["sessions", "store", "--kv-disk-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "agent-1" in out and "a (live)" in out and "(2 snapshots in" in out
    assert main(["sessions", "store", "--kv-disk-dir", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_a_running_request_keeps_its_lease_however_long_it_runs(tmp_path: Path) -> None:
    clock = Clock()
    a = SharedStore(tmp_path, "a", ttl_s=30, clock=clock)
    b = SharedStore(tmp_path, "b", ttl_s=30, clock=clock)
    a.claim(("t", "long"))
    for _ in range(6):  # a 2-minute request: no release, so no touch(), but it is busy
        clock.now += 20
        a.renew_active(busy=[("t", "long")])
    assert not b.may_write(("t", "long"))


def test_replicas_share_block_files_and_never_delete_one_another_may_list(
    tmp_path: Path,
) -> None:
    from tests.unit.test_block_files import FP as BFP
    from tests.unit.test_block_files import blocks, session
    from tests.unit.test_block_files import same as same_blocks

    sa, sb = SharedStore(tmp_path, "a"), SharedStore(tmp_path, "b")
    a = DiskTier(tmp_path, 1 << 20, BFP, replica_id="a", owns=sa.owns)
    b = DiskTier(tmp_path, 1 << 20, BFP, replica_id="b", owns=sb.owns)
    x, y = session("x", [1, 2]), session("y", [3])
    sa.claim(("acme", "x"))
    a.write(x)  # writes the three block files and x's session file
    sb.claim(("acme", "y"))
    b.write(y)  # the same prefix: b never indexed a's block files, renames equal ones over
    assert len(blocks(tmp_path)) == 3
    assert b.adopt("acme", "x") is not None  # b indexes x's block files too
    assert same_blocks(b.read("acme", "x"), x)
    a.delete("acme", "x")  # a's last session listing the blocks goes: the files stay
    assert len(blocks(tmp_path)) == 3
    assert same_blocks(b.read("acme", "y"), y)
    b.close()
    a.close()
    a2 = DiskTier(tmp_path, 1 << 20, BFP, replica_id="a", owns=SharedStore(tmp_path, "a").owns)
    assert a2.keys() == [] and len(blocks(tmp_path)) == 3  # a's start keeps b's block files
    a2.close()
    b2 = DiskTier(tmp_path, 1 << 20, BFP, replica_id="b", owns=SharedStore(tmp_path, "b").owns)
    assert same_blocks(b2.read("acme", "y"), y)
    b2.close()
