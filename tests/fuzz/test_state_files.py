"""Fuzz target: the state files (drivers/storage.py, drivers/records.py, drivers/keys.py),
written by the real writers and then damaged the ways disks and crashes damage files.

- wal: bit flips, overwritten bytes and sectors, zeroed ranges, truncation, garbage after a
  cut. Storage.open either loads the state of a prefix of the batches the writer saved, or
  raises StateCorrupted naming the file; never another exception, never any other state.
- wal, structure-aware: records with valid checksums around hostile payloads (other kinds'
  payloads, mutated msgpack, wrong wire values, END flags anywhere). Storage.open raises
  StateCorrupted or loads a state that holds together (entries contiguous after the
  snapshot, a non-negative term).
- identity: any damage to the one-record file is StateCorrupted naming it, else the seed.
- cluster.key: any damage gives back the same key (case, spacing and dashes do not matter)
  or raises keys.KeyError_ naming the file.

Single flips at every offset and torn tails at every cut point are in
tests/drivers/test_storage.py; the known limit of checksums (a stale but intact copy of an
earlier batch) is the expected failure at the end of this file.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from p2pmesh.core import wire
from p2pmesh.core.errors import StateCorrupted
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import NodeHardState, PersistedState, Ready
from p2pmesh.core.messages import ClusterState, Config, Entry, Noop, Peer, Put, Snapshot
from p2pmesh.drivers import keys, records, storage
from p2pmesh.drivers.records import Kind
from p2pmesh.drivers.storage import Storage
from tests.core.test_wire import ALL_EXAMPLES
from tests.fuzz import fuzz_settings, tally

A = NodeId("a" * 32)
B = NodeId("b" * 32)
C1 = ClusterId("c1")
SECTOR = 512


def _entries(lo: int, hi: int, term: int) -> tuple[Entry, ...]:
    return tuple(Entry(i, term, Put(f"k{i}", f"t{term}" * (i % 5))) for i in range(lo, hi + 1))


def _hard(term: int, cluster: ClusterId | None = C1, inc: int = 1, vote: Peer | None = None) -> NodeHardState:
    return NodeHardState(cluster, inc, term, vote)


READIES = [
    Ready(hard=_hard(0, None, 5)),
    Ready(hard=_hard(1, C1, 1, Peer(A, 1)), log_truncate_from=1, log_entries=_entries(1, 2, 1)),
    Ready(log_truncate_from=3, log_entries=_entries(3, 10, 1)),
    Ready(hard=_hard(2, vote=Peer(B, 9))),
    Ready(hard=_hard(3), log_truncate_from=7, log_entries=_entries(7, 8, 3)),
    Ready(log_truncate_from=9, log_entries=_entries(9, 30, 3)),
    Ready(hard=_hard(4), log_truncate_from=31, log_entries=(Entry(31, 4, Noop()),)),
]


def _write_wal(state_dir: Path) -> tuple[bytes, list[PersistedState | None]]:
    """The wal the real writer leaves after READIES, and the state after each prefix of its
    batches (the format record alone loads as None)."""
    with Storage.open(state_dir) as st:
        states = [st.load()]
        for ready in READIES:
            st.save(ready)
            states.append(st.load())
    return (state_dir / storage.WAL_FILE).read_bytes(), states


def _fresh_dir(tag: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"p2pmesh-fuzz-{tag}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # also when no test of this file ran
    return path


_BASE = _fresh_dir("wal")
WAL, STATES = _write_wal(_BASE)
_SCRATCH = _fresh_dir("scratch")
"""Where each input is written and opened (one directory: creating one per input is slow)."""
assert len(WAL) > 2 * SECTOR  # damage to whole sectors must leave something to read


@st.composite
def _damaged(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` after one to four things disks and crashes do."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "overwrite", "zero", "sector", "truncate", "garbage-tail", "zero-tail")))
        n = len(data)
        pos = draw(st.integers(0, max(0, n - 1)))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "overwrite" and n:
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[pos:pos + len(chunk)] = chunk[: n - pos]
        elif op == "zero":
            length = draw(st.integers(1, 64))
            data[pos:pos + length] = bytes(len(data[pos:pos + length]))
        elif op == "sector":  # a whole sector lost: zeros or another sector's bytes
            start = (pos // SECTOR) * SECTOR
            fill = bytes(SECTOR) if draw(st.booleans()) else draw(st.binary(min_size=SECTOR, max_size=SECTOR))
            data[start:start + SECTOR] = fill[: len(data[start:start + SECTOR])]
        elif op == "truncate":
            del data[pos:]
        elif op == "garbage-tail":  # a cut, then whatever the blocks held
            del data[pos:]
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "zero-tail":  # the size reached the disk before the data
            data += bytes(draw(st.integers(1, 2 * SECTOR)))
    return bytes(data)


def _open_or_corrupted(state_dir: Path) -> PersistedState | None | StateCorrupted:
    try:
        with Storage.open(state_dir) as st:
            return st.load()
    except StateCorrupted as exc:
        return exc


@fuzz_settings(default=250)
@given(_damaged(WAL))
@example(WAL[: len(WAL) // 2])
@example(WAL + bytes(100))
@example(WAL[:-1] + bytes([WAL[-1] ^ 1]))
def test_a_damaged_wal_loads_a_saved_prefix_or_is_refused(data: bytes) -> None:
    state_dir = _SCRATCH
    wal = state_dir / storage.WAL_FILE
    wal.write_bytes(data)
    got = _open_or_corrupted(state_dir)
    if isinstance(got, StateCorrupted):
        assert str(wal) in str(got) and "move the state directory aside" in str(got)
        tally("wal", "refused")
    else:
        assert got in STATES, "the wal loaded a state the writer never saved"
        # A torn tail is cut, and the file then reopens to the very same state.
        assert _open_or_corrupted(state_dir) == got
        tally("wal", "accepted" if data == WAL else "accepted: saved prefix")


# --------------------------------------------------------------------------------------
# Records with valid checksums around hostile payloads

_PAYLOADS: list[bytes] = [
    records.encode_format(),
    records.encode_hard(_hard(3)),
    records.encode_hard(NodeHardState(None, 1, 0, None)),
    records.encode_cut(1),
    records.encode_cut(9),
    *[wire.encode(e) for e in _entries(1, 3, 1)],
    wire.encode(Entry(40, 2, Noop())),
    wire.encode(Snapshot(5, 1, Config((Peer(A, 1),), ()), ClusterState(C1, (), 0, (), (("k", "v"),)))),
    wire.encode(Snapshot(0, 0, Config((), ()), ClusterState(ClusterId(""), (), 0, (), ()))),
    *[wire.encode(m) for m in ALL_EXAMPLES[::5]],
    msgpack.packb([None, 1, -1, None]),
    msgpack.packb(["c1", 2**63 - 1, 2**63 - 1, ["a", 1]]),
    msgpack.packb([records.FORMAT_NAME, 2]),
    msgpack.packb(0),
    msgpack.packb(-5),
    bytes(32),
]


@st.composite
def _hostile_wal(draw: st.DrawFn) -> bytes:
    """Records chained as the writer chains them (version 2), so the payloads reach the
    parser; now and then one is left unchained, which its chain check must refuse."""
    out = [records.frame(Kind.FORMAT, records.encode_format(), end=True)] if draw(st.integers(0, 9)) else []
    chain = records.header_digest(out[0]) if out else b""
    for _ in range(draw(st.integers(0, 10))):
        kind = draw(st.sampled_from(list(Kind)))
        payload = draw(st.one_of(st.sampled_from(_PAYLOADS), st.binary(max_size=40)))
        if draw(st.integers(0, 3)) == 0 and payload:
            cut = draw(st.integers(0, len(payload) - 1))
            payload = payload[:cut] + draw(st.binary(max_size=4)) + payload[cut + 1:]
        record = records.frame(kind, payload, end=draw(st.booleans()), chain=b"" if draw(st.integers(0, 15)) == 0 else chain)
        chain = records.header_digest(record)
        out.append(record)
    return b"".join(out)


def _holds_together(p: PersistedState) -> bool:
    first = p.snapshot.index + 1
    return (p.hard.term >= 0 and p.snapshot.index >= 0
            and all(isinstance(e, Entry) and e.index == first + i for i, e in enumerate(p.entries)))


@fuzz_settings(default=250)
@given(_hostile_wal())
def test_records_with_good_checksums_and_bad_contents_are_refused_or_consistent(data: bytes) -> None:
    state_dir = _SCRATCH
    wal = state_dir / storage.WAL_FILE
    wal.write_bytes(data)
    got = _open_or_corrupted(state_dir)
    if isinstance(got, StateCorrupted):
        assert str(wal) in str(got)
        tally("wal records", "refused")
    else:
        assert got is None or _holds_together(got), got
        tally("wal records", "accepted")


# --------------------------------------------------------------------------------------
# The identity file and the cluster key file

SEED = bytes(range(100, 132))
_ID_DIR = _fresh_dir("identity")
with Storage.open(_ID_DIR) as _st:
    _st.save_identity_seed(SEED)
IDENTITY = (_ID_DIR / storage.IDENTITY_FILE).read_bytes()


@st.composite
def _edited(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` damaged, or edited (bytes inserted or removed, as a text editor might)."""
    if draw(st.booleans()):
        return draw(_damaged(original))
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            data[pos:pos] = draw(st.one_of(st.binary(min_size=1, max_size=8), st.sampled_from([b"-", b" ", b"\n", b"\r\n"])))
        else:
            del data[pos:pos + draw(st.integers(1, 8))]
    return bytes(data)


