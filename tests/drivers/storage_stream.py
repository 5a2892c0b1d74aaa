"""A deterministic stream of Readies for storage tests, and the child of the crash test.

ready_stream(seed) yields the durable parts a Raft node produces, drawn from a seeded
generator: hard-state changes, appends (now and then of large entries), overwrites of a
suffix with a newer term, compactions, snapshots installed from a leader (also merged with
an earlier append, as Machine builds them), becoming unformed, and joining new clusters.
Every Ready keeps the log contiguous after its snapshot, as Machine's Readies do.

Run as a script it is the crash-test child:
    python storage_stream.py STATE_DIR SEED START REWRITE_MIN_BYTES
opens the storage, prints "open", then saves Readies START+1, START+2, ... of the stream,
printing "ack K" after save K returned, until it is killed (or LIMIT saves are done).
"""
from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import NodeHardState, Ready
from p2pmesh.core.messages import (
    ClusterState,
    Command,
    Config,
    Entry,
    Noop,
    Peer,
    Put,
    Snapshot,
)

CHILD_SAVES_MAX = 100_000
NODES = tuple(NodeId(f"{i:032x}") for i in range(1, 6))
BIG_VALUE_CHARS = 4_000


class _Model:
    """Just enough of a node to draw valid Readies: identity, term, and the log's shape."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.cluster: ClusterId | None = None
        self.inc = rng.randint(1, 2**63 - 1)
        self.term = 0
        self.vote: Peer | None = None
        self.snap_index = 0
        self.snap_term = 0
        self.terms: list[int] = []
        """Terms of the entries after the snapshot."""

    @property
    def last(self) -> int:
        return self.snap_index + len(self.terms)

    def hard(self) -> NodeHardState:
        return NodeHardState(self.cluster, self.inc, self.term, self.vote)

    def term_at(self, index: int) -> int:
        return self.snap_term if index == self.snap_index else self.terms[index - self.snap_index - 1]

    def command(self, index: int, big: bool) -> Command:
        if big:
            return Put(f"big{index}", "x" * BIG_VALUE_CHARS)
        if self.rng.random() < 0.1:
            return Noop()
        return Put(f"k{index}", "v" * self.rng.randint(0, 40))

    def new_entries(self, start: int, count: int, big: bool = False) -> tuple[Entry, ...]:
        return tuple(Entry(i, self.term, self.command(i, big)) for i in range(start, start + count))

    def snapshot(self, index: int, term: int) -> Snapshot:
        kv = tuple((f"k{i}", f"v{index}") for i in range(self.rng.randint(0, 30)))
        voters = tuple(Peer(n, 7) for n in NODES[: self.rng.randint(1, 5)])
        state = ClusterState(self.cluster or ClusterId(""), (), index, (), kv)
        return Snapshot(index, term, Config(voters, ()), state)

    def bump_term(self) -> None:
        self.term += 1
        self.vote = self.rng.choice((None, Peer(self.rng.choice(NODES), 7)))

    # -- operations; each returns one Ready and updates the model as the Ready does -----

    def append(self, big: bool = False) -> Ready:
        ready = Ready()
        if self.rng.random() < 0.2:
            self.bump_term()
            ready.hard = self.hard()
        count = self.rng.randint(1, 3) if big else self.rng.choice((1, 1, 2, 3, 5, 8, 40))
        entries = self.new_entries(self.last + 1, count, big)
        self.terms += [e.term for e in entries]
        ready.log_truncate_from = entries[0].index
        ready.log_entries = entries
        return ready

    def hard_only(self) -> Ready:
        self.bump_term()
        return Ready(hard=self.hard())

    def overwrite(self) -> Ready:
        """A new leader's entries replace an uncommitted suffix (possibly with none)."""
        cut = self.rng.randint(self.snap_index + 1, self.last + 1)
        self.bump_term()
        entries = self.new_entries(cut, self.rng.randint(0, 5))
        del self.terms[cut - self.snap_index - 1 :]
        self.terms += [e.term for e in entries]
        return Ready(hard=self.hard(), log_truncate_from=cut, log_entries=entries)

    def compact(self) -> Ready:
        if not self.terms:
            return self.append()
        index = self.rng.randint(self.snap_index + 1, self.last)
        snap = self.snapshot(index, self.term_at(index))
        del self.terms[: index - self.snap_index]
        self.snap_index, self.snap_term = index, snap.term
        return Ready(snapshot=snap)

    def append_and_compact(self) -> Ready:
        """Appended entries that are applied and compacted within the same Ready."""
        start = self.last + 1
        entries = self.new_entries(start, self.rng.randint(2, 8))
        self.terms += [e.term for e in entries]
        index = self.rng.randint(start, self.last)
        snap = self.snapshot(index, self.term_at(index))
        del self.terms[: index - self.snap_index]
        self.snap_index, self.snap_term = index, snap.term
        return Ready(snapshot=snap, log_truncate_from=start, log_entries=tuple(e for e in entries if e.index > index))

    def install(self, merged: bool) -> Ready:
        """A leader's snapshot beyond our log. ``merged``: the Ready also carries an
        earlier truncation point, as when an append and the install share one Ready."""
        index = self.last + self.rng.randint(1, 30)
        snap = self.snapshot(index, self.term)
        cut = self.rng.randint(self.snap_index + 1, self.last + 1) if merged else index + 1
        self.snap_index, self.snap_term, self.terms = index, snap.term, []
        entries = self.new_entries(index + 1, self.rng.randint(0, 3)) if merged else ()
        self.terms += [e.term for e in entries]
        return Ready(hard=self.hard() if self.rng.random() < 0.5 else None, snapshot=snap, log_truncate_from=cut, log_entries=entries)

    def switch(self) -> Ready:
        """Join or found another cluster: fresh incarnation, base snapshot, truncate from 1."""
        self.cluster = ClusterId(f"{self.rng.getrandbits(64):016x}")
        self.inc = self.rng.randint(1, 2**63 - 1)
        self.snap_index = self.snap_term = 0
        self.terms = []
        found = self.rng.random() < 0.5
        self.term, self.vote = (1, Peer(NODES[0], self.inc)) if found else (0, None)
        base = self.snapshot(0, 0)
        entries = self.new_entries(1, 2) if found else ()
        self.terms = [e.term for e in entries]
        return Ready(hard=self.hard(), snapshot=base, log_truncate_from=1, log_entries=entries)

    def unformed(self) -> Ready:
        self.cluster = None
        self.inc = self.rng.randint(1, 2**63 - 1)
        self.term, self.vote = 0, None
        return Ready(hard=self.hard())


