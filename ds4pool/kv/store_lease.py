"""Session leases in a shared snapshot store: which replica may write a session's snapshot.

One small file per session, `leases/<sha256 of the key>.lease` (the same hash as the
session's snapshot file: never the raw id), holding JSON `{"replica", "expires", "token"}`.
No flock (unreliable on NFS): a lease is made visible by `link(tmp, path)`, which fails with
EEXIST when one is there, and replaced by `rename(tmp, path)`, both atomic on a local
filesystem and on NFS. A released lease stays as a file with `expires` 0, so the next holder
knows who held it last (and so whether its own copy of the session may be stale).

States of a lease file, as `claim()` sees them:

    absent ──link──► mine, live ──renew (rename)──► mine, live
                        │ release                     │ no renewal for ttl_s
                        ▼                             ▼
                     released ◄──────────────── expired ──claim by another──► theirs, live
                        └──claim by anyone (rename)──► mine, live

Taking over an expired or released lease renames the old file aside first (`.stale.*`), then
links the new one: of two replicas racing for it, only one link succeeds. The one window left
(A reads "expired", B takes it over, A renames B's fresh lease aside) is closed by comparing
the inode A judged with the one it renamed, and linking B's back when they differ.

Clock: expiries are wall-clock times, so replicas sharing a store need synchronised clocks
(NTP); ttl_s should be many times the worst skew.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ds4pool.kv.disk import session_file_name

log = logging.getLogger(__name__)

LEASE_DIR = "leases"
LEASE_SUFFIX = ".lease"
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
        name = session_file_name(tenant, session_id).rsplit(".", 1)[0]
        return self.directory / (name + LEASE_SUFFIX)

    # ------------------------------------------------------------ public API

    def read(self, tenant: str, session_id: str) -> Lease | None:
        found = self._read(self.path_for(tenant, session_id))
        return found[0] if found else None

    def claim(self, tenant: str, session_id: str) -> ClaimResult:
        """Take, renew or take over the session's lease; FOREIGN if another replica holds it
        live. Raises LeaseError when the store cannot be read or written."""
        path = self.path_for(tenant, session_id)
        for _ in range(8):  # each retry means another replica changed the file meanwhile
            found = self._read(path)
            now = self._clock()
            if found is None:
                if self._link_new(path):
                    return ClaimResult(Claim.ACQUIRED, self.replica_id, None)
                continue
            lease, ino = found
            if lease.replica != self.replica_id and lease.live(now):
                return ClaimResult(Claim.FOREIGN, lease.replica, lease.replica)
            if lease.replica == self.replica_id and lease.live(now):
                self._write(path, replace=True)
                return ClaimResult(Claim.RENEWED, self.replica_id, lease.replica)
            if self._replace_stale(path, ino):
                took = lease.replica != self.replica_id and lease.expires > 0
                claim = Claim.TAKEN_OVER if took else Claim.ACQUIRED
                if took:
                    log.info("store: took over the lease %s from %s", path.name, lease.replica)
                return ClaimResult(claim, self.replica_id, lease.replica)
        raise LeaseError(f"lease {path.name}: kept changing under us (8 attempts)")

    def release(self, tenant: str, session_id: str) -> bool:
        """Mark our lease released (expires 0); False if it is not ours (lost or absent)."""
        path = self.path_for(tenant, session_id)
        found = self._read(path)
        if found is None or found[0].replica != self.replica_id:
            return False
        self._write(path, replace=True, expires=0.0)
        return True

    def remove(self, tenant: str, session_id: str) -> None:
        """Delete the lease file of a dropped session (if ours or not live)."""
        path = self.path_for(tenant, session_id)
        found = self._read(path)
        if found is not None and (
            found[0].replica == self.replica_id or not found[0].live(self._clock())
        ):
            _unlink_quietly(path)

    def leases(self) -> dict[str, Lease]:
        """Every lease file by snapshot file name (admin listings, tests)."""
        out: dict[str, Lease] = {}
        for item in os.scandir(self.directory):
            if item.name.endswith(LEASE_SUFFIX):
                found = self._read(Path(item.path))
                if found is not None:
                    out[item.name.removesuffix(LEASE_SUFFIX) + ".snap"] = found[0]
        return out

    # ------------------------------------------------------------ files

    def _read(self, path: Path) -> tuple[Lease, int] | None:
        try:
            with open(path, "rb") as f:
                raw, ino = f.read(4096), os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        except OSError as e:
            raise LeaseError(e.errno, f"reading lease {path.name}: {e.strerror}") from e
        try:
            doc = json.loads(raw)
            return Lease(str(doc["replica"]), float(doc["expires"]), str(doc["token"])), ino
        except (ValueError, KeyError, TypeError):
            # a torn or foreign file: treat it as an expired lease of nobody (taken over)
            log.warning("store: unreadable lease %s, treating it as expired", path.name)
            return Lease("?", -1.0, ""), ino

    def _temp(self, expires: float) -> Path:
        doc = {"replica": self.replica_id, "expires": expires, "token": secrets.token_hex(8)}
        tmp = self.directory / f".{self.replica_id}.{secrets.token_hex(6)}.tmp"
        try:
            with open(tmp, "x") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            _unlink_quietly(tmp)
            raise LeaseError(e.errno, f"writing a lease: {e.strerror}") from e
        return tmp

    def _write(self, path: Path, *, replace: bool, expires: float | None = None) -> None:
        tmp = self._temp(self._clock() + self.ttl_s if expires is None else expires)
        try:
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            raise LeaseError(e.errno, f"renewing lease {path.name}: {e.strerror}") from e

    def _link_new(self, path: Path) -> bool:
        """Make a new lease visible unless one appeared meanwhile."""
        tmp = self._temp(self._clock() + self.ttl_s)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise LeaseError(e.errno, f"creating lease {path.name}: {e.strerror}") from e
        finally:
            _unlink_quietly(tmp)

    def _replace_stale(self, path: Path, judged_ino: int) -> bool:
        """Rename the expired/released lease we read aside and link ours; False if another
        replica got there first (the caller reads again)."""
        aside = path.with_name(f".{path.name}.stale.{self.replica_id}.{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False  # someone else renamed it first
        except OSError as e:
            raise LeaseError(e.errno, f"taking over lease {path.name}: {e.strerror}") from e
        try:
            if os.stat(aside).st_ino != judged_ino:
                # we renamed a lease written after our read (another replica's fresh one)
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass  # a third one linked meanwhile: it holds it now
                return False
            return self._link_new(path)
        finally:
            _unlink_quietly(aside)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.error("store: cannot remove %s: %s", path, e)
