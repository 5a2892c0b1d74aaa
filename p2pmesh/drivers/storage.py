"""Storage: one node's durable state in its state directory, durable before save returns.

Owns the files ``wal``, ``identity`` and ``lock`` of the state directory (other drivers keep
their own files there, e.g. keys.py's cluster key). One Storage per directory, enforced by
an exclusive flock on ``lock``, so two agents can never interleave their writes.

The wal holds the durable part of every Ready as a *batch* of records (records.py): HARD?,
SNAPSHOT?, CUT?, ENTRY*, the last one flagged END. Replaying the batches in order from an
empty state does what sim/disk.py does with each Ready: take the hard state; take the
snapshot and drop stored entries at or below it; drop entries from CUT on; append.

Why everything lives in one file: a Ready can change hard state, snapshot and log at once
(a node joining another cluster changes all three). With one file, one write and one fsync,
a whole Ready is durable or none of it is; a crash can never pair one cluster's hard state
with another cluster's log. A save appends its batch (one write, one fsync). A Ready that
carries a snapshot instead rewrites the wal as one batch holding the whole new state (temp
file, fsync, rename, fsync the directory): the snapshot makes most of the old log dead, and
the rewrite costs about what writing a separate snapshot file would. A wal grown past twice
its size after the last rewrite (truncated entries, many hard states) is rewritten too.

Recovery: a crash during an append leaves, at the end of the wal, an incomplete record or
complete records of a batch without its END. That save never returned, so nothing in it was
acknowledged: open() drops it and cuts the file there. Anything else that fails a check (a
checksum, the format, a gap in indices) raises StateCorrupted: the agent never runs on
state it cannot vouch for.
"""
from __future__ import annotations

import fcntl
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from p2pmesh.core import wire
from p2pmesh.core.cluster import empty_state
from p2pmesh.core.errors import LocalProtocolError, StateCorrupted
from p2pmesh.core.identity import SEED_BYTES
from p2pmesh.core.ids import ClusterId
from p2pmesh.core.machine import NodeHardState, PersistedState, Ready
from p2pmesh.core.messages import Config, Entry, Snapshot
from p2pmesh.drivers.records import (
    FORMAT_VERSION,
    HEADER_BYTES,
    Kind,
    Record,
    check_format,
    corrupted,
    decode_cut,
    decode_hard,
    decode_value,
    encode_cut,
    encode_format,
    encode_hard,
    frame,
    frames,
    header_digest,
    scan,
)

WAL_FILE = "wal"
IDENTITY_FILE = "identity"
LOCK_FILE = "lock"
TEMP_SUFFIX = ".tmp"
REWRITE_MIN_BYTES = 4 * 1024 * 1024
"""The wal is rewritten once it exceeds twice its size after the last rewrite plus this."""
EMPTY_SNAPSHOT = Snapshot(0, 0, Config((), ()), empty_state(ClusterId("")))
"""What load() reports when no snapshot was ever saved (the same value sim/disk.py uses)."""
_BATCH_ORDER = {Kind.HARD: 0, Kind.SNAPSHOT: 1, Kind.CUT: 2, Kind.ENTRY: 3}


# --------------------------------------------------------------------------------------
# Durable file operations


def full_fsync(fd: int) -> None:
    """Flush ``fd`` to stable storage. On macOS fsync stops at the drive's volatile cache;
    F_FULLFSYNC makes the drive write its cache to the medium, which is what we need."""
    if sys.platform == "darwin":
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # some filesystems (SMB, FAT) refuse it; fsync is the best they offer
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by a mode-0600 file holding ``data``. After a crash the path holds
    the old content or all of the new one, never a mix."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover temp file keeps its old mode through O_TRUNC
        _write_all(fd, data, 0)
        full_fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _read_all(fd: int) -> bytes:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------------------
# Batches and the state they describe


@dataclass(frozen=True, slots=True)
class _Batch:
    """The durable part of one Ready, as the wal stores it."""

    hard: NodeHardState | None
    snapshot: Snapshot | None
    cut: int | None
    entries: tuple[Entry, ...]

    def encode(self, path: Path, chain: bytes) -> tuple[bytes, bytes]:
        """The batch's records, chained on from ``chain``, and the chain after them."""
        parts: list[tuple[Kind, bytes]] = []
        if self.hard is not None:
            parts.append((Kind.HARD, encode_hard(self.hard)))
        if self.snapshot is not None:
            parts.append((Kind.SNAPSHOT, wire.encode(self.snapshot)))
        if self.cut is not None:
            parts.append((Kind.CUT, encode_cut(self.cut)))
        parts += [(Kind.ENTRY, wire.encode(e)) for e in self.entries]
        for kind, payload in parts:
            # Refuse to write what a restart could not read back (a string over the
            # codec's limit, say): the node would otherwise die at boot on its own state.
            try:
                _decode(kind, payload, path)
            except StateCorrupted as exc:
                raise LocalProtocolError(f"refusing to save a value the wal could not read back: {exc}") from None
        return frames(parts, chain)


