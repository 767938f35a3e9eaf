"""Indexing files this process did not write: the whole directory at the disk tier's start,
from headers alone, and the block files of a snapshot adopted from another replica. Both
change the index (`kv/disk_index.py`): at start before the tier is shared, on adopt with
the tier's lock held.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from ds4pool.kv.blockstore import BLOCK_SUFFIX
from ds4pool.kv.disk_files import (
    SNAP_SUFFIX,
    TMP_SUFFIX,
    DiskEntry,
    Quarantine,
    SessionKey,
    file_key,
    read_entry,
    unlink_quietly,
)
from ds4pool.kv.disk_index import DiskIndex
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError

log = logging.getLogger(__name__)


def rebuild_index(
    index: DiskIndex,
    directory: Path,
    fingerprint: ModelFingerprint,
    tmp_prefix: str,
    owns: Callable[[SessionKey], bool] | None,
    quarantine: Quarantine,
) -> list[str]:
    """Index every valid *.snap and *.blk by its header alone; delete temp files left by a
    crash, session files whose block files are gone or bad, and block files no session
    file lists (a crash between a block write and its session's rename). Returns the kinds
    of the errors met, for the tier to report once it is built."""
    found: list[DiskEntry] = []
    errors: list[str] = []
    for item in os.scandir(directory):
        path = Path(item.path)
        if not item.is_file(follow_symlinks=False):
            continue
        if item.name.endswith(TMP_SUFFIX) and item.name.startswith(tmp_prefix):
            log.info("disk tier: removing leftover temp file %s", item.name)
            unlink_quietly(path)
        elif item.name.endswith((SNAP_SUFFIX, BLOCK_SUFFIX)):
            try:
                if item.name.endswith(SNAP_SUFFIX):
                    if owns is not None and not _owns_file(path, owns):
                        continue  # another replica's: adopted on a miss, not indexed
                    found.append(read_entry(path, fingerprint))
                    if index.replica_id:
                        index.ours[(found[-1].tenant, found[-1].session_id)] = item.inode()
                else:
                    index.blocks.index_file(path)
            except SnapshotError as e:
                quarantine(path, e)
                errors.append(e.kind)
            except OSError as e:
                log.error("disk tier: cannot read %s: %s", item.name, e)
                errors.append("io")
    blocks = index.blocks.entries
    for entry in sorted(found, key=lambda e: (e.last_used, e.path.name)):
        if all(k in blocks and blocks[k].tenant == entry.tenant for k in entry.blocks):
            index.put(entry)
        else:
            log.warning("disk tier: %s lacks a block file; deleted", entry.path.name)
            unlink_quietly(entry.path)
    orphans = [k for k in blocks if not index.blocks.refs[k]]
    if orphans:
        log.info(
            "disk tier: %s %d block files no session of ours lists",
            "not indexing (another replica's may)" if index.replica_id else "removing",
            len(orphans),
        )
    index.blocks.collect(orphans)
    for entry in index.evict_to_budget(keep=None):  # the budget may have shrunk
        log.info("disk tier: evicted %s at start (over budget)", entry.path.name)
    log.info(
        "disk tier: %d snapshots, %d block files, %d bytes in %s",
        len(index.entries),
        len(index.blocks.entries),
        index.total_bytes,
        directory,
    )
    return errors


def _owns_file(path: Path, owns: Callable[[SessionKey], bool]) -> bool:
    try:
        key = file_key(path)
    except SnapshotError:
        return False  # a foreign replica's problem as much as ours: checked on adopt
    return owns(key)


def index_blocks_of(index: DiskIndex, entry: DiskEntry, quarantine: Quarantine) -> str | None:
    """Index the block files an adopted snapshot lists that we have not indexed (another
    replica wrote them; lock held). The error kind when one is missing or invalid."""
    added = []
    try:
        for k in dict.fromkeys(entry.blocks):
            if k not in index.blocks.entries:
                block = index.blocks.index_file(index.blocks.path_for(k))
                added.append(k)
                if block.tenant != entry.tenant:
                    raise SnapshotError("format", f"block {k} is another tenant's")
        return None
    except SnapshotError as e:
        quarantine(index.blocks.path_for(k), e)
        return e.kind
    except OSError as e:
        log.error("disk tier: block file %s of %s: %s", k, entry.path.name, e)
        return "io"
    finally:
        index.blocks.collect(added)  # those no session of ours lists after all
