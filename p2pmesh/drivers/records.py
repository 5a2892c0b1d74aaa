"""Records: the byte layout of the storage driver's files, and the payload of each kind.

Owns framing (length prefix, checksums, the end-of-batch flag), scanning a file back into
records (telling a crash's torn tail from damage), and the codecs of record payloads. It
knows nothing about fsync, directories or what a batch means: storage.py owns those.

A record is a 24-byte header followed by its payload:

    offset  size  field
    0       4     payload length, big-endian, at most wire.FRAME_BYTES_MAX
    4       1     kind (Kind below)
    5       1     flags: bit 0 = END, the last record of a batch; other bits zero
    6       2     zero
    8       8     payload digest: SHA-256(chain + payload)[:8]
    16      8     header digest:  SHA-256(header bytes 0..16)[:8]

In a chained file (the wal from format version 2) ``chain`` is the header digest of the
record before, so each record vouches for its place: an intact copy of an earlier batch
(stale blocks after a crash, a misdirected write) fails its checksum where it lands instead
of replaying as a newer batch. The first record of a file, and every record of an unchained
file (version 1 wals, the identity file), use an empty chain.

The header carries its own digest so that a damaged length field reads as damage; without
it, a length made huge by a flipped bit would look like a record cut short by a crash and
the rest of the file would be dropped silently. 64 bits of SHA-256 make an undetected
random corruption practically impossible; the files defend against failing disks and
crashes, not against someone who can write the state directory.
"""
from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from p2pmesh.core import wire
from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError, StateCorrupted
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import NodeHardState
from p2pmesh.core.messages import Peer

_PRE = struct.Struct(">IBB2x8s")
HEADER_BYTES = _PRE.size + 8
DIGEST_BYTES = 8
FLAG_END = 0x01
FORMAT_NAME = "p2pmesh-wal"
FORMAT_VERSION = 2
"""Version 2 chains its records (see above); version 1 files are read and rewritten."""
FORMAT_VERSIONS_READ = (1, 2)
REMEDY = "move the state directory aside and restart the agent; the node then rejoins as a new member"

T = TypeVar("T")


class Kind(enum.IntEnum):
    FORMAT = 1
    """First record of a wal: names the format and its version."""
    HARD = 2
    """A NodeHardState (msgpack list, see encode_hard)."""
    SNAPSHOT = 3
    """A Snapshot, as wire.encode writes it."""
    CUT = 4
    """Drop stored entries with index >= this (msgpack int)."""
    ENTRY = 5
    """An Entry, as wire.encode writes it."""
    IDENTITY = 6
    """The node's 32-byte Ed25519 seed, raw."""


_KINDS = frozenset(k.value for k in Kind)


@dataclass(frozen=True, slots=True)
class Record:
    kind: Kind
    end: bool
    """The last record of its batch: storage replays a batch only once it reads this one, so
    records after the last end are an unfinished batch (a crash's torn tail)."""
    payload: bytes
    offset: int
    """Where the record's header starts in its file."""


@dataclass(frozen=True, slots=True)
class Scan:
    records: tuple[Record, ...]
    end: int
    """Offset just past the last complete record; the rest of the file is a torn tail."""


def corrupted(path: Path, why: str) -> StateCorrupted:
    return StateCorrupted(f"{path}: {why}. This state cannot be trusted: {REMEDY}.")


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def frame(kind: Kind, payload: bytes, *, end: bool, chain: bytes = b"") -> bytes:
    """One record's bytes (``chain``: the header digest of the record before, in a chained
    file). Refuses payloads over wire.FRAME_BYTES_MAX (nothing bigger can legitimately
    exist: every entry and snapshot also has to fit in one frame)."""
    if len(payload) > wire.FRAME_BYTES_MAX:
        raise LocalProtocolError(f"{kind.name} record of {len(payload)} bytes exceeds {wire.FRAME_BYTES_MAX}")
    pre = _PRE.pack(len(payload), kind, FLAG_END if end else 0, _digest(chain + payload))
    return pre + _digest(pre) + payload


def frames(parts: list[tuple[Kind, bytes]], chain: bytes) -> tuple[bytes, bytes]:
    """A batch of chained records, the last one flagged END, and the chain after it."""
    out = []
    last = len(parts) - 1
    for i, (kind, payload) in enumerate(parts):
        record = frame(kind, payload, end=i == last, chain=chain)
        chain = record[_PRE.size:HEADER_BYTES]
        out.append(record)
    return b"".join(out), chain


def header_digest(record: bytes) -> bytes:
    """The chain value a record passes on: its header digest."""
    return record[_PRE.size:HEADER_BYTES]