def _decode(kind: Kind, payload: bytes, path: Path) -> object:
    if kind is Kind.HARD:
        return decode_hard(payload, path)
    if kind is Kind.SNAPSHOT:
        return decode_value(payload, Snapshot, path)
    if kind is Kind.CUT:
        return decode_cut(payload, path)
    return decode_value(payload, Entry, path)


def _decode_batch(records: list[Record], path: Path) -> _Batch:
    fields: dict[Kind, object] = {}
    entries: list[Entry] = []
    rank = -1
    for r in records:
        order = _BATCH_ORDER.get(r.kind)
        if order is None or order < rank or (order == rank and r.kind is not Kind.ENTRY):
            raise corrupted(path, f"record at offset {r.offset} ({r.kind.name}) is out of place in its batch")
        rank = order
        value = _decode(r.kind, r.payload, path)
        if r.kind is Kind.ENTRY:
            entries.append(value)  # type: ignore[arg-type]
        else:
            fields[r.kind] = value
    return _Batch(fields.get(Kind.HARD), fields.get(Kind.SNAPSHOT), fields.get(Kind.CUT), tuple(entries))  # type: ignore[arg-type]


class _State:
    """What the wal says: hard state, snapshot, and the entries right after the snapshot."""

    __slots__ = ("entries", "hard", "snapshot")

    def __init__(self, hard: NodeHardState | None = None, snapshot: Snapshot | None = None, entries: list[Entry] | None = None) -> None:
        self.hard = hard
        self.snapshot = snapshot
        self.entries: list[Entry] = entries or []

    def problem(self, b: _Batch) -> str | None:
        """Why applying ``b`` would not leave entries contiguous right after the snapshot.

        sim/disk.py applies such a batch anyway and RaftLog then misreads the result, so
        the driver refuses it (saving) or calls the file corrupt (loading)."""
        if b.entries and b.cut is None:
            return "log entries without log_truncate_from"
        if b.cut is not None and b.cut < 1:
            return f"log_truncate_from {b.cut} is below 1"
        if b.snapshot is not None and b.snapshot.index < 0:
            return f"snapshot index {b.snapshot.index} is negative"
        base = b.snapshot.index if b.snapshot is not None else self.base
        lo, hi = base + 1, base
        if self.entries:
            lo = max(self.entries[0].index, base + 1)
            hi = self.entries[-1].index if b.cut is None else min(self.entries[-1].index, b.cut - 1)
        if lo > hi:
            expected = base + 1  # nothing stored is kept
        elif lo != base + 1:
            return f"kept entries {lo}..{hi} would not follow the snapshot at {base}"
        else:
            expected = hi + 1
        for e in b.entries:
            if e.index != expected:
                return f"log entry {e.index} where {expected} comes next (snapshot at {base})"
            expected += 1
        return None

    @property
    def base(self) -> int:
        return self.snapshot.index if self.snapshot is not None else 0

    def apply(self, b: _Batch) -> None:
        """Apply a batch that passed ``problem`` (the same steps as sim/disk.py)."""
        if b.hard is not None:
            self.hard = b.hard
        if b.snapshot is not None:
            self.snapshot = b.snapshot
            if self.entries:
                del self.entries[: max(0, b.snapshot.index - self.entries[0].index + 1)]
        if b.cut is not None and self.entries:
            del self.entries[max(0, b.cut - self.entries[0].index) :]
        self.entries.extend(b.entries)

    def after(self, b: _Batch) -> _State:
        new = _State(self.hard, self.snapshot, list(self.entries))
        new.apply(b)
        return new

    def as_batch(self) -> _Batch:
        """One batch that rebuilds this state from nothing."""
        return _Batch(self.hard, self.snapshot, self.base + 1, tuple(self.entries))


_FORMAT_RECORD = frame(Kind.FORMAT, encode_format(), end=True)
_FORMAT_CHAIN = header_digest(_FORMAT_RECORD)


@dataclass(frozen=True, slots=True)
class _Replayed:
    state: _State
    end: int
    """Offset where the last complete batch ends (the rest is a torn tail)."""
    chain: bytes
    """The header digest of the last record before ``end``: where the next append chains on."""
    version: int


