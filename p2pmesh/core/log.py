"""The Raft log held in memory: a snapshot base plus the entries after it.

Indices start at 1; the snapshot covers [1, snapshot.index]. The log also remembers where
config entries sit (after the snapshot) so the configuration in force, which takes effect
on *append* (Raft thesis §4.1), can be found and rolled back when a suffix is truncated.
It performs no I/O: the Raft object reports truncations and appends to its driver.
"""
from __future__ import annotations

from p2pmesh.core.cluster import apply_config_command
from p2pmesh.core.messages import CONFIG_COMMANDS, Config, Entry, Snapshot


class RaftLog:
    __slots__ = ("snapshot", "entries", "_configs", "_latest")

    def __init__(self, snapshot: Snapshot, entries: list[Entry] | None = None) -> None:
        self.snapshot = snapshot
        self.entries: list[Entry] = []
        self._configs: list[tuple[int, Config]] = []
        self._latest = snapshot.config
        """config(), kept up to date by every change (Raft asks on every acknowledgement)."""
        for entry in entries or []:
            self._append_one(entry)

    # --- reading -------------------------------------------------------------------
    @property
    def first_index(self) -> int:
        return self.snapshot.index + 1

    @property
    def last_index(self) -> int:
        return self.snapshot.index + len(self.entries)

    @property
    def last_term(self) -> int:
        return self.entries[-1].term if self.entries else self.snapshot.term

    def term_at(self, index: int) -> int | None:
        """The term of the entry at ``index``, or None if it is compacted away or absent."""
        base = self.snapshot.index
        if index == base:
            return self.snapshot.term
        if index < base or index > base + len(self.entries):
            return None
        return self.entries[index - base - 1].term

    def entry(self, index: int) -> Entry:
        return self.entries[index - self.snapshot.index - 1]

    def slice(self, lo: int, count_max: int) -> tuple[Entry, ...]:
        """Entries from ``lo`` (inclusive, must be > snapshot.index), at most ``count_max``."""
        start = lo - self.snapshot.index - 1
        return tuple(self.entries[start : start + count_max])

    def config(self) -> Config:
        """The latest configuration in the log, committed or not."""
        return self._latest

    def _config_changed(self) -> None:
        self._latest = self._configs[-1][1] if self._configs else self.snapshot.config

    def config_at(self, index: int) -> Config:
        """The configuration in force at ``index`` (index >= snapshot.index)."""
        found = self.snapshot.config
        for at, cfg in self._configs:
            if at > index:
                break
            found = cfg
        return found

    def last_config_index(self) -> int:
        return self._configs[-1][0] if self._configs else self.snapshot.index

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft §5.4.1: is a log ending at (last_index, last_term) at least as current as ours?"""
        return last_term > self.last_term or (last_term == self.last_term and last_index >= self.last_index)

    # --- writing -------------------------------------------------------------------
    def append(self, entry: Entry) -> None:
        assert entry.index == self.last_index + 1, (entry.index, self.last_index)
        self._append_one(entry)

    def _append_one(self, entry: Entry) -> None:
        self.entries.append(entry)
        if isinstance(entry.command, CONFIG_COMMANDS):
            self._configs.append((entry.index, apply_config_command(self._latest, entry.command)))
            self._config_changed()

    def truncate_from(self, index: int) -> None:
        """Drop entries at ``index`` and after (never below the snapshot)."""
        assert index > self.snapshot.index
        del self.entries[index - self.snapshot.index - 1 :]
        while self._configs and self._configs[-1][0] >= index:
            self._configs.pop()
        self._config_changed()

    def compact(self, snapshot: Snapshot) -> None:
        """Replace the prefix up to ``snapshot.index`` (which we hold) by the snapshot."""
        assert self.snapshot.index < snapshot.index <= self.last_index
        del self.entries[: snapshot.index - self.snapshot.index]
        self._configs = [(i, c) for i, c in self._configs if i > snapshot.index]
        self.snapshot = snapshot
        self._config_changed()

    def reset(self, snapshot: Snapshot) -> None:
        """Throw everything away in favour of a snapshot (InstallSnapshot)."""
        self.snapshot = snapshot
        self.entries = []
        self._configs = []
        self._config_changed()