def scan(data: bytes, path: Path, *, torn_tail_ok: bool, start: int = 0, chain: bytes | None = None) -> Scan:
    """Split a file (from offset ``start``) into records, checking every digest; with
    ``chain`` (the header digest of the record before ``start``) as a chained file.

    With ``torn_tail_ok`` an incomplete final record (fewer bytes left than its header
    says, or than a header) ends the scan quietly: that is what a crash in the middle of an
    append leaves. So does a tail of zero bytes, which some filesystems leave after a power
    loss when a file's new size reached the disk before its data did. A complete record
    whose digest does not match is damage wherever it is, and raises StateCorrupted.
    """
    records: list[Record] = []
    pos = start
    size = len(data)
    while pos < size:
        if size - pos < HEADER_BYTES:
            if torn_tail_ok:
                break
            raise corrupted(path, f"file ends inside a record header at offset {pos}")
        pre = data[pos : pos + _PRE.size]
        if _digest(pre) != data[pos + _PRE.size : pos + HEADER_BYTES]:
            if torn_tail_ok and not any(data[pos:]):
                break
            raise corrupted(path, f"record header at offset {pos} fails its checksum")
        length, kind, flags, payload_digest = _PRE.unpack(pre)
        if length > wire.FRAME_BYTES_MAX or flags & ~FLAG_END or kind not in _KINDS:
            raise corrupted(path, f"record header at offset {pos} is malformed (kind {kind}, flags {flags}, length {length})")
        begin = pos + HEADER_BYTES
        if begin + length > size:
            if torn_tail_ok:
                break
            raise corrupted(path, f"file ends inside the record at offset {pos}")
        payload = data[begin : begin + length]
        if _digest((chain or b"") + payload) != payload_digest:
            where = " or is out of place (a copy of an earlier record)" if chain is not None else ""
            raise corrupted(path, f"record at offset {pos} fails its checksum{where}")
        if chain is not None:
            chain = data[pos + _PRE.size : pos + HEADER_BYTES]
        records.append(Record(Kind(kind), bool(flags & FLAG_END), payload, pos))
        pos = begin + length
    return Scan(tuple(records), pos)


# --------------------------------------------------------------------------------------
# Payload codecs. Decoders take the file's path so their errors name it.


def _unpack(payload: bytes, path: Path, what: str) -> Any:
    try:
        return msgpack.unpackb(
            payload, raw=False, max_str_len=wire.STR_LEN_MAX, max_bin_len=0, max_array_len=8, max_map_len=0, max_ext_len=0
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise corrupted(path, f"{what} record is not valid msgpack ({exc.__class__.__name__})") from None


def _is_int(v: Any) -> bool:
    return type(v) is int and wire.INT_MIN <= v <= wire.INT_MAX


def _is_str(v: Any) -> bool:
    return type(v) is str and len(v) <= wire.STR_LEN_MAX


def encode_format() -> bytes:
    return msgpack.packb([FORMAT_NAME, FORMAT_VERSION])


def check_format(payload: bytes, path: Path) -> int:
    """The file's format version (one this agent reads), or StateCorrupted."""
    raw = _unpack(payload, path, "format")
    if type(raw) is not list or len(raw) != 2 or raw[0] != FORMAT_NAME or type(raw[1]) is not int or raw[1] not in FORMAT_VERSIONS_READ:
        versions = " and ".join(str(v) for v in FORMAT_VERSIONS_READ)
        raise corrupted(path, f"unknown file format {raw!r} (this agent reads {FORMAT_NAME} versions {versions})")
    return int(raw[1])


def encode_hard(hard: NodeHardState) -> bytes:
    # NodeHardState has no wire tag (it never crosses the wire), so it gets a small list.
    vote = None if hard.vote is None else [hard.vote.node_id, hard.vote.inc]
    return msgpack.packb([hard.cluster, hard.inc, hard.term, vote])


def decode_hard(payload: bytes, path: Path) -> NodeHardState:
    raw = _unpack(payload, path, "hard state")
    ok = type(raw) is list and len(raw) == 4
    if ok:
        cluster, inc, term, vote = raw
        ok = (cluster is None or _is_str(cluster)) and _is_int(inc) and _is_int(term) and term >= 0
        ok = ok and (vote is None or (type(vote) is list and len(vote) == 2 and _is_str(vote[0]) and _is_int(vote[1])))
    if not ok:
        raise corrupted(path, "hard state record has the wrong shape")
    return NodeHardState(
        None if cluster is None else ClusterId(cluster),
        inc,
        term,
        None if vote is None else Peer(NodeId(vote[0]), vote[1]),
    )


def encode_cut(index: int) -> bytes:
    return msgpack.packb(index)


def decode_cut(payload: bytes, path: Path) -> int:
    raw = _unpack(payload, path, "truncation")
    if not _is_int(raw) or raw < 1:
        raise corrupted(path, f"truncation record holds {raw!r}, not an index")
    return int(raw)


def decode_value(payload: bytes, cls: type[T], path: Path) -> T:
    """Decode a registered wire value (an Entry or a Snapshot) and check its type."""
    try:
        value = wire.decode(payload)
    except RemoteProtocolError as exc:
        raise corrupted(path, f"{cls.__name__} record does not decode ({exc})") from None
    if not isinstance(value, cls):
        raise corrupted(path, f"expected a {cls.__name__} record, found a {type(value).__name__}")
    return value