@fuzz_settings(default=200)
@given(_edited(IDENTITY))
@example(b"")
@example(IDENTITY + IDENTITY)
def test_a_damaged_identity_is_refused(data: bytes) -> None:
    state_dir = _SCRATCH
    (state_dir / storage.WAL_FILE).unlink(missing_ok=True)
    path = state_dir / storage.IDENTITY_FILE
    path.write_bytes(data)
    try:
        with Storage.open(state_dir) as st:
            seed = st.load_identity_seed()
    except StateCorrupted as exc:
        assert str(path) in str(exc)
        tally("identity", "refused")
    else:
        assert data == IDENTITY and seed == SEED
        tally("identity", "accepted")
    path.unlink()


KEY = bytes(range(32))
_KEY_DIR = _fresh_dir("key")
keys.write_key(_KEY_DIR / keys.KEY_FILE, KEY)
KEY_TEXT = (_KEY_DIR / keys.KEY_FILE).read_bytes()


@fuzz_settings(default=300)
@given(st.one_of(_edited(KEY_TEXT), st.binary(max_size=120), st.just(KEY_TEXT.lower()), st.just(KEY_TEXT.replace(b"-", b" "))))
# Regression: a key file that is not UTF-8 raised UnicodeDecodeError, which named no file
# and which `p2pmesh key show` and `p2pmesh doctor` did not catch.
@example(b"\xff\xfe" + KEY_TEXT)
def test_a_damaged_key_file_gives_the_key_or_a_clear_error(data: bytes) -> None:
    path = _KEY_DIR / "edited.key"
    path.write_bytes(data)
    try:
        key = keys.read_key(path)
    except keys.KeyError_ as exc:
        assert str(exc).startswith(f"{path}: ")
        tally("cluster key", "refused")
    else:
        assert key == KEY  # the same key (a typo that kept the check group is 1 in 2**24)
        tally("cluster key", "accepted")


