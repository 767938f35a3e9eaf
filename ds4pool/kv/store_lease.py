"""Session leases in a shared snapshot store: which replica may write a session's snapshot.

One small directory per session, `leases/<sha256 of the key>/` (the same hash as the
session's snapshot file: never the raw id), holding numbered generations `000000000001`,
`000000000002`, ...: the highest is the lease, JSON `{"replica", "expires", "token"}`. No
flock (unreliable on NFS): a generation is made visible by `link(tmp, name)`, which fails with
EEXIST when the name exists, so of replicas racing to take an expired lease over, exactly
one creates generation g + 1. Its holder renews and releases it in place (`rename(tmp,
name)`); a released lease stays with `expires` 0, so the next holder knows who held it last
(and so whether its own copy of the session may be stale). The new holder removes the older
generations.

    no generation ──link g=1──► mine, live ──renew (rename onto g)──► mine, live
                                   │ release                          │ no renewal for ttl_s
                                   ▼                                  ▼
                                released ◄───────────────────── expired
                                   └──claim by anyone: link g+1──► that replica's, live

A holder that renews late (after its lease expired) may find a higher generation: it has
lost the lease and says so (FOREIGN).

Clock: expiries are wall-clock times, so replicas sharing a store need synchronised clocks
(NTP); ttl_s should be many times the worst skew.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ds4pool.kv.disk_files import SNAP_SUFFIX, session_file_name

log = logging.getLogger(__name__)

LEASE_DIR = "leases"
REPLICA_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def validate_replica_id(replica_id: str) -> str:
    """Replica ids name files (owner lock, temp files): a short safe word, never a path."""
    if not 0 < len(replica_id) <= 64 or not set(replica_id) <= REPLICA_ID_CHARS:
        raise ValueError(
            f"replica id {replica_id!r}: use 1-64 characters of letters, digits, '-', '_', '.'"
        )
    if replica_id.startswith("."):
        raise ValueError(f"replica id {replica_id!r} must not start with '.'")
    return replica_id


class LeaseError(OSError):
    """A lease file could not be read or written (the store is unreachable or read-only)."""


@dataclass(frozen=True)
class Lease:
    replica: str
    expires: float  # unix time; 0 = released
    token: str  # random per write: tells one holder's renewal from another's lease

    def live(self, now: float) -> bool:
        return self.expires > now


class Claim(Enum):
    RENEWED = "renewed"  # we held it live: extended
    ACQUIRED = "acquired"  # it was absent, released, or ours but expired
    TAKEN_OVER = "taken_over"  # another replica's lease had expired without a release
    FOREIGN = "foreign"  # another replica holds it live: do not write the session


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    holder: str  # who holds the lease now
    previous: str | None  # who held it before this claim (None: no lease file)

    @property
    def mine(self) -> bool:
        return self.claim is not Claim.FOREIGN

    @property
    def moved_here(self) -> bool:
        """The session was last leased by another replica: a local copy may be stale."""
        return self.mine and self.previous is not None and self.previous != self.holder


class LeaseStore:
    """The lease files of one replica in a shared store directory. Thread-safe: every
    operation is a few syscalls on files; concurrent claims of one key by threads of one
    replica are harmless (the same holder)."""

    def __init__(
        self,
        directory: Path | str,
        replica_id: str,
        ttl_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.replica_id = validate_replica_id(replica_id)
        self.ttl_s = ttl_s
        self.directory = Path(directory) / LEASE_DIR
        self._clock = clock
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path_for(self, tenant: str, session_id: str) -> Path:
        """The session's lease directory."""
        return self.directory / session_file_name(tenant, session_id).rsplit(".", 1)[0]

    # ------------------------------------------------------------ public API

    def read(self, tenant: str, session_id: str) -> Lease | None:
        found = self._read(self.path_for(tenant, session_id))
        return found[0] if found else None

    def claim(self, tenant: str, session_id: str) -> ClaimResult:
        """Take, renew or take over the session's lease; FOREIGN if another replica holds it
        live. Raises LeaseError when the store cannot be read or written."""
        path = self.path_for(tenant, session_id)
        for _ in range(8):  # each retry means another replica changed the lease meanwhile
            found = self._read(path)
            now = self._clock()
            if found is None:
                if self._link(path, 1):
                    return ClaimResult(Claim.ACQUIRED, self.replica_id, None)
                continue
            lease, gen = found
            if lease.replica != self.replica_id and lease.live(now):
                return ClaimResult(Claim.FOREIGN, lease.replica, lease.replica)
            if lease.replica == self.replica_id and lease.live(now):
                self._rewrite(path, gen, now + self.ttl_s)
                newer = self._read(path)
                if newer is not None and newer[1] > gen:  # taken over while we were late
                    return ClaimResult(Claim.FOREIGN, newer[0].replica, self.replica_id)
                return ClaimResult(Claim.RENEWED, self.replica_id, lease.replica)
            if self._link(path, gen + 1):
                self._remove_below(path, gen + 1)
                took = lease.replica != self.replica_id and lease.expires > 0
                if took:
                    log.info("store: took over the lease %s from %s", path.name, lease.replica)
                claim = Claim.TAKEN_OVER if took else Claim.ACQUIRED
                return ClaimResult(claim, self.replica_id, lease.replica)
        raise LeaseError(f"lease {path.name}: kept changing under us (8 attempts)")

    def release(self, tenant: str, session_id: str) -> bool:
        """Mark our lease released (expires 0); False if it is not ours (lost or absent)."""
        path = self.path_for(tenant, session_id)
        found = self._read(path)
        if found is None or found[0].replica != self.replica_id:
            return False
        self._rewrite(path, found[1], 0.0)
        return True

    def remove(self, tenant: str, session_id: str) -> None:
        """Delete the lease of a dropped session (if ours or not live)."""
        path = self.path_for(tenant, session_id)
        found = self._read(path)
        if found is not None and (
            found[0].replica == self.replica_id or not found[0].live(self._clock())
        ):
            shutil.rmtree(path, ignore_errors=True)

    def leases(self) -> dict[str, Lease]:
        """Every lease by snapshot file name (admin listings, tests)."""
        out: dict[str, Lease] = {}
        for item in os.scandir(self.directory):
            if item.is_dir() and not item.name.startswith("."):
                found = self._read(Path(item.path))
                if found is not None:
                    out[item.name + SNAP_SUFFIX] = found[0]
        return out

    # ------------------------------------------------------------ files

    @staticmethod
    def _generations(path: Path) -> list[int]:
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise LeaseError(e.errno, f"listing lease {path.name}: {e.strerror}") from e
        return sorted((int(n) for n in names if n.isdigit()), reverse=True)

    def _read(self, path: Path) -> tuple[Lease, int] | None:
        """The highest generation and its number; None when there is none."""
        for _ in range(8):  # a generation removed between listing and opening: list again
            gens = self._generations(path)
            if not gens:
                return None
            try:
                with open(path / f"{gens[0]:012d}", "rb") as f:
                    raw = f.read(4096)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise LeaseError(e.errno, f"reading lease {path.name}: {e.strerror}") from e
            try:
                doc = json.loads(raw)
                lease = Lease(str(doc["replica"]), float(doc["expires"]), str(doc["token"]))
            except (ValueError, KeyError, TypeError):
                # a torn or foreign file: an expired lease of nobody (taken over)
                log.warning("store: unreadable lease %s, treating it as expired", path.name)
                lease = Lease("?", -1.0, "")
            return lease, gens[0]
        raise LeaseError(f"lease {path.name}: generations kept vanishing")

    def _temp(self, path: Path, expires: float) -> Path:
        doc = {"replica": self.replica_id, "expires": expires, "token": secrets.token_hex(8)}
        tmp = path / f".{self.replica_id}.{secrets.token_hex(6)}.tmp"
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            with open(tmp, "x") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            _unlink_quietly(tmp)
            raise LeaseError(e.errno, f"writing a lease: {e.strerror}") from e
        return tmp

    def _rewrite(self, path: Path, gen: int, expires: float) -> None:
        """Renew or release our generation in place."""
        tmp = self._temp(path, expires)
        try:
            os.replace(tmp, path / f"{gen:012d}")
        except OSError as e:
            _unlink_quietly(tmp)
            raise LeaseError(e.errno, f"renewing lease {path.name}: {e.strerror}") from e

    def _link(self, path: Path, gen: int) -> bool:
        """Create generation `gen` holding our lease; False if another replica did first."""
        try:
            tmp = self._temp(path, self._clock() + self.ttl_s)
        except LeaseError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return False  # the directory was removed (a dropped session) meanwhile
            raise
        try:
            os.link(tmp, path / f"{gen:012d}")
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            return False
        except OSError as e:
            raise LeaseError(e.errno, f"creating lease {path.name}: {e.strerror}") from e
        finally:
            _unlink_quietly(tmp)

    def _remove_below(self, path: Path, gen: int) -> None:
        for old in self._generations(path):
            if old < gen:
                _unlink_quietly(path / f"{old:012d}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.error("store: cannot remove %s: %s", path, e)
