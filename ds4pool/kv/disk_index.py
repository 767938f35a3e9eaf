"""The disk tier's index of session files: LRU order, byte counts, the budget, and the
block files' reference counts as the indexed session files list them.

Every method runs with the tier's lock held (`kv/disk.py` takes it): the index, the counts
and the unlinks and renames done here change together. Invariants, checked by
`check_integrity`: `used_bytes` is the sum of the indexed session files' sizes; a block
file's reference count is the number of indexed session files listing it.

Shared store (`replica_id` set): `ours` holds the inode of each file this replica wrote,
and eviction deletes only such a file; any other is forgotten (out of the index, the file
left to the replica that wrote it).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from dataclasses import replace

from ds4pool.kv.blockstore import BlockFiles
from ds4pool.kv.disk_files import DiskEntry, SessionKey, unlink_quietly


class DiskIndex:
    def __init__(self, blocks: BlockFiles, budget_bytes: int, replica_id: str | None) -> None:
        self.blocks = blocks
        self.budget_bytes = budget_bytes
        self.replica_id = replica_id
        self.entries: OrderedDict[SessionKey, DiskEntry] = OrderedDict()  # LRU first
        self.used_bytes = 0  # session files; the block files' bytes are self.blocks'
        self.ours: dict[SessionKey, int] = {}  # shared store only: key -> inode we wrote

    @property
    def total_bytes(self) -> int:
        """Session files plus every block file once."""
        return self.used_bytes + self.blocks.used_bytes

    def put(self, entry: DiskEntry) -> None:
        key = (entry.tenant, entry.session_id)
        old = self.entries.pop(key, None)
        self.used_bytes += entry.num_bytes - (old.num_bytes if old else 0)
        self.blocks.ref(entry.blocks)
        if old is not None:
            self.blocks.unref(old.blocks)
            self.blocks.collect(old.blocks)  # those the new snapshot no longer lists
        self.entries[key] = entry  # most recently used: the end

    def drop(self, key: SessionKey) -> DiskEntry | None:
        """Out of the index and its file deleted (then the block files it alone listed)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.num_bytes
            unlink_quietly(entry.path)
            self.blocks.unref(entry.blocks)
            self.blocks.collect(entry.blocks)
        self.ours.pop(key, None)
        return entry

    def forget(self, key: SessionKey) -> DiskEntry | None:
        """Out of the index, the file left alone (another replica's, or gone)."""
        entry = self.unindex(key)
        self.ours.pop(key, None)
        return entry

    def unindex(self, key: SessionKey) -> DiskEntry | None:
        """Out of the index, the file and `ours` left alone (quarantine moves the file)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.num_bytes
            self.blocks.unref(entry.blocks)
            self.blocks.collect(entry.blocks)  # shared: out of our index, files kept
        return entry

    def touch(self, key: SessionKey, now: float) -> DiskEntry | None:
        """Most recently used now; None if deleted or evicted meanwhile."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)  # its blocks' references stay as they are
        self.entries[key] = replace(entry, last_used=now)
        return entry

    def evict(self, key: SessionKey) -> DiskEntry | None:
        """Budget eviction: a private tier deletes; a replica deletes only the file it
        wrote. Renamed aside first, so that a file another replica renamed into place
        after our check is put back, never deleted."""
        if not self.replica_id:
            return self.drop(key)
        ino, entry = self.ours.get(key), self.forget(key)
        if entry is None or ino is None:
            return entry
        aside = entry.path.with_name(f".{entry.path.name}.{self.replica_id}.evict")
        try:
            os.rename(entry.path, aside)
        except OSError:
            return entry  # gone already
        if os.stat(aside).st_ino != ino:
            try:
                os.link(aside, entry.path)  # not ours: put it back
            except OSError:
                pass  # a newer one is in place: ours was the stale one
        unlink_quietly(aside)
        return entry

    def evict_to_budget(self, keep: SessionKey | None) -> list[DiskEntry]:
        """Evict least recently used session files (never `keep`) until within budget."""
        evicted = []
        victims = (k for k in list(self.entries) if k != keep)
        while self.total_bytes > self.budget_bytes:
            # `keep` with its blocks alone fits (write() checked); only block files another
            # write is still filling (held, listed by no session yet) can outlast the
            # victims, and that write evicts for them when it lands
            victim = next(victims, None)
            if victim is None:
                break
            entry = self.evict(victim)
            assert entry is not None
            evicted.append(entry)
        return evicted

    def check_integrity(self) -> None:
        """Raise AssertionError if the index, the block files' reference counts and the byte
        counts disagree (a block file's count == the indexed session files listing it)."""
        refs: Counter[str] = Counter(k for e in self.entries.values() for k in e.blocks)
        blocks = self.blocks
        assert +blocks.refs == refs, "block file reference counts are off"
        for k in refs:
            assert k in blocks.entries, f"a session file lists block {k}, not indexed"
        assert self.used_bytes == sum(e.num_bytes for e in self.entries.values())
        assert blocks.used_bytes == sum(e.num_bytes for e in blocks.entries.values())
        unlisted = [k for k in blocks.entries if not refs[k] and not blocks.pending[k]]
        assert not unlisted, f"block files no session lists: {unlisted}"