def ready_stream(seed: int) -> Iterator[Ready]:
    """An endless, deterministic stream of Readies with durable parts."""
    rng = random.Random(seed)
    m = _Model(rng)
    yield Ready(hard=m.hard())  # what Machine.boot saves for a fresh node
    yield m.switch()
    ops = (
        (m.append, 50), (m.hard_only, 8), (m.overwrite, 8), (m.compact, 5), (m.append_and_compact, 3),
        (lambda: m.install(False), 2), (lambda: m.install(True), 2), (lambda: m.append(big=True), 3),
        (m.switch, 1), (m.unformed, 1),
    )
    funcs = [f for f, _ in ops]
    weights = [w for _, w in ops]
    while True:
        op = rng.choices(funcs, weights)[0]
        yield op()
        if m.cluster is None:
            yield m.switch()


def _child(argv: list[str]) -> int:
    from p2pmesh.drivers.storage import Storage

    state_dir, seed, start, rewrite_min = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    storage = Storage.open(state_dir, rewrite_min_bytes=rewrite_min)
    print("open", flush=True)
    for k, ready in enumerate(ready_stream(seed), 1):
        if k > start + CHILD_SAVES_MAX:
            break
        if k > start:
            storage.save(ready)
            print(f"ack {k}", flush=True)  # only after save returned: this is the promise checked
    storage.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
