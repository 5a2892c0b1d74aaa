"""The receiving end of one file copy (drivers/files.py): the ``<file>.partial`` it writes
into, what of it has arrived, the file's SHA-256, and the resume sidecar. Blocking code,
called from the receive threads (several at once when a file is striped) under one lock.

Resuming. Beside the partial lies ``.<file>.resume`` (hidden: never served), a small JSON
record {"size", "sha256", "ranges": [[start, end], ...]}: which byte ranges of the partial
have been written, for which version of the file (its size and the digest the holder
listed for it). It is rewritten every CHECKPOINT_BYTES of new data, after the partial's
data is flushed to disk (so a checkpoint never claims bytes that a power cut could lose),
and when a copy stops on an error or a cancellation. A SIGKILL loses at most the bytes
since the last checkpoint. A later copy of the same version keeps those ranges and asks
only for the rest; another version (or a record that does not parse) starts from zero.

Hashing. hashlib objects cannot be saved, so the file's SHA-256 is computed in file order:
bytes written at the hash's position are hashed as they pass (a single stream, the usual
case, hashes everything that way, once); bytes written elsewhere (another stripe, or a
kept prefix on resume) are read back from the partial when the hash reaches them (the page
cache, or the disk once). The kept ranges are not trusted: the whole file is checked
against the listed digest before it is renamed into place, and a mismatch discards it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from p2pmesh.drivers.storage import full_fsync, write_atomically

CHECKPOINT_BYTES = 64 << 20
"""New data between two resume checkpoints (each one a flush to disk and a small write)."""
RANGES_MAX = 256
"""Ranges a sidecar records; a copy striped into more pieces than this keeps only the first."""
SIDECAR_BYTES_MAX = 64 << 10
READ_BACK = 8 << 20


def sidecar_path(partial: Path) -> Path:
    return partial.with_name(f".{partial.name.removesuffix('.partial')}.resume")


def merge(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint) with [start, end) added, adjoining ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, (start, end)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def missing(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The complement of ``ranges`` in [0, size)."""
    out, pos = [], 0
    for a, b in ranges:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < size:
        out.append((pos, size))
    return out


def read_sidecar(partial: Path, size: int, digest: str) -> list[tuple[int, int]]:
    """The ranges a previous copy of this version wrote into ``partial`` (clipped to what the
    partial holds), or [] when there is none for this version."""
    try:
        side = sidecar_path(partial)
        if side.stat().st_size > SIDECAR_BYTES_MAX:
            return []
        raw = json.loads(side.read_text(encoding="utf-8"))
        held = partial.stat().st_size
    except (OSError, ValueError):
        return []
    if not (isinstance(raw, dict) and raw.get("size") == size and raw.get("sha256") == digest
            and isinstance(raw.get("ranges"), list)):
        return []
    kept: list[tuple[int, int]] = []
    for item in raw["ranges"][:RANGES_MAX]:
        if (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)
                and 0 <= item[0] < item[1] <= size):
            kept = merge(kept, item[0], min(item[1], held))
    return kept


class Sink:
    """One file arriving: pwrite at offsets from any thread, ranges kept, hash in order.
    The owner opens it (``open``), feeds it, then ``finish``es or ``close``s it."""

    def __init__(self, partial: Path, size: int, digest: str, *, checkpoint_bytes: int = CHECKPOINT_BYTES,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.partial, self.size, self.digest = partial, size, digest
        self.checkpoint_bytes = checkpoint_bytes
        self.on_bytes = on_bytes
        self.lock = threading.Lock()
        self.ranges: list[tuple[int, int]] = []
        self.hash = hashlib.sha256()
        self.hashed = 0
        self.since_checkpoint = 0
        self.fd = -1

    # -- opening and closing (blocking) --

    def open(self) -> int:
        """Open the partial, keeping what a previous copy of this version left; returns the
        bytes kept (already hashed: the one read of the kept prefix)."""
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        kept = read_sidecar(self.partial, self.size, self.digest)
        flags = os.O_RDWR | os.O_CREAT | (0 if kept else os.O_TRUNC)
        self.fd = os.open(self.partial, flags, 0o644)
        self.ranges = kept
        with self.lock:
            self._catch_up()
        return sum(b - a for a, b in kept)

    def done(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def todo(self) -> list[tuple[int, int]]:
        return missing(self.ranges, self.size)

    def finish(self) -> str:
        """Everything arrived: the whole file's SHA-256 hex (read back what was not hashed
        in passing), its data flushed to disk. The caller compares and renames."""
        with self.lock:
            if self.todo():
                raise ValueError(f"{self.partial.name}: {self.size - self.done()} bytes never arrived")
            self._catch_up()
            os.ftruncate(self.fd, self.size)
            full_fsync(self.fd)
            return self.hash.hexdigest()

    def commit(self, final: Path) -> None:
        """The finished, checked file takes its name; the resume record goes."""
        os.close(self.fd)
        self.fd = -1
        os.replace(self.partial, final)
        sidecar_path(self.partial).unlink(missing_ok=True)

    def close(self, *, keep: bool) -> None:
        """Close the partial; ``keep``: record what arrived for the next copy, else remove it."""
        if self.fd >= 0:
            try:
                if keep and self.ranges:
                    with self.lock:
                        self._checkpoint()
            except OSError:
                keep = False
            os.close(self.fd)
            self.fd = -1
        if not keep:
            self.discard()

    def discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        sidecar_path(self.partial).unlink(missing_ok=True)

    # -- arriving bytes (any thread) --

    def write(self, offset: int, data: memoryview) -> None:
        """``data`` belongs at ``offset``: write it, hash it if it is next, record it."""
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"{len(data)} bytes at {offset} lie outside a file of {self.size}")
        view, pos = data, offset
        while view:
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n
        with self.lock:
            if offset == self.hashed:
                self.hash.update(data)  # releases the GIL: other stripes keep receiving
                self.hashed += len(data)
            self.ranges = merge(self.ranges, offset, offset + len(data))
            self._catch_up()
            self.since_checkpoint += len(data)
            if self.since_checkpoint >= self.checkpoint_bytes:
                # Only the data, and not F_FULLFSYNC: a checkpoint bounds what a crash loses,
                # the final flush (finish) is what makes the file durable.
                (getattr(os, "fdatasync", None) or os.fsync)(self.fd)
                self._checkpoint()
        if self.on_bytes is not None:
            self.on_bytes(len(data))

    def _catch_up(self) -> None:
        """Hash what was written at the hash's position by others (read back from the partial)."""
        end = next((b for a, b in self.ranges if a <= self.hashed < b), self.hashed)
        while self.hashed < end:
            chunk = os.pread(self.fd, min(READ_BACK, end - self.hashed), self.hashed)
            if not chunk:
                raise OSError(f"{self.partial} is shorter than what was written to it")
            self.hash.update(chunk)
            self.hashed += len(chunk)

    def _checkpoint(self) -> None:
        self.since_checkpoint = 0
        record = {"size": self.size, "sha256": self.digest, "ranges": [list(r) for r in self.ranges[:RANGES_MAX]]}
        write_atomically(sidecar_path(self.partial), json.dumps(record).encode())
