"""The disk tier's files, one call each: their names, the atomic write of a session file into
a temp file, quarantine, directory flocks, and the index entry of a session file read from
its header alone. No index, no budget, no lock of the tier's (that is `kv/disk.py`).

A file in the directory is either absent, a complete older snapshot, or a complete newer one:
`write_temp` fills and fsyncs a temp file in the same directory, the tier renames it over
the old one, then `fsync_directory` makes the rename durable.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError
from ds4pool.kv.snapshot import Snapshot, write_snapshot
from ds4pool.kv.snapshot_header import SnapshotHeader, check_fingerprint, read_header

log = logging.getLogger(__name__)

SessionKey = tuple[str, str]  # (tenant, session_id)
Quarantine = Callable[[Path, SnapshotError], None]  # the tier's quarantine_file, bound
SNAP_SUFFIX = ".snap"
TMP_SUFFIX = ".tmp"  # temp files are ".<random>.tmp": never a valid snapshot name
QUARANTINE_DIR = "quarantine"
REPLICAS_DIR = "replicas"  # replicas/<id>.lock: one process per replica id


class DirectoryLockedError(RuntimeError):
    """Another DiskTier (in this or another process) already owns the directory."""


@dataclass(frozen=True)
class DiskEntry:
    tenant: str
    session_id: str
    path: Path
    num_bytes: int  # file size
    num_tokens: int
    num_kv_tokens: int  # tokens with KV in the file (<= num_tokens)
    last_used: float  # unix time of the last write() or read()
    blocks: tuple[str, ...] = ()  # hex keys of the shared block files it relies on


def session_file_name(tenant: str, session_id: str) -> str:
    """sha256 over both parts, each length-prefixed, so ("a","bc") and ("ab","c") differ and no
    id can inject a path. surrogatepass: any Python str hashes, even a lone surrogate."""
    h = hashlib.sha256(b"ds4pool-session-v1\x00")
    for part in (tenant, session_id):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest() + SNAP_SUFFIX


def write_temp(
    directory: Path, prefix: str, snapshot: Snapshot, shuffle: bool, now: float
) -> tuple[Path, SnapshotHeader]:
    """Encode into a fsynced temp file in `directory` (so the rename is atomic), its mtime set
    to `now`: the kernel's own timestamps are too coarse to order writes. On any failure the
    temp file is removed and the error raised (an OSError for a full or failing disk)."""
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=TMP_SUFFIX)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            written = write_snapshot(f, snapshot, shuffle=shuffle)
            f.flush()
            os.utime(f.fileno(), (now, now))
            os.fsync(f.fileno())  # data on disk before the rename makes it visible
        return tmp, written
    except BaseException:
        unlink_quietly(tmp)
        raise


def fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:  # the file is in place and readable; only durability is at risk
        log.error("disk tier: fsync of directory %s failed: %s", directory, e)


def quarantine_file(quarantine_dir: Path, path: Path, error: SnapshotError) -> None:
    """Move `path` into `quarantine_dir` with a `.reason` file beside it."""
    log.warning("disk tier: quarantining %s: %s", path.name, error)
    dest = quarantine_dir / f"{path.name}.{time.time_ns()}"
    try:
        quarantine_dir.mkdir(mode=0o700, exist_ok=True)
        os.replace(path, dest)
        dest.with_name(dest.name + ".reason").write_text(
            f"kind: {error.kind}\nerror: {error}\nfile: {path.name}\n"
            f"time: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
        )
    except OSError as e:  # still never loaded: it is out of the index
        log.error("disk tier: cannot quarantine %s: %s", path.name, e)


def lock_directory(directory: Path, replica_id: str | None) -> list[int]:
    """The flocks a tier holds while open (closing their fds drops them): an exclusive one
    on `.lock` for a private tier; a shared one on `.lock` (so a private tier cannot open a
    shared store) plus an exclusive `replicas/<id>.lock` for a replica."""
    if not replica_id:
        return [_flock(directory / ".lock", fcntl.LOCK_EX, "another DiskTier or replica")]
    shared = _flock(directory / ".lock", fcntl.LOCK_SH, "a server without --replica-id")
    try:
        (directory / REPLICAS_DIR).mkdir(mode=0o700, exist_ok=True)
        mine = directory / REPLICAS_DIR / f"{replica_id}.lock"
        return [shared, _flock(mine, fcntl.LOCK_EX, f"replica {replica_id!r}")]
    except BaseException:
        os.close(shared)
        raise


def file_key(path: Path) -> SessionKey:
    """The (tenant, session_id) a session file's header names; a SnapshotError if it has none."""
    with open(path, "rb") as f:
        h = read_header(f)
    return (h.tenant, h.session_id)


def read_entry(path: Path, fingerprint: ModelFingerprint) -> DiskEntry:
    """The index entry of a session file, from its header alone: a SnapshotError unless the
    header is valid, for `fingerprint`, under its own name, and the file has its full size."""
    with open(path, "rb") as f:
        h = read_header(f)
        st = os.fstat(f.fileno())
    check_fingerprint(h, fingerprint)
    if path.name != session_file_name(h.tenant, h.session_id):
        raise SnapshotError("format", "file name does not match its (tenant, session_id)")
    if st.st_size != h.file_bytes:
        kind = "truncated" if st.st_size < h.file_bytes else "format"
        raise SnapshotError(kind, f"file has {st.st_size} bytes, header says {h.file_bytes}")
    return DiskEntry(
        h.tenant,
        h.session_id,
        path,
        st.st_size,
        h.num_tokens,
        h.num_kv_tokens,
        st.st_mtime,
        h.shared,
    )


def _flock(path: Path, mode: int, holder: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryLockedError(f"{path.parent} is in use by {holder}") from None
    return fd


def unlink_quietly(path: Path | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("disk tier: cannot remove %s: %s", path, e)
