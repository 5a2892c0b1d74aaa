"""Model-free stateful testing of the Raft core with hypothesis.

Three to five ``Raft`` objects exchange wire-encoded messages through a network the test
controls completely: any pending message may be delivered (in any order), dropped or
duplicated; time advances; nodes crash and restart from exactly what they persisted;
clients propose, read and ask for leadership transfers. After every step the safety
properties are checked:

- election safety: at most one leader per term;
- log matching / state machine safety: committed (and applied) entries never conflict
  between nodes, and two nodes that applied the same index hold the same state;
- a live node's commit index never decreases;
- the persist-before-send contract (hard state, votes and acknowledged entries are on
  "disk" before any message that relies on them leaves);
- a committed entry is durably held by a majority of the voters.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from p2pmesh.core import wire
from p2pmesh.core.cluster import empty_state
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.log import RaftLog
from p2pmesh.core.messages import (
    AddLearner,
    AppendEntries,
    AppendResponse,
    Capabilities,
    ClusterState,
    Command,
    Config,
    Entry,
    Message,
    Peer,
    Promote,
    Put,
    Snapshot,
    VoteRequest,
    VoteResponse,
)
from p2pmesh.core.raft import HardState, Raft, RaftOutput, Role
from p2pmesh.core.settings import Settings

CL = ClusterId("stateful")
CAPS = Capabilities(1, "M2 Max")
PENDING_MAX = 400


def peer(i: int) -> Peer:
    return Peer(NodeId(f"{i:032x}"), 500 + i)


@dataclass
class Disk:
    hard: HardState
    snapshot: Snapshot
    entries: list[Entry]

    def term_at(self, index: int) -> int | None:
        if index == self.snapshot.index:
            return self.snapshot.term
        if index < self.snapshot.index:
            return -1  # compacted: committed by construction
        pos = index - self.snapshot.index - 1
        return self.entries[pos].term if pos < len(self.entries) else None


class RaftCluster(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.peers: list[Peer] = []
        self.rafts: dict[NodeId, Raft | None] = {}
        self.disks: dict[NodeId, Disk] = {}
        self.pending: list[tuple[NodeId, NodeId, bytes]] = []
        self.now = 0
        self.rng = random.Random(0)
        self.settings = Settings()
        self.leaders: dict[int, NodeId] = {}
        self.committed: dict[int, tuple[int, Command]] = {}
        self.applied_states: dict[int, ClusterState] = {}
        self.last_commit: dict[NodeId, int] = {}
        self.keys = 0
        self.reads_ok = 0

    # --- setup ------------------------------------------------------------------------
    @initialize(
        n=st.integers(min_value=3, max_value=5),
        snapshot_every=st.sampled_from([3, 5, 10_000]),
        via_entries=st.booleans(),
        seed=st.integers(min_value=0, max_value=2**16),
    )
    def setup(self, n: int, snapshot_every: int, via_entries: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.settings = Settings(snapshot_every_entries=snapshot_every, entries_per_append_max=4)
        self.peers = [peer(i) for i in range(1, n + 1)]
        for p in self.peers:
            if via_entries:
                entries: list[Entry] = []
                for q in self.peers:
                    entries.append(Entry(len(entries) + 1, 1, AddLearner(q.node_id, q.inc, (), CAPS)))
                    entries.append(Entry(len(entries) + 1, 1, Promote(q.node_id, q.inc)))
                disk = Disk(HardState(1, None), Snapshot(0, 0, Config((), ()), empty_state(CL)), entries)
            else:
                disk = Disk(HardState(0, None), Snapshot(0, 0, Config(tuple(self.peers), ()), empty_state(CL)), [])
            self.disks[p.node_id] = disk
            self._start(p)

    def _start(self, p: Peer) -> None:
        disk = self.disks[p.node_id]
        log = RaftLog(disk.snapshot, list(disk.entries))
        r = Raft(
            me=p,
            cluster=CL,
            hard=disk.hard,
            log=log,
            settings=self.settings,
            rng=random.Random(self.rng.getrandbits(32)),
            now_ms=self.now,
        )
        self.rafts[p.node_id] = r
        self.last_commit[p.node_id] = r.commit
        self._flush(r)

    # --- the driver ---------------------------------------------------------------------
    def _flush(self, r: Raft) -> None:
        out = r.take_output()
        disk = self.disks[r.me.node_id]
        if out.hard_state is not None:
            disk.hard = out.hard_state
        if out.snapshot is not None:
            disk.snapshot = out.snapshot
            disk.entries = [e for e in disk.entries if e.index > out.snapshot.index]
        if out.log_dirty_from is not None:
            cut = out.log_dirty_from
            disk.entries = [e for e in disk.entries if e.index < cut] + [e for e in r.log.entries if e.index >= cut]
        assert disk.entries == r.log.entries and disk.snapshot == r.log.snapshot
        for dst, msg in out.messages:
            self._check_durable(r, disk, msg)
            if len(self.pending) < PENDING_MAX:
                self.pending.append((r.me.node_id, dst, wire.encode(msg)))
        self._record_applied(r, out)

    def _check_durable(self, r: Raft, disk: Disk, msg: Message) -> None:
        hdr = msg.hdr  # type: ignore[union-attr]
        if isinstance(msg, (VoteRequest, VoteResponse)) and msg.prevote:
            return
        assert disk.hard.term >= hdr.term, "message of a term that is not persisted"
        if isinstance(msg, VoteResponse) and msg.granted:
            assert disk.hard == HardState(hdr.term, Peer(hdr.dst, hdr.dst_inc)), "vote not persisted"
        if isinstance(msg, AppendResponse) and msg.success:
            assert disk.term_at(msg.index) is not None, "acknowledged an entry that is not persisted"
        if isinstance(msg, AppendEntries):
            for e in msg.entries:
                assert disk.term_at(e.index) in (e.term, -1), "sent an entry that is not persisted"

    def _record_applied(self, r: Raft, out: RaftOutput) -> None:
        for e in out.applied:
            known = self.committed.setdefault(e.index, (e.term, e.command))
            assert known == (e.term, e.command), f"two different entries applied at index {e.index}"
        if out.applied or out.snapshot is not None:
            known_state = self.applied_states.setdefault(r.applied, r.state)
            assert known_state == r.state, f"two different states at applied index {r.applied}"

    def _live(self) -> list[Raft]:
        return [r for r in self.rafts.values() if r is not None]

    def _node(self, k: int) -> Raft | None:
        return self.rafts[self.peers[k % len(self.peers)].node_id]

    def _leader(self) -> Raft | None:
        leaders = [r for r in self._live() if r.role is Role.LEADER]
        return max(leaders, key=lambda r: r.term) if leaders else None

    def _deliver(self, src: NodeId, dst: NodeId, data: bytes) -> None:
        r = self.rafts.get(dst)
        if r is None:
            return
        msg = wire.decode(data)
        if msg.hdr.dst_inc != r.me.inc or msg.hdr.cluster != CL:
            return
        assert msg.hdr.src == src
        r.step(msg, self.now)
        self._flush(r)

    # --- rules ----------------------------------------------------------------------------
    @precondition(lambda self: bool(self.pending))
    @rule(i=st.integers(min_value=0, max_value=10_000))
    def deliver(self, i: int) -> None:
        src, dst, data = self.pending.pop(i % len(self.pending))
        self._deliver(src, dst, data)

    @precondition(lambda self: bool(self.pending))
    @rule()
    def deliver_oldest(self) -> None:
        src, dst, data = self.pending.pop(0)
        self._deliver(src, dst, data)

    @precondition(lambda self: bool(self.pending))
    @rule(i=st.integers(min_value=0, max_value=10_000))
    def drop(self, i: int) -> None:
        self.pending.pop(i % len(self.pending))

    @precondition(lambda self: bool(self.pending))
    @rule(i=st.integers(min_value=0, max_value=10_000))
    def duplicate(self, i: int) -> None:
        if len(self.pending) < PENDING_MAX:
            self.pending.append(self.pending[i % len(self.pending)])

    @rule()
    def deliver_all(self) -> None:
        for _ in range(300):
            if not self.pending:
                break
            src, dst, data = self.pending.pop(0)
            self._deliver(src, dst, data)

    @rule(
        ms=st.integers(min_value=10, max_value=700),
        loss=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
        dup=st.sampled_from([0.0, 0.05]),
        writes=st.integers(min_value=0, max_value=3),
    )
    def run(self, ms: int, loss: float, dup: float, writes: int) -> None:
        """A stretch of ordinary weather: 10 ms steps, every pending message delivered in
        a random order, some lost or duplicated, a few client writes to the leader."""
        end = self.now + ms
        while self.now < end:
            self.now = min(end, self.now + 10)
            for r in self._live():
                r.tick(self.now)
                self._flush(r)
            if writes and self.rng.random() < 0.2:
                writes -= 1
                self.propose_to_leader()
            for _ in range(6):
                batch, self.pending = self.pending, []
                if not batch:
                    break
                self.rng.shuffle(batch)
                for src, dst, data in batch:
                    roll = self.rng.random()
                    if roll < loss:
                        continue
                    if roll > 1 - dup:
                        self.pending.append((src, dst, data))
                    self._deliver(src, dst, data)

    @rule(ms=st.integers(min_value=50, max_value=700), writes=st.integers(min_value=0, max_value=4))
    def calm(self, ms: int, writes: int) -> None:
        """Clear weather: no loss, no duplicates (lets elections and commits happen)."""
        self.run(ms, 0.0, 0.0, writes)

    @rule(ms=st.integers(min_value=1, max_value=250))
    def advance(self, ms: int) -> None:
        self.now += ms
        for r in self._live():
            r.tick(self.now)
            self._flush(r)

    @rule(k=st.integers(min_value=0, max_value=4), ms=st.integers(min_value=1, max_value=400))
    def tick_one(self, k: int, ms: int) -> None:
        """Only one node's clock fires (the others are slow): provokes elections."""
        self.now += ms
        r = self._node(k)
        if r is not None:
            r.tick(self.now)
            self._flush(r)

    @rule(k=st.integers(min_value=0, max_value=4))
    def crash(self, k: int) -> None:
        p = self.peers[k % len(self.peers)]
        if self.rafts[p.node_id] is not None and len(self._live()) > 1:
            self.rafts[p.node_id] = None
            self.pending = [m for m in self.pending if m[0] != p.node_id]  # its unsent sends vanish

    @rule(k=st.integers(min_value=0, max_value=4))
    def restart(self, k: int) -> None:
        p = self.peers[k % len(self.peers)]
        if self.rafts[p.node_id] is None:
            before = self.disks[p.node_id].hard
            self._start(p)
            r = self.rafts[p.node_id]
            assert r is not None and (r.term, r.vote) == (before.term, before.vote)

    @rule(k=st.integers(min_value=0, max_value=4))
    def propose(self, k: int) -> None:
        r = self._node(k)
        if r is None:
            return
        self.keys += 1
        index = r.propose(Put(f"k{self.keys}", str(self.now)), self.now)
        if r.role is not Role.LEADER:
            assert index is None
        self._flush(r)

    @rule()
    def propose_to_leader(self) -> None:
        r = self._leader()
        if r is not None:
            self.keys += 1
            r.propose(Put(f"k{self.keys}", "v"), self.now)
            self._flush(r)

    @rule(k=st.integers(min_value=0, max_value=4), ctx=st.integers(min_value=1, max_value=10**6))
    def read(self, k: int, ctx: int) -> None:
        r = self._node(k)
        if r is not None:
            r.read(ctx, self.now)
            self._flush(r)

    @rule(k=st.integers(min_value=0, max_value=4))
    def transfer(self, k: int) -> None:
        r = self._leader()
        if r is not None:
            r.transfer_leadership(self.peers[k % len(self.peers)], self.now)
            self._flush(r)

    # --- invariants -------------------------------------------------------------------------
    @invariant()
    def one_leader_per_term(self) -> None:
        for r in self._live():
            if r.role is Role.LEADER:
                holder = self.leaders.setdefault(r.term, r.me.node_id)
                assert holder == r.me.node_id, f"two leaders in term {r.term}"

    @invariant()
    def commit_never_decreases(self) -> None:
        for node, r in self.rafts.items():
            if r is None:
                continue
            assert r.commit >= self.last_commit[node], "commit index went backwards"
            assert r.applied == r.commit
            assert r.commit <= r.log.last_index
            self.last_commit[node] = r.commit

    @invariant()
    def committed_prefixes_agree(self) -> None:
        for r in self._live():
            for e in r.log.entries:
                if e.index > r.commit:
                    break
                known = self.committed.setdefault(e.index, (e.term, e.command))
                assert known == (e.term, e.command), f"conflicting committed entry at {e.index}"

    @invariant()
    def committed_entries_are_on_a_majority(self) -> None:
        leader = self._leader()
        if leader is None or leader.commit <= leader.log.snapshot.index:
            return
        index = leader.commit
        term = leader.log.term_at(index)
        for config in (leader.log.config_at(index), leader.config):
            holders = sum(1 for v in config.voters if self.disks[v.node_id].term_at(index) in (term, -1))
            if holders >= len(config.voters) // 2 + 1:
                return
        raise AssertionError(f"index {index} committed but held by no majority")

    @invariant()
    def leader_has_every_committed_entry(self) -> None:
        leader = self._leader()
        if leader is None:
            return
        for index, (term, _) in self.committed.items():
            if index > leader.log.snapshot.index:
                assert leader.log.term_at(index) == term, f"leader lacks committed entry {index}"

    def teardown(self) -> None:
        # Liveness once the weather clears: restart everyone, deliver everything in order.
        if not self.peers:
            return
        for p in self.peers:
            if self.rafts[p.node_id] is None:
                self._start(p)
        for _ in range(200):
            self.now += 10
            for r in self._live():
                r.tick(self.now)
                self._flush(r)
            self.deliver_all()
            self.one_leader_per_term()
            self.committed_prefixes_agree()
        leader = self._leader()
        assert leader is not None, "no leader after healing"
        assert all(r.leader == leader.me for r in self._live())
        for r in self._live():
            pr = leader.progress.get(r.me)
            if pr is not None and pr.match > r.log.last_index:
                # Seen with wider exploration (max_examples=1000): the known InstallSnapshot
                # bug, see test_raft.py::test_install_snapshot_matching_the_log_keeps_later_entries.
                raise AssertionError(f"leader's match {pr.match} exceeds the follower's log ({r.log.last_index})")
            assert r.commit == leader.commit, "a follower never caught up after healing"


RaftCluster.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRaftCluster = RaftCluster.TestCase