def scan_wal(data: bytes, path: Path, *, torn_tail_ok: bool) -> tuple[int, tuple[Record, ...]]:
    """The wal's format version and its records after the format record, each checked (in
    a version 2 wal, against the chain)."""
    first = scan(data[: HEADER_BYTES + _first_length(data)], path, torn_tail_ok=True).records
    if not first or first[0].kind is not Kind.FORMAT or not first[0].end:
        # A wal is created whole by rename, so even a fresh one has its format record.
        raise corrupted(path, "does not start with a format record")
    version = check_format(first[0].payload, path)
    chain = header_digest(data[:HEADER_BYTES]) if version >= 2 else None
    start = HEADER_BYTES + len(first[0].payload)
    return version, scan(data, path, torn_tail_ok=torn_tail_ok, start=start, chain=chain).records


def _replay(data: bytes, path: Path) -> _Replayed:
    """The state a wal describes, and where (and with what chain) its last complete batch ends."""
    version, records = scan_wal(data, path, torn_tail_ok=True)
    good_end = HEADER_BYTES + _first_length(data)
    good_chain = header_digest(data[:HEADER_BYTES])
    state = _State()
    pending: list[Record] = []
    for r in records:
        pending.append(r)
        if not r.end:
            continue
        batch = _decode_batch(pending, path)
        why = state.problem(batch)
        if why is not None:
            raise corrupted(path, f"batch at offset {pending[0].offset} is inconsistent: {why}")
        state.apply(batch)
        good_end = r.offset + HEADER_BYTES + len(r.payload)
        good_chain = header_digest(data[r.offset : r.offset + HEADER_BYTES])
        pending = []
    return _Replayed(state, good_end, good_chain, version)


def _first_length(data: bytes) -> int:
    """The payload length the first record's header claims (0 if there is no header yet;
    the scan then checks the header before anything trusts it)."""
    return int.from_bytes(data[:4], "big") if len(data) >= HEADER_BYTES else 0


# --------------------------------------------------------------------------------------


def _tighten(state_dir: Path) -> None:
    """A state directory made before the agent's first start (`key set` under a loose umask,
    a user's mkdir) is closed to others: the wal, key and control socket are the owner's.
    Only a directory of our own and without the sticky bit (never a shared one like /tmp)."""
    st = state_dir.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        os.chmod(state_dir, 0o700)


