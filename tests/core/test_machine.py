"""Machine-level tests: formation, frame authentication, garbage, status, restarts.

Two drivers are used: sim.world.World (virtual network with latency and the simulator's
invariant checker), and a small in-test driver that delivers frames instantly in FIFO
order and fires timers exactly at ``next_deadline_ms``.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from p2pmesh.core import wire
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.identity import Identity
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import (
    Effects,
    FrameReceived,
    Input,
    LeaveRequested,
    Machine,
    Mode,
    NodeHardState,
    PeerDiscovered,
    PersistedState,
    ProposalRequested,
    Ready,
    ReadRequested,
    Status,
    TimerFired,
)
from p2pmesh.core.messages import (
    AppendEntries,
    Capabilities,
    ClusterState,
    Config,
    ForwardProposal,
    Header,
    Hello,
    JoinReply,
    JoinRequest,
    Member,
    Message,
    Noop,
    Peer,
    Put,
    RemovalNotice,
    RemoveMember,
    Snapshot,
    VoteRequest,
)
from p2pmesh.core.raft import Role
from p2pmesh.core.settings import Settings
from sim.disk import SimDisk
from sim.world import World

CAPS = Capabilities(2**36, "M4 Max")


def node_ids(n: int, seed: int = 0) -> list[NodeId]:
    rng = random.Random(seed)
    return [Identity.from_seed(rng.getrandbits(256).to_bytes(32, "big")).node_id for _ in range(n)]


def booted(node_id: NodeId, seed: int, *, persisted: PersistedState | None = None, caps: Capabilities | None = None) -> Machine:
    """A machine whose first Ready is saved and advanced (a driver whose disk never fails)."""
    extra = {"caps": caps} if caps is not None else {}
    m, ready = Machine.boot(node_id=node_id, persisted=persisted, settings=Settings(), rng=random.Random(seed), now_ms=0, **extra)
    m.advance(ready)
    return m


def step(m: Machine, event: Input, now_ms: int) -> Ready:
    """``handle``, then ``advance`` (the Ready saved and sent, as a driver does)."""
    ready = m.handle(event, now_ms)
    m.advance(ready)
    return ready


@dataclass
class Driver:
    """Instant FIFO delivery through the wire codec; a SimDisk per node, synced at once."""

    settings: Settings = field(default_factory=Settings)
    seed: int = 0
    now: int = 0
    machines: dict[NodeId, Machine] = field(default_factory=dict)
    disks: dict[NodeId, SimDisk] = field(default_factory=dict)
    queue: deque[tuple[NodeId, NodeId, bytes]] = field(default_factory=deque)
    readies: dict[NodeId, list[Ready]] = field(default_factory=dict)
    effects: dict[NodeId, list[Effects]] = field(default_factory=dict)
    """What advancing each Ready returned (saved, sent, then advanced: the agent's order)."""
    cut: set[NodeId] = field(default_factory=set)
    watch: dict[NodeId, list[str]] = field(default_factory=dict)
    """Nodes whose status().role is recorded after every input (changes only)."""

    def boot(self, node: NodeId, index: int) -> Machine:
        disk = self.disks.setdefault(node, SimDisk())
        m, ready = Machine.boot(
            node_id=node,
            persisted=disk.load(),
            settings=self.settings,
            rng=random.Random(f"{self.seed}-{node}-{self.now}"),
            now_ms=self.now,
            addresses=(f"10.0.0.{index}",),
            caps=CAPS,
        )
        self.machines[node] = m
        self.readies.setdefault(node, [])
        self.effects.setdefault(node, [])
        self._process(node, ready)
        return m

    def boot_all(self, nodes: list[NodeId]) -> None:
        for i, node in enumerate(nodes):
            self.boot(node, i + 1)
        for i, a in enumerate(nodes):
            for j, b in enumerate(nodes):
                if a != b:
                    self.handle(a, PeerDiscovered(b, (f"10.0.0.{j + 1}",)))

    def crash(self, node: NodeId) -> None:
        del self.machines[node]
        self.disks[node].crash(lose_unsynced=False)

    def handle(self, node: NodeId, event: Input) -> Ready:
        ready = self.machines[node].handle(event, self.now)
        self._process(node, ready)
        return ready

    def _process(self, node: NodeId, ready: Ready) -> None:
        self.readies[node].append(ready)
        disk = self.disks[node]
        disk.write(ready)
        disk.sync()
        for dst, msg in ready.messages:
            self.queue.append((node, dst, wire.encode(msg)))
        self.effects[node].append(self.machines[node].advance(ready))
        if ready.left:
            del self.machines[node]
        roles = self.watch.get(node)
        if roles is not None and node in self.machines:
            role = self.machines[node].status().role
            if not roles or roles[-1] != role:
                roles.append(role)

    def deliver_all(self, limit: int = 50_000) -> None:
        n = 0
        while self.queue:
            n += 1
            assert n < limit, "message storm"
            src, dst, data = self.queue.popleft()
            if dst in self.machines and src not in self.cut and dst not in self.cut:
                self.handle(dst, FrameReceived(src, data))

    def run(self, ms: int) -> None:
        end = self.now + ms
        while True:
            self.deliver_all()
            if not self.machines:
                self.now = end
                return
            due = min(m.next_deadline_ms() for m in self.machines.values())
            if due > end:
                self.now = end
                return
            self.now = max(self.now + 1, due)
            for node in list(self.machines):
                m = self.machines.get(node)
                if m is not None and m.next_deadline_ms() <= self.now:
                    self.handle(node, TimerFired())

    def run_until(self, cond: object, ms_max: int) -> bool:
        end = self.now + ms_max
        while self.now < end:
            self.run(10)
            if cond():  # type: ignore[operator]
                return True
        return False

    def converged(self) -> bool:
        ms = list(self.machines.values())
        if not ms or any(m.raft is None or m.mode is not Mode.MEMBER for m in ms):
            return False
        leaders = [m for m in ms if m.raft.role is Role.LEADER]  # type: ignore[union-attr]
        if len(leaders) != 1:
            return False
        lr = leaders[0].raft
        assert lr is not None
        if {m.node_id for m in lr.state.members} != set(self.machines):
            return False
        if not all(m.voter and m.up for m in lr.state.members):
            return False
        return all(
            m.raft.cluster == lr.cluster and m.raft.leader == lr.me and m.raft.commit == lr.commit  # type: ignore[union-attr]
            for m in ms
        )


def formed(n: int = 3, seed: int = 0) -> tuple[Driver, list[NodeId]]:
    d = Driver(seed=seed)
    ids = node_ids(n, seed)
    d.boot_all(ids)
    assert d.run_until(d.converged, 10_000), "no single cluster formed"
    return d, ids


def leader_of(d: Driver) -> Machine:
    (m,) = [m for m in d.machines.values() if m.raft is not None and m.raft.role is Role.LEADER]
    return m


def a_follower(d: Driver) -> Machine:
    return next(m for m in d.machines.values() if m.raft is not None and m.raft.role is Role.FOLLOWER)


def snapshot_of(m: Machine) -> tuple[object, ...]:
    r = m.raft
    raft_part = (
        (r.term, r.vote, r.role, r.leader, r.commit, r.applied, r.log.last_index, r.state) if r is not None else None
    )
    return (m.mode, m.inc, m.cluster, raft_part, len(m.peers))


# --------------------------------------------------------------------------------------
# Formation


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_world_formation_of_three_nodes_yields_one_cluster(seed: int) -> None:
    world = World(seed, nodes=3)
    for node in world.nodes:
        world.boot(node)
    assert world.run_until(5_000_000, stop=world.converged), "no single cluster within 5 s"
    machines = [n.machine for n in world.nodes]
    assert all(m is not None for m in machines)
    clusters = {m.cluster for m in machines if m is not None}
    assert len(clusters) == 1 and None not in clusters
    leader = world.leader()
    assert leader is not None and leader.machine is not None and leader.machine.raft is not None
    lr = leader.machine.raft
    assert len(lr.config.voters) == 3 and lr.config.learners == ()
    assert {m.node_id for m in lr.state.members} == {n.node_id for n in world.nodes}
    roles = sorted(m.status().role for m in machines if m is not None)
    assert roles == ["follower", "follower", "leader"]


def test_driver_formation_of_three_nodes_yields_one_cluster() -> None:
    d, ids = formed(3)
    ms = [d.machines[i] for i in ids]
    assert len({m.cluster for m in ms}) == 1
    leader = leader_of(d)
    # The founder is the lowest node id (the formation rule) and it still leads.
    assert leader.node_id == min(ids)
    r = leader.raft
    assert r is not None
    assert r.config.voters == tuple(sorted((Peer(m.node_id, m.inc) for m in ms), key=lambda p: p.node_id))
    events = [e.kind for fxs in d.effects.values() for fx in fxs for e in fx.events]
    assert events.count("cluster formed") == 1
    assert events.count("joining cluster") == 2
    assert "member promoted to voter" in events
    assert all(m.status().healthy for m in ms)


def test_driver_formation_of_five_nodes_and_a_late_joiner() -> None:
    d, ids = formed(5, seed=4)
    late = node_ids(6, seed=4)[5]
    d.boot(late, 6)
    for i, other in enumerate(ids):
        d.handle(late, PeerDiscovered(other, (f"10.0.0.{i + 1}",)))
        d.handle(other, PeerDiscovered(late, ("10.0.0.6",)))
    assert d.run_until(d.converged, 10_000)
    assert len({m.cluster for m in d.machines.values()}) == 1
    assert len(leader_of(d).raft.config.voters) == 6  # type: ignore[union-attr]


def test_proposal_on_a_follower_is_forwarded_and_applied_everywhere() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    ready = d.handle(f.node_id, ProposalRequested(Put("color", "blue")))
    fwd = [m for _, m in ready.messages if isinstance(m, ForwardProposal)]
    assert len(fwd) == 1 and fwd[0].command == Put("color", "blue")
    d.run(200)
    for m in d.machines.values():
        assert dict(m.raft.state.kv) == {"color": "blue"}  # type: ignore[union-attr]


def test_reads_on_a_formed_cluster_and_on_an_unformed_node() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    d.handle(f.node_id, ReadRequested(5))
    d.run(100)
    reads = [r for ready in d.readies[f.node_id] for r in ready.reads]
    assert reads == [(5, True)]
    m = booted(node_ids(1, 99)[0], 1)
    assert step(m, ReadRequested(6), 1).reads == [(6, False)]


def test_restart_from_disk_rejoins_as_the_same_incarnation() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    node, inc, cluster = f.node_id, f.inc, f.cluster
    d.crash(node)
    d.run(300)
    m = d.boot(node, ids.index(node) + 1)
    assert m.mode is Mode.MEMBER and m.inc == inc and m.cluster == cluster
    assert [e.kind for e in d.effects[node][-1].events] == ["restarted"]
    assert d.run_until(d.converged, 5_000)
    assert d.machines[node].inc == inc


def test_graceful_leave_of_a_follower_removes_it() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    node = f.node_id
    d.handle(node, LeaveRequested())
    assert d.run_until(lambda: node not in d.machines, d.settings.leave_timeout_ms + 1_000)
    assert any(ready.left for ready in d.readies[node])
    assert "left cluster" in [e.kind for fx in d.effects[node] for e in fx.events]
    d.run(300)
    leader = leader_of(d)
    assert node not in {p.node_id for p in leader.raft.config.voters}  # type: ignore[union-attr]
    assert node not in {m.node_id for m in leader.raft.state.members}  # type: ignore[union-attr]
    # The remaining two still work.
    d.handle(leader.node_id, ProposalRequested(Put("after", "leave")))
    d.run(100)
    assert all(dict(m.raft.state.kv) == {"after": "leave"} for m in d.machines.values())  # type: ignore[union-attr]


def test_graceful_leave_is_confirmed_without_waiting_for_the_timeout() -> None:
    # The leader stops replicating to a member as soon as its removal is appended, so the
    # leaving node learns of the commit from a RemovalNotice.
    d, ids = formed(3)
    f = a_follower(d)
    node, inc = f.node_id, f.inc
    d.handle(node, LeaveRequested())
    assert d.run_until(lambda: node not in d.machines, 1_000)
    kinds = [e.kind for fx in d.effects[node] for e in fx.events]
    assert "leave not confirmed" not in kinds
    assert "left cluster" in kinds
    leader = leader_of(d)
    notices = [m for ready in d.readies[leader.node_id] for dst, m in ready.messages if isinstance(m, RemovalNotice)]
    assert notices == [RemovalNotice(leader.node_id, leader.cluster, node, inc)]  # type: ignore[arg-type]
    d.run(1_000)
    removals = [e for e in leader.raft.log.entries if isinstance(e.command, RemoveMember)]  # type: ignore[union-attr]
    assert len(removals) == 1  # re-forwarded removals are refused as no-op config changes


def test_removal_notice_from_a_non_voter_is_rejected() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    stranger = node_ids(9, 77)[8]
    d.handle(f.node_id, PeerDiscovered(stranger, ()))
    before = snapshot_of(f)
    rejected = f.rejected_frames
    notice = RemovalNotice(stranger, f.cluster, f.node_id, f.inc)  # type: ignore[arg-type]
    d.handle(f.node_id, FrameReceived(stranger, wire.encode(notice)))
    assert f.rejected_frames == rejected + 1
    assert snapshot_of(f) == before and f.mode is Mode.MEMBER
    # Claiming to be the leader over another connection does not work either.
    leader = leader_of(d)
    forged = RemovalNotice(leader.node_id, f.cluster, f.node_id, f.inc)  # type: ignore[arg-type]
    d.handle(f.node_id, FrameReceived(stranger, wire.encode(forged)))
    assert f.rejected_frames == rejected + 2
    assert snapshot_of(f) == before and f.mode is Mode.MEMBER


# --------------------------------------------------------------------------------------
# Frame authentication


def test_frame_claiming_another_source_is_rejected() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    leader = leader_of(d)
    intruder = next(i for i in ids if i not in (f.node_id, leader.node_id))
    r = f.raft
    assert r is not None
    before = snapshot_of(f)
    rejected = f.rejected_frames
    # A perfectly formed AppendEntries "from the leader", at a higher term, but arriving
    # over the intruder's authenticated connection.
    fake = AppendEntries(
        Header(r.cluster, leader.node_id, leader.inc, f.node_id, f.inc, r.term + 5),
        r.log.last_index,
        r.log.last_term,
        (),
        r.commit,
        0,
    )
    ready = d.handle(f.node_id, FrameReceived(intruder, wire.encode(fake)))
    assert f.rejected_frames == rejected + 1
    assert snapshot_of(f) == before
    assert ready.messages == [] and ready.hard is None and ready.log_entries == ()
    # Formation messages are checked the same way.
    hello = Hello(leader.node_id, leader.inc, ClusterId("elsewhere"), 9, True, leader.node_id, (), CAPS)
    for msg in (
        hello,
        JoinRequest(leader.node_id, 1, r.cluster, (), CAPS),
        JoinReply(leader.node_id, r.cluster, True, intruder),
        VoteRequest(Header(r.cluster, leader.node_id, leader.inc, f.node_id, f.inc, r.term + 1), False, 99, 99, True),
    ):
        ready = d.handle(f.node_id, FrameReceived(intruder, wire.encode(msg)))
        assert ready.messages == []
    assert f.rejected_frames == rejected + 5
    assert snapshot_of(f) == before
    # The genuine leader, over its own connection, is accepted.
    genuine = AppendEntries(
        Header(r.cluster, leader.node_id, leader.inc, f.node_id, f.inc, r.term), r.log.last_index, r.log.last_term, (), r.commit, 0
    )
    d.handle(f.node_id, FrameReceived(leader.node_id, wire.encode(genuine)))
    assert f.rejected_frames == rejected + 5


def test_raft_frames_for_another_cluster_or_incarnation_are_rejected() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    leader = leader_of(d)
    r = f.raft
    assert r is not None
    before = snapshot_of(f)
    rejected = f.rejected_frames
    base = Header(r.cluster, leader.node_id, leader.inc, f.node_id, f.inc, r.term + 1)
    for hdr in (
        Header(ClusterId("other"), base.src, base.src_inc, base.dst, base.dst_inc, base.term),
        Header(base.cluster, base.src, base.src_inc, base.dst, f.inc + 1, base.term),  # an old incarnation
        Header(base.cluster, base.src, base.src_inc, leader.node_id, f.inc, base.term),  # not addressed to us
    ):
        msg = AppendEntries(hdr, r.log.last_index, r.log.last_term, (), r.commit, 0)
        ready = d.handle(f.node_id, FrameReceived(leader.node_id, wire.encode(msg)))
        assert ready.messages == []
    assert f.rejected_frames == rejected + 3
    assert snapshot_of(f) == before


def test_raft_frame_to_an_unformed_node_is_rejected() -> None:
    m = booted(node_ids(2)[0], 2)
    src = node_ids(2)[1]
    msg = AppendEntries(Header(ClusterId("c"), src, 1, m.node_id, m.inc, 1), 0, 0, (), 0, 0)
    ready = step(m, FrameReceived(src, wire.encode(msg)), 1)
    assert m.rejected_frames == 1
    assert ready.messages == [] and m.mode is Mode.UNFORMED and m.raft is None


# --------------------------------------------------------------------------------------
# Garbage


GARBAGE = [
    b"",
    b"\x00",
    b"\xc1",
    b"\xff" * 64,
    msgpack.packb([2, 50]),  # wrong version
    msgpack.packb([1, 200, 1, 2]),  # unknown tag
    msgpack.packb([1, 50, "x"]),  # wrong field count
    msgpack.packb({"a": 1}),
    msgpack.packb([1, 31, [30, "c", "s", 1, "d", 1, True], False, 1, 1, False]),  # bool as term
    wire.encode(Put("k", "v"))[:-1],  # truncated
]


@pytest.mark.parametrize("data", GARBAGE, ids=repr)
def test_garbage_frames_are_counted_and_dropped(data: bytes) -> None:
    d, ids = formed(3)
    f = a_follower(d)
    before = snapshot_of(f)
    rejected = f.rejected_frames
    ready = d.handle(f.node_id, FrameReceived(ids[0], data))
    assert f.rejected_frames == rejected + 1
    assert ready.messages == [] and ready.hard is None
    assert snapshot_of(f) == before
    # The node keeps working afterwards.
    d.handle(f.node_id, ProposalRequested(Put("still", "alive")))
    d.run(200)
    assert dict(f.raft.state.kv) == {"still": "alive"}  # type: ignore[union-attr]


def _decodes(data: bytes) -> bool:
    try:
        wire.decode(data)
    except RemoteProtocolError:
        return False
    return True


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_random_garbage_never_raises(data: bytes) -> None:
    assume(not _decodes(data))
    m = booted(node_ids(1)[0], 3)
    for i in range(3):
        ready = step(m, FrameReceived(node_ids(2)[1], data), i)
        assert ready.messages == []
    assert m.rejected_frames == 3
    assert m.mode is Mode.UNFORMED


@pytest.mark.parametrize(
    "value",
    [Noop(), Put("k", "v"), Peer(NodeId("p" * 32), 1), CAPS, Config((), ()), Header(ClusterId("c"), NodeId("s"), 1, NodeId("d"), 1, 1)],
    ids=lambda v: type(v).__name__,
)
def test_non_message_values_are_rejected_not_raised(value: object) -> None:
    m = booted(node_ids(1)[0], 4)
    ready = step(m, FrameReceived(NodeId("s"), wire.encode(value)), 1)
    assert m.rejected_frames == 1
    assert ready.messages == []


def test_unhashable_nested_tag_does_not_crash_the_machine() -> None:
    m = booted(node_ids(1)[0], 5)
    data = msgpack.packb([1, 50, "s", 1, None, 0, False, None, [], [[1], 5, "x"]])
    step(m, FrameReceived(NodeId("s"), data), 1)
    assert m.rejected_frames == 1


# --------------------------------------------------------------------------------------
# Status


def test_status_of_an_unformed_node() -> None:
    node = node_ids(1)[0]
    m, ready = Machine.boot(node_id=node, persisted=None, settings=Settings(), rng=random.Random(6), now_ms=0)
    assert ready.hard == NodeHardState(None, m.inc, 0, None)
    st_ = m.status()
    assert st_ == Status(
        node_id=node,
        inc=m.inc,
        mode=Mode.UNFORMED,
        cluster=None,
        role="unformed",
        term=0,
        leader=None,
        commit_index=0,
        applied_index=0,
        healthy=False,
    )
    assert 1 <= m.inc <= 2**63 - 1


def test_status_of_a_lone_node_that_formed_a_cluster() -> None:
    d = Driver()
    (node,) = node_ids(1, 7)
    d.boot(node, 1)
    d.run(1_000)
    m = d.machines[node]
    s = m.status()
    assert s.mode is Mode.MEMBER
    assert s.role == "standalone"
    assert s.cluster is not None and s.cluster == m.cluster
    assert s.leader == node
    assert s.term >= 2
    assert s.commit_index == s.applied_index == 4  # AddLearner, Promote, the leader's Noop, SetRing
    assert m.raft is not None and m.raft.state.ring == (node,) and m.raft.state.ring_epoch == 1
    assert s.healthy is True


def test_status_in_a_three_node_cluster() -> None:
    d, ids = formed(3)
    leader = leader_of(d)
    statuses = {i: d.machines[i].status() for i in ids}
    assert sorted(s.role for s in statuses.values()) == ["follower", "follower", "leader"]
    for i, s in statuses.items():
        m = d.machines[i]
        assert s.node_id == i and s.inc == m.inc and s.mode is Mode.MEMBER
        assert s.cluster == leader.cluster
        assert s.leader == leader.node_id
        assert s.term == leader.raft.term  # type: ignore[union-attr]
        assert s.commit_index == s.applied_index == leader.raft.commit  # type: ignore[union-attr]
        assert s.healthy


def test_status_of_a_joining_node_and_of_a_learner() -> None:
    # A node that is joining a cluster but not yet in its configuration reports "joining";
    # once added it reports "learner" until promoted.
    d, ids = formed(3)
    late = node_ids(4, 0)[3]
    roles = d.watch[late] = []
    m = d.boot(late, 4)
    leader = leader_of(d)
    d.handle(late, PeerDiscovered(leader.node_id, ("10.0.0.1",)))
    d.handle(leader.node_id, PeerDiscovered(late, ("10.0.0.4",)))
    assert d.run_until(d.converged, 5_000)
    assert roles == ["unformed", "joining", "learner", "follower"]
    assert m.status().mode is Mode.MEMBER


def test_status_healthy_goes_false_when_the_leader_is_long_silent() -> None:
    cluster = ClusterId("c")
    me, boss = node_ids(2, 8)
    mine, theirs = Peer(me, 5), Peer(boss, 7)
    state_members = (
        Member(me, 5, False, True, (), CAPS),
        Member(boss, 7, True, True, (), CAPS),
    )
    state = ClusterState(cluster, tuple(sorted(state_members, key=lambda x: x.node_id)), 0, (), ())
    snap = Snapshot(10, 3, Config((theirs,), (mine,)), state)
    persisted = PersistedState(NodeHardState(cluster, 5, 3, None), snap, ())
    m = booted(me, 9, persisted=persisted)
    beat = AppendEntries(Header(cluster, boss, 7, me, 5, 3), 10, 3, (), 10, 0)
    step(m, FrameReceived(boss, wire.encode(beat)), 100)
    assert m.status().role == "learner" and m.status().healthy
    step(m, PeerDiscovered(NodeId("f" * 32), ()), 20_000)
    ready = step(m, TimerFired(), 20_000)
    hellos = [x for _, x in ready.messages if isinstance(x, Hello)]
    assert hellos and not hellos[0].healthy  # the machine knows it is unhealthy ...
    assert m.status().healthy is False  # ... but status() says otherwise


def test_peer_discovery_of_self_is_ignored_and_hello_is_sent_to_others() -> None:
    node, other = node_ids(2, 10)
    m = booted(node, 10, caps=CAPS)
    assert step(m, PeerDiscovered(node, ("x",)), 1).messages == []
    ready = step(m, PeerDiscovered(other, ("10.0.0.2",)), 1)
    ((dst, hello),) = ready.messages
    assert dst == other
    assert hello == Hello(node, m.inc, None, 0, False, None, (), CAPS)


def test_join_request_to_an_unformed_node_is_refused() -> None:
    node, other = node_ids(2, 11)
    m = booted(node, 11)
    ready = step(m, FrameReceived(other, wire.encode(JoinRequest(other, 3, ClusterId("c"), (), CAPS))), 1)
    ((dst, reply),) = ready.messages
    assert dst == other
    assert isinstance(reply, JoinReply) and not reply.accepted and reply.leader is None


def test_boot_is_deterministic() -> None:
    def run() -> list[tuple[str, ...]]:
        d, ids = formed(3, seed=12)
        return [tuple(e.kind for fx in d.effects[i] for e in fx.events) for i in ids]

    assert run() == run()


def test_messages_are_typed_values() -> None:
    # Every message the machine emits is a registered wire type (encodable as is).
    d, ids = formed(3)
    for rs in d.readies.values():
        for ready in rs:
            for _, msg in ready.messages:
                m: Message = msg
                assert type(m) in wire._tag_of



# --------------------------------------------------------------------------------------
# Failure detection across elections


def test_a_new_leader_keeps_a_dead_member_down_until_it_is_heard() -> None:
    """A member a predecessor marked down stays down under a new leader until the new leader
    hears from it. The new leader counts silence from its own election at the latest, which
    must only delay marking members *down*: counted for marking *up*, every election marked
    a dead Mac up, the placement took it back, and a second later down again (two epochs per
    election, breaking the epoch that served the resumed requests; tests/agent/test_batch_faults.py)."""
    d, ids = formed(5)
    leader = leader_of(d)
    victim = next(n for n in ids if n != leader.node_id)
    d.cut.add(victim)  # the Mac dies
    assert d.run_until(lambda: not _member(leader_of(d), victim).up, 3_000), "the dead Mac was never marked down"

    old = leader_of(d).node_id
    d.cut.add(old)  # the leader is lost too: the three others elect one of them
    assert d.run_until(lambda: _leader_among(d, old) is not None, 3_000), "no new leader"
    new = _leader_among(d, old)
    assert new is not None
    ups = []
    for _ in range(300):  # 3 s of the new leader's reign: three failure-detection periods
        d.run(10)
        if _member(d.machines[new], victim).up:
            ups.append(d.now)
    assert not ups, f"the new leader marked the dead Mac up at {ups[:3]} ms"

    d.cut.discard(victim)  # it comes back: heard again, it is up
    assert d.run_until(lambda: _member(d.machines[new], victim).up, 3_000), "the Mac that came back stayed down"


def _member(m: Machine, node: NodeId) -> Member:
    assert m.raft is not None
    return next(x for x in m.raft.state.members if x.node_id == node)


def _leader_among(d: Driver, not_this: NodeId) -> NodeId | None:
    for node, m in d.machines.items():
        if node != not_this and node not in d.cut and m.raft is not None and m.raft.role is Role.LEADER:
            return node
    return None