@pytest.fixture(scope="module", autouse=True)
def _no_fsync() -> Any:
    # Reading is under test here, not durability: opening a wal with a torn tail cuts it
    # and fsyncs, which would make every such input wait for the disk.
    real = storage.full_fsync
    storage.full_fsync = lambda fd: None
    yield
    storage.full_fsync = real


# --------------------------------------------------------------------------------------
# Checksums chained record to record


def test_a_stale_copy_of_an_earlier_batch_is_refused() -> None:
    """Records are chained (records.py): an intact copy of an earlier batch (stale blocks
    after a crash, a misdirected write) fails its checksum where it lands. Before version 2
    of the wal it replayed as a new batch and loaded an older hard state with no error."""
    state_dir = _fresh_dir("stale")
    try:
        with Storage.open(state_dir) as st:
            st.save(Ready(hard=_hard(1)))
            size = (state_dir / storage.WAL_FILE).stat().st_size
            st.save(Ready(hard=_hard(7, vote=Peer(A, 1))))
        wal = state_dir / storage.WAL_FILE
        data = wal.read_bytes()
        first_batch = data[len(records.frame(Kind.FORMAT, records.encode_format(), end=True)):size]
        wal.write_bytes(data + first_batch)
        got = _open_or_corrupted(state_dir)
        assert isinstance(got, StateCorrupted), f"loaded term {got.hard.term if got else None} after term 7 was saved"
    finally:
        shutil.rmtree(state_dir)