class Storage:
    """The durable state of one node. Not thread-safe: the agent calls it from one task
    at a time (through trio.to_thread, one call after the other)."""

    def __init__(self, state_dir: Path, lock_fd: int, wal_fd: int, state: _State, size: int, chain: bytes,
                 rewrite_min_bytes: int) -> None:
        """Private: use Storage.open."""
        self._dir = state_dir
        self._wal_path = state_dir / WAL_FILE
        self._lock_fd = lock_fd
        self._wal_fd = wal_fd
        self._state = state
        self._size = size
        self._base_size = size
        self._chain = chain
        self._rewrite_min_bytes = rewrite_min_bytes
        self._closed = False
        self._failed = False

    @classmethod
    def open(cls, state_dir: Path, *, rewrite_min_bytes: int = REWRITE_MIN_BYTES) -> Storage:
        """Lock and read the state directory (created, mode 0700, if missing). Raises
        StateCorrupted if the wal fails its checks, LocalProtocolError if another process
        holds the directory."""
        state_dir = Path(state_dir)
        if not state_dir.exists():
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fsync_dir(state_dir.parent)
        else:
            _tighten(state_dir)
        lock_fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        wal_fd = -1
        try:
            try:
                # flock dies with the process, so a crashed agent never leaves it held.
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LocalProtocolError(f"{state_dir} is in use by another p2pmesh process") from None
            for name in (WAL_FILE, IDENTITY_FILE):
                # A temp file is a write that crashed before its rename: never part of the state.
                (state_dir / (name + TEMP_SUFFIX)).unlink(missing_ok=True)
            wal = state_dir / WAL_FILE
            if not wal.exists():
                write_atomically(wal, _FORMAT_RECORD)
            wal_fd = os.open(wal, os.O_RDWR)
            data = _read_all(wal_fd)
            replayed = _replay(data, wal)
            end, chain = replayed.end, replayed.chain
            if replayed.version < FORMAT_VERSION:
                # An older, unchained wal: rewrite it whole in the current format first.
                body, chain = replayed.state.as_batch().encode(wal, _FORMAT_CHAIN)
                write_atomically(wal, _FORMAT_RECORD + body)
                os.close(wal_fd)
                wal_fd = os.open(wal, os.O_RDWR)
                end = len(_FORMAT_RECORD) + len(body)
            elif end < len(data):
                # Cut the torn tail durably before anything is appended after it.
                os.ftruncate(wal_fd, end)
                full_fsync(wal_fd)
        except BaseException:
            if wal_fd >= 0:
                os.close(wal_fd)
            os.close(lock_fd)
            raise
        return cls(state_dir, lock_fd, wal_fd, replayed.state, end, chain, rewrite_min_bytes)

    def load(self) -> PersistedState | None:
        """The state as last saved; None if no hard state was ever saved."""
        self._check_usable()
        s = self._state
        if s.hard is None:
            return None
        return PersistedState(s.hard, s.snapshot or EMPTY_SNAPSHOT, tuple(s.entries))

    def save(self, ready: Ready) -> None:
        """Make the Ready's durable part durable; returns once it is on stable storage.

        Raises LocalProtocolError, having written nothing, for a Ready whose log would not
        be contiguous or that holds a value the wal could not read back."""
        self._check_usable()
        if ready.hard is None and ready.snapshot is None and ready.log_truncate_from is None:
            if ready.log_entries:
                raise LocalProtocolError("inconsistent Ready, nothing written: log entries without log_truncate_from")
            return
        batch = _Batch(ready.hard, ready.snapshot, ready.log_truncate_from, tuple(ready.log_entries))
        why = self._state.problem(batch)
        if why is not None:
            raise LocalProtocolError(f"inconsistent Ready, nothing written: {why}")
        data, chain = (b"", b"") if batch.snapshot is not None else batch.encode(self._wal_path, self._chain)
        rewrite = batch.snapshot is not None or self._size + len(data) > 2 * self._base_size + self._rewrite_min_bytes
        if rewrite:
            new = self._state.after(batch)
            body, chain = new.as_batch().encode(self._wal_path, _FORMAT_CHAIN)
            data = _FORMAT_RECORD + body
        # From here on a failure leaves the file in an unknown state. After a failed fsync
        # Linux may drop the dirty pages and report success on a retry (PostgreSQL's
        # "fsyncgate"), so the only safe recovery is a restart that rereads the wal.
        self._failed = True
        if rewrite:
            write_atomically(self._wal_path, data)
            fd = os.open(self._wal_path, os.O_RDWR)
            os.close(self._wal_fd)
            self._wal_fd = fd
            self._state = new
            self._size = self._base_size = len(data)
        else:
            _write_all(self._wal_fd, data, self._size)
            full_fsync(self._wal_fd)
            self._size += len(data)
            self._state.apply(batch)
        self._chain = chain
        self._failed = False

    def forget_cluster(self) -> None:
        """Drop the whole cluster state (hard state, snapshot, log), durably, keeping the
        node's identity: for a Mac that leaves its one-Mac cluster for another (pairing).
        Afterwards load() returns None, as on a first start."""
        self._check_usable()
        self._failed = True  # as in save: a failed rewrite leaves the file unknown until a restart
        write_atomically(self._wal_path, _FORMAT_RECORD)
        fd = os.open(self._wal_path, os.O_RDWR)
        os.close(self._wal_fd)
        self._wal_fd = fd
        self._state = _State()
        self._size = self._base_size = len(_FORMAT_RECORD)
        self._chain = _FORMAT_CHAIN
        self._failed = False

    def load_identity_seed(self) -> bytes | None:
        """The node's Ed25519 seed, or None if none was saved yet."""
        self._check_usable()
        path = self._dir / IDENTITY_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        records = scan(data, path, torn_tail_ok=False).records
        if len(records) != 1 or records[0].kind is not Kind.IDENTITY or not records[0].end or len(records[0].payload) != SEED_BYTES:
            raise corrupted(path, f"is not one identity record of {SEED_BYTES} bytes")
        return records[0].payload

    def save_identity_seed(self, seed: bytes) -> None:
        """Save the node's seed (file mode 0600). Written once: a new key is a new node."""
        self._check_usable()
        if type(seed) is not bytes or len(seed) != SEED_BYTES:
            raise LocalProtocolError(f"identity seed must be {SEED_BYTES} bytes")
        path = self._dir / IDENTITY_FILE
        # The directory lock makes this check-then-rename race-free.
        if path.exists():
            raise LocalProtocolError(f"{path} already exists; a node's identity is written once")
        write_atomically(path, frame(Kind.IDENTITY, seed, end=True))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._wal_fd)
        os.close(self._lock_fd)  # closing the descriptor releases the flock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise LocalProtocolError("storage is closed")
        if self._failed:
            raise LocalProtocolError(f"an earlier save to {self._wal_path} failed; restart the agent to recover from disk")
