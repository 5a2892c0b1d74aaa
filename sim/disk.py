"""SimDisk: one node's durable storage, with an explicit sync point.

A Ready's durable part is written at once (into the page cache) and becomes durable when
its fsync completes. A process crash keeps what was written (the OS still has it); a power
loss (``lose_unsynced``) drops everything not yet synced. Entries are kept as a list that
starts right after the stored snapshot, mirroring the on-disk layout of the real agent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from p2pmesh.core.cluster import empty_state
from p2pmesh.core.ids import ClusterId
from p2pmesh.core.machine import NodeHardState, PersistedState, Ready
from p2pmesh.core.messages import Config, Entry, Snapshot

_EMPTY_SNAPSHOT = Snapshot(0, 0, Config((), ()), empty_state(ClusterId("")))


@dataclass(slots=True)
class _Image:
    hard: NodeHardState | None = None
    snapshot: Snapshot | None = None
    entries: list[Entry] = field(default_factory=list)

    def copy(self) -> _Image:
        return _Image(self.hard, self.snapshot, list(self.entries))

    def write(self, ready: Ready) -> None:
        if ready.hard is not None:
            self.hard = ready.hard
        if ready.snapshot is not None:
            snap = ready.snapshot
            self.snapshot = snap
            self._drop_through(snap.index)
        if ready.log_truncate_from is not None:
            # Stored entries are contiguous, so a cut is one slice deletion.
            if self.entries:
                del self.entries[max(0, ready.log_truncate_from - self.entries[0].index) :]
            self.entries.extend(ready.log_entries)

    def _drop_through(self, index: int) -> None:
        if self.entries:
            del self.entries[: max(0, index - self.entries[0].index + 1)]

    def entry_term(self, index: int) -> int | None:
        if self.snapshot is not None and index <= self.snapshot.index:
            return self.snapshot.term if index == self.snapshot.index else -1
        if not self.entries:
            return None
        pos = index - self.entries[0].index
        if 0 <= pos < len(self.entries):
            return self.entries[pos].term
        return None


class SimDisk:
    def __init__(self) -> None:
        self.synced = _Image()
        self.written = _Image()
        self.pending: list[tuple[Ready, bool]] = []
        """Readies written and not yet synced, in order, each with whether it has a durable part."""
        self.writes = 0
        self.retired: dict[int, _Image] = {}
        """Synced images of earlier incarnations (abandoned logs and wiped disks), kept so
        the checker can judge old commits by what was durable when they happened."""

    def write(self, ready: Ready) -> None:
        """Queue a Ready in order; its durable part (if any) reaches the page cache now."""
        durable = ready.durable_part()
        if durable:
            self.written.write(ready)
            self.writes += 1
        self.pending.append((ready, durable))

    def sync(self, through: Ready | None = None) -> None:
        """Make writes durable, in order, up to and including ``through`` (all if None)."""
        done = 0
        for ready, durable in self.pending:
            if durable:
                old = self.synced.hard
                if old is not None and ready.hard is not None and ready.hard.inc != old.inc:
                    self.retired[old.inc] = self.synced.copy()
                self.synced.write(ready)
            done += 1
            if ready is through:
                break
        del self.pending[:done]

    def crash(self, *, lose_unsynced: bool) -> None:
        if lose_unsynced:
            self.written = self.synced.copy()
            self.pending = []
        else:
            self.sync()

    def wipe(self) -> None:
        if self.synced.hard is not None:
            self.retired[self.synced.hard.inc] = self.synced
        self.synced = _Image()
        self.written = _Image()
        self.pending = []

    def load(self) -> PersistedState | None:
        img = self.synced
        if img.hard is None:
            return None
        return PersistedState(img.hard, img.snapshot or _EMPTY_SNAPSHOT, tuple(img.entries))
