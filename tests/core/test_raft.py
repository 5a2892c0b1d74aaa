"""Raft pair and cluster tests, in the spirit of etcd-io/raft's raft_test.go.

Several ``Raft`` objects are driven directly by a tiny in-test network: every output is
"persisted" into an in-memory disk image first (checking the persist-before-send
contract on the way), then its messages are queued, encoded and decoded by the real wire
codec, and delivered one at a time with an explicit ``now_ms``.
"""
from __future__ import annotations

import dataclasses

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest

from p2pmesh.core import wire
from p2pmesh.core.cluster import apply_command, empty_state
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
    ForwardProposal,
    Header,
    InstallSnapshot,
    Member,
    Message,
    Noop,
    Peer,
    Promote,
    Put,
    ReadIndexRequest,
    ReadIndexResponse,
    RemoveMember,
    Snapshot,
    TimeoutNow,
    VoteRequest,
    VoteResponse,
)
from p2pmesh.core.raft import HardState, Raft, RaftOutput, Role
from p2pmesh.core.settings import Settings

CL = ClusterId("c0ffee")
CAPS = Capabilities(2**34, "M4 Max")
S = Settings()


def nid(i: int) -> NodeId:
    return NodeId(f"{i:032x}")


def peer(i: int) -> Peer:
    return Peer(nid(i), 1000 + i)


def founder_log(voters: Iterable[Peer], learners: Iterable[Peer] = ()) -> list[Entry]:
    """Term-1 entries that add (and promote) every peer, as a founder's log would."""
    entries: list[Entry] = []
    for p in voters:
        entries.append(Entry(len(entries) + 1, 1, AddLearner(p.node_id, p.inc, (), CAPS)))
        entries.append(Entry(len(entries) + 1, 1, Promote(p.node_id, p.inc)))
    for p in learners:
        entries.append(Entry(len(entries) + 1, 1, AddLearner(p.node_id, p.inc, (), CAPS)))
    return entries


def state_with(voters: Iterable[Peer], learners: Iterable[Peer] = ()) -> ClusterState:
    members = [Member(p.node_id, p.inc, True, True, (), CAPS) for p in voters]
    members += [Member(p.node_id, p.inc, False, True, (), CAPS) for p in learners]
    return ClusterState(CL, tuple(sorted(members, key=lambda m: m.node_id)), 0, (), ())


@dataclass
class Disk:
    """What a driver would have durably written for one node."""

    hard: HardState
    snapshot: Snapshot
    entries: list[Entry]

    def holds(self, index: int, term: int) -> bool:
        if index <= self.snapshot.index:
            return True  # covered by the snapshot (committed, so it matches)
        for e in self.entries:
            if e.index == index:
                return e.term == term
        return False

    def term_at(self, index: int) -> int | None:
        if index == self.snapshot.index:
            return self.snapshot.term
        for e in self.entries:
            if e.index == index:
                return e.term
        return None


Drop = Callable[[NodeId, NodeId, Message], bool]


@dataclass
class Net:
    settings: Settings = S
    now: int = 0
    nodes: dict[NodeId, Raft] = field(default_factory=dict)
    disks: dict[NodeId, Disk] = field(default_factory=dict)
    queue: list[tuple[NodeId, NodeId, Message]] = field(default_factory=list)
    sent: list[tuple[NodeId, NodeId, Message]] = field(default_factory=list)
    outputs: dict[NodeId, list[RaftOutput]] = field(default_factory=dict)
    applied: dict[NodeId, list[Entry]] = field(default_factory=dict)
    reads: dict[NodeId, list[tuple[int, bool]]] = field(default_factory=dict)
    blocked: set[tuple[NodeId, NodeId]] = field(default_factory=set)
    drop: Drop | None = None
    seed: int = 0

    # --- membership of the test network -----------------------------------------
    def add(self, me: Peer, hard: HardState, log: RaftLog) -> Raft:
        rng = random.Random(f"{self.seed}-{me.node_id}-{me.inc}-{self.now}")
        r = Raft(me=me, cluster=CL, hard=hard, log=log, settings=self.settings, rng=rng, now_ms=self.now)
        self.nodes[me.node_id] = r
        self.disks[me.node_id] = Disk(hard, log.snapshot, list(log.entries))
        self.outputs.setdefault(me.node_id, [])
        self.applied.setdefault(me.node_id, [])
        self.reads.setdefault(me.node_id, [])
        self.flush(me.node_id)
        return r

    def crash(self, node: NodeId) -> None:
        self.nodes.pop(node)

    def restart(self, me: Peer) -> Raft:
        disk = self.disks[me.node_id]
        log = RaftLog(disk.snapshot, list(disk.entries))
        return self.add(me, disk.hard, log)

    def __getitem__(self, i: int) -> Raft:
        return self.nodes[nid(i)]

    # --- outputs ------------------------------------------------------------------
    def flush(self, node: NodeId) -> RaftOutput:
        r = self.nodes[node]
        out = r.take_output()
        self.outputs[node].append(out)
        disk = self.disks[node]
        # Persist first ...
        if out.hard_state is not None:
            disk.hard = out.hard_state
        if out.snapshot is not None:
            disk.snapshot = out.snapshot
            disk.entries = [e for e in disk.entries if e.index > out.snapshot.index]
        if out.log_dirty_from is not None:
            cut = out.log_dirty_from
            disk.entries = [e for e in disk.entries if e.index < cut]
            disk.entries += [e for e in r.log.entries if e.index >= cut]
        assert [e.index for e in disk.entries] == list(range(disk.snapshot.index + 1, disk.snapshot.index + 1 + len(disk.entries)))
        assert disk.entries == r.log.entries, "the persisted log diverged from the in-memory log"
        assert (disk.hard.term, disk.hard.vote) == (r.term, r.vote)
        # ... then check that what each message asserts is durable, then send.
        for dst, msg in out.messages:
            self._check_durable(node, disk, msg)
            self.queue.append((node, dst, msg))
            self.sent.append((node, dst, msg))
        self.applied[node] += out.applied
        self.reads[node] += out.reads
        return out

    def _check_durable(self, node: NodeId, disk: Disk, msg: Message) -> None:
        hdr: Header = msg.hdr  # type: ignore[union-attr]
        assert hdr.src == node and hdr.cluster == CL
        if isinstance(msg, (VoteRequest, VoteResponse)) and msg.prevote:
            return  # a pre-vote names a term nobody adopts
        assert disk.hard.term >= hdr.term, f"sent term {hdr.term} before persisting it"
        if isinstance(msg, VoteResponse) and msg.granted:
            assert disk.hard == HardState(hdr.term, Peer(hdr.dst, hdr.dst_inc)), "vote granted before it was persisted"
        if isinstance(msg, VoteRequest):
            assert disk.hard.vote == Peer(hdr.src, hdr.src_inc)
        if isinstance(msg, AppendResponse) and msg.success:
            held = disk.term_at(msg.index)
            assert msg.index <= disk.snapshot.index or held is not None, f"acked {msg.index} before persisting it"
        if isinstance(msg, AppendEntries):
            for e in msg.entries:
                assert disk.holds(e.index, e.term), f"sent entry {e.index} before persisting it"

    def flush_all(self) -> None:
        for node in list(self.nodes):
            self.flush(node)

    # --- delivery -------------------------------------------------------------------
    def deliver_one(self) -> tuple[NodeId, NodeId, Message] | None:
        src, dst, msg = self.queue.pop(0)
        if (src, dst) in self.blocked or dst not in self.nodes:
            return None
        if self.drop is not None and self.drop(src, dst, msg):
            return None
        r = self.nodes[dst]
        back = wire.decode(wire.encode(msg))
        assert back == msg
        hdr: Header = back.hdr
        if hdr.dst_inc != r.me.inc:
            return None  # the driver checks the incarnation
        r.step(back, self.now)
        self.flush(dst)
        return src, dst, msg

    def deliver_all(self, limit: int = 20_000) -> int:
        n = 0
        while self.queue:
            n += 1
            assert n < limit, "message storm"
            self.deliver_one()
        return n

    def deliver_until(self, cond: Callable[[], bool]) -> None:
        while self.queue and not cond():
            self.deliver_one()
        assert cond()

    def tick(self, nodes: Iterable[NodeId] | None = None) -> None:
        for node in list(nodes if nodes is not None else self.nodes):
            if node in self.nodes:
                self.nodes[node].tick(self.now)
                self.flush(node)

    def advance(self, ms: int, *, step: int = 10, only: Iterable[int] | None = None) -> None:
        """Move time forward in small steps, ticking (some) nodes and delivering everything."""
        who = [nid(i) for i in only] if only is not None else None
        end = self.now + ms
        while self.now < end:
            self.now = min(end, self.now + step)
            self.tick(who)
            self.deliver_all()

    # --- faults ---------------------------------------------------------------------
    def isolate(self, i: int) -> None:
        for other in self.nodes:
            if other != nid(i):
                self.blocked.add((nid(i), other))
                self.blocked.add((other, nid(i)))

    def heal(self) -> None:
        self.blocked.clear()
        self.drop = None

    # --- queries --------------------------------------------------------------------
    def leaders(self) -> list[Raft]:
        return [r for r in self.nodes.values() if r.role is Role.LEADER]

    def propose(self, i: int, command: Command) -> int:
        index = self[i].propose(command, self.now)
        assert index is not None
        self.flush(nid(i))
        return index

    def sent_of(self, kind: type, *, src: int | None = None, dst: int | None = None) -> list[Message]:
        return [
            m
            for s, d, m in self.sent
            if isinstance(m, kind) and (src is None or s == nid(src)) and (dst is None or d == nid(dst))
        ]


def make_net(
    voters: int,
    learners: int = 0,
    *,
    settings: Settings = S,
    via_entries: bool = True,
    seed: int = 0,
) -> Net:
    """Nodes 1..voters are voters, the next ``learners`` are learners.

    via_entries: the configuration comes from term-1 founder entries (uncommitted until a
    leader commits an entry of its own term); otherwise from the base snapshot.
    """
    vs = [peer(i) for i in range(1, voters + 1)]
    ls = [peer(i) for i in range(voters + 1, voters + learners + 1)]
    net = Net(settings=settings, seed=seed)
    for p in (*vs, *ls):
        if via_entries:
            log = RaftLog(Snapshot(0, 0, Config((), ()), empty_state(CL)), founder_log(vs, ls))
            hard = HardState(1, None)
        else:
            log = RaftLog(Snapshot(0, 0, Config(tuple(vs), tuple(ls)), state_with(vs, ls)))
            hard = HardState(0, None)
        net.add(p, hard, log)
    return net


def elect(net: Net, i: int) -> Raft:
    """Let node i's election timer fire first and deliver until the dust settles."""
    net.now += net.settings.election_max_ms
    net.tick([nid(i)])
    net.deliver_all()
    r = net[i]
    assert r.role is Role.LEADER, r.role
    # One heartbeat round so followers learn the commit index.
    net.advance(net.settings.heartbeat_ms + 10)
    assert r.role is Role.LEADER
    return r


def hdr(src: Peer, dst: Peer, term: int) -> Header:
    return Header(CL, src.node_id, src.inc, dst.node_id, dst.inc, term)


def messages_of(out: RaftOutput, kind: type) -> list[Message]:
    return [m for _, m in out.messages if isinstance(m, kind)]


def committed_prefix(r: Raft) -> list[tuple[int, int, Command]]:
    return [(e.index, e.term, e.command) for e in r.log.entries if e.index <= r.commit]


# --------------------------------------------------------------------------------------
# Elections


def test_single_node_bootstrap_elects_itself() -> None:
    me = peer(1)
    base = Snapshot(0, 0, Config((), ()), empty_state(CL))
    log = RaftLog(base, founder_log([me]))
    r = Raft(me=me, cluster=CL, hard=HardState(1, me), log=log, settings=S, rng=random.Random(1), now_ms=0)
    r.commit = 2
    r._apply_committed()
    out = r.take_output()
    assert [e.index for e in out.applied] == [1, 2]
    assert r.config == Config((me,), ())
    r.tick(S.election_min_ms - 1)
    assert r.role is Role.FOLLOWER
    assert r.take_output().messages == []
    r.tick(S.election_max_ms)
    out = r.take_output()
    assert r.role is Role.LEADER
    assert r.leader == me
    assert r.term == 2
    assert out.hard_state == HardState(2, me)
    assert out.messages == []
    assert out.role_changed
    # Its own Noop commits at once: it is the whole quorum.
    assert r.commit == 3
    assert [(e.index, e.term, e.command) for e in out.applied] == [(3, 2, Noop())]
    assert out.log_dirty_from == 3
    assert r.propose(Put("k", "v"), S.election_max_ms) == 4
    assert r.commit == 4 and dict(r.state.kv) == {"k": "v"}
    r.read(11, S.election_max_ms)
    assert r.take_output().reads == [(11, True)]


def test_campaign_before_timeout_does_not_happen() -> None:
    net = make_net(3)
    net.now = S.election_min_ms - 1
    net.tick()
    assert all(r.role is Role.FOLLOWER for r in net.nodes.values())
    assert net.queue == []


def test_three_node_election_prevote_then_vote() -> None:
    net = make_net(3)
    a, b, c = net[1], net[2], net[3]
    net.now = S.election_max_ms
    net.tick([nid(1)])
    assert a.role is Role.PRECANDIDATE
    assert a.term == 1  # a pre-vote does not bump the term ...
    assert net.outputs[nid(1)][-1].hard_state is None  # ... so nothing to persist
    reqs = [m for _, _, m in net.queue]
    assert len(reqs) == 2
    assert all(isinstance(m, VoteRequest) and m.prevote and not m.transfer for m in reqs)
    assert all(m.hdr.term == 2 and m.last_index == 6 and m.last_term == 1 for m in reqs)  # type: ignore[union-attr]

    net.deliver_one()  # pre-vote request to B
    assert b.term == 1 and b.vote is None  # granting a pre-vote changes nothing durable
    resp = net.queue[-1][2]
    assert isinstance(resp, VoteResponse) and resp.prevote and resp.granted and resp.hdr.term == 2

    net.deliver_one()  # pre-vote request to C
    net.deliver_one()  # B's grant: A has a quorum of pre-votes and campaigns for real
    assert a.role is Role.CANDIDATE
    assert a.term == 2 and a.vote == a.me
    assert net.outputs[nid(1)][-1].hard_state == HardState(2, a.me)
    real = [m for s, _, m in net.queue if s == nid(1)]
    assert real and all(isinstance(m, VoteRequest) and not m.prevote and m.hdr.term == 2 for m in real)

    net.deliver_all()
    assert a.role is Role.LEADER and a.term == 2
    assert b.role is Role.FOLLOWER and c.role is Role.FOLLOWER
    assert b.vote == a.me or c.vote == a.me
    assert b.leader == a.me and c.leader == a.me
    # The leader's first entry is a Noop of its own term; with it the founder entries commit.
    assert a.log.entry(7) == Entry(7, 2, Noop())
    assert a.commit == 7
    assert a.config == Config((peer(1), peer(2), peer(3)), ())
    assert len(a.state.members) == 3 and all(m.voter for m in a.state.members)


def test_election_with_config_from_snapshot() -> None:
    net = make_net(5, via_entries=False)
    leader = elect(net, 4)
    assert leader.term == 1
    assert leader.commit == 1
    assert [len(net.applied[nid(i)]) for i in range(1, 6)] == [1] * 5
    assert len(net.leaders()) == 1


def test_node_with_a_stale_log_cannot_win_and_disrupts_nobody() -> None:
    vs = [peer(1), peer(2), peer(3)]
    net = Net()
    longer = founder_log(vs) + [Entry(7, 1, Put("k", "v"))]
    net.add(peer(1), HardState(1, None), RaftLog(Snapshot(0, 0, Config((), ()), empty_state(CL)), longer))
    net.add(peer(2), HardState(1, None), RaftLog(Snapshot(0, 0, Config((), ()), empty_state(CL)), longer))
    net.add(peer(3), HardState(1, None), RaftLog(Snapshot(0, 0, Config((), ()), empty_state(CL)), founder_log(vs)))
    net.now = S.election_max_ms
    net.tick([nid(3)])
    net.deliver_all()
    assert net[3].role is Role.FOLLOWER  # two pre-vote rejections: gives up
    assert [net[i].term for i in (1, 2, 3)] == [1, 1, 1]  # and no term was inflated
    rejections = net.sent_of(VoteResponse, dst=3)
    assert len(rejections) == 2 and not any(m.granted for m in rejections)  # type: ignore[union-attr]
    leader = elect(net, 1)
    assert leader.term == 2
    assert net[3].log.entry(7).command == Put("k", "v")


def test_one_vote_per_term() -> None:
    net = make_net(3)
    a = net[1]
    net.now = 1_000  # nobody in lease
    a.step(VoteRequest(hdr(peer(2), peer(1), 2), False, 6, 1, False), net.now)
    out = net.flush(nid(1))
    assert out.hard_state == HardState(2, peer(2))
    assert [m.granted for m in messages_of(out, VoteResponse)] == [True]  # type: ignore[attr-defined]
    a.step(VoteRequest(hdr(peer(3), peer(1), 2), False, 6, 1, False), net.now)
    out = net.flush(nid(1))
    assert out.hard_state is None
    assert [m.granted for m in messages_of(out, VoteResponse)] == [False]  # type: ignore[attr-defined]
    # A retransmitted request from the same candidate is granted again (idempotent).
    a.step(VoteRequest(hdr(peer(2), peer(1), 2), False, 6, 1, False), net.now)
    out = net.flush(nid(1))
    assert [m.granted for m in messages_of(out, VoteResponse)] == [True]  # type: ignore[attr-defined]
    # A stale-term request is refused with our term.
    a.step(VoteRequest(hdr(peer(3), peer(1), 1), False, 60, 9, False), net.now)
    out = net.flush(nid(1))
    (resp,) = messages_of(out, VoteResponse)
    assert not resp.granted and resp.hdr.term == 2  # type: ignore[union-attr]


def test_vote_survives_a_restart() -> None:
    net = make_net(3)
    net.now = 1_000
    net[1].step(VoteRequest(hdr(peer(2), peer(1), 2), False, 6, 1, False), net.now)
    net.flush(nid(1))
    net.crash(nid(1))
    a = net.restart(peer(1))
    assert (a.term, a.vote) == (2, peer(2))
    a.step(VoteRequest(hdr(peer(3), peer(1), 2), False, 6, 1, False), net.now)
    out = net.flush(nid(1))
    assert [m.granted for m in messages_of(out, VoteResponse)] == [False]  # type: ignore[attr-defined]


def test_vote_refused_to_a_less_up_to_date_log() -> None:
    net = make_net(3)
    net.now = 1_000
    a = net[1]
    a.step(VoteRequest(hdr(peer(2), peer(1), 5), False, 5, 1, False), net.now)  # shorter log
    out = net.flush(nid(1))
    assert a.term == 5  # the term is adopted ...
    assert a.vote is None  # ... but the vote is not given
    assert out.hard_state == HardState(5, None)
    assert [m.granted for m in messages_of(out, VoteResponse)] == [False]  # type: ignore[attr-defined]


def test_split_vote_resolves() -> None:
    net = make_net(3)
    net.now = 400
    # A and B both campaign for real at term 2 at once.
    net[1].campaign(net.now, prevote=False, transfer=False)
    net[2].campaign(net.now, prevote=False, transfer=False)
    net.flush_all()
    net.deliver_all()
    leaders = net.leaders()
    assert len(leaders) <= 1
    net.advance(3_000)
    leaders = net.leaders()
    assert len(leaders) == 1
    term = leaders[0].term
    assert all(r.term == term and r.leader == leaders[0].me for r in net.nodes.values())


@pytest.mark.parametrize("seed", range(8))
def test_random_elections_keep_one_leader_per_term(seed: int) -> None:
    """Elections under message loss: election safety and the persistence contract hold."""
    rng = random.Random(seed)
    net = make_net(5, seed=seed)
    net.drop = lambda s, d, m: rng.random() < 0.3
    leaders_by_term: dict[int, NodeId] = {}
    for _ in range(300):
        net.now += rng.randint(1, 40)
        net.tick()
        while net.queue:
            net.deliver_one()
            for r in net.leaders():
                assert leaders_by_term.setdefault(r.term, r.me.node_id) == r.me.node_id
        for r in net.leaders():
            assert leaders_by_term.setdefault(r.term, r.me.node_id) == r.me.node_id
    net.heal()
    net.advance(2_000)
    assert len(net.leaders()) == 1
    assert leaders_by_term


# --------------------------------------------------------------------------------------
# CheckQuorum and leases


def test_follower_in_lease_ignores_vote_requests() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    term = b.term
    assert b.leader == peer(1)
    contact = b.leader_contact_ms
    assert contact is not None
    now = contact + S.election_min_ms - 1
    for prevote in (True, False):
        b.step(VoteRequest(hdr(peer(3), peer(2), term + 1), prevote, 100, term, False), now)
        out = net.flush(nid(2))
        assert out.messages == []
        assert b.term == term and b.leader == peer(1) and b.role is Role.FOLLOWER
        assert out.hard_state is None


def test_follower_in_lease_answers_a_transfer_vote() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    term = b.term
    now = b.leader_contact_ms + 1  # type: ignore[operator]
    b.step(VoteRequest(hdr(peer(3), peer(2), term + 1), False, 100, term, True), now)
    out = net.flush(nid(2))
    (resp,) = messages_of(out, VoteResponse)
    assert resp.granted and not resp.prevote  # type: ignore[union-attr]
    assert b.term == term + 1 and b.vote == peer(3)
    assert out.hard_state == HardState(term + 1, peer(3))
    assert b.leader is None


def test_follower_out_of_lease_answers_vote_requests() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    term = b.term
    now = b.leader_contact_ms + S.election_min_ms  # type: ignore[operator]
    b.step(VoteRequest(hdr(peer(3), peer(2), term + 1), True, 100, term, False), now)
    out = net.flush(nid(2))
    (resp,) = messages_of(out, VoteResponse)
    assert resp.granted and resp.prevote and resp.hdr.term == term + 1  # type: ignore[union-attr]
    assert b.term == term  # a pre-vote leaves the term alone


def test_leader_ignores_disruptive_vote_requests() -> None:
    net = make_net(3)
    a = elect(net, 1)
    term = a.term
    a.step(VoteRequest(hdr(peer(3), peer(1), term + 5), False, 100, term, False), net.now)
    out = net.flush(nid(1))
    assert out.messages == []
    assert a.role is Role.LEADER and a.term == term


def test_partitioned_node_does_not_inflate_its_term_and_rejoins_quietly() -> None:
    net = make_net(3)
    a = elect(net, 1)
    term = a.term
    net.isolate(3)
    net.advance(2_000)
    assert net[3].role in (Role.FOLLOWER, Role.PRECANDIDATE)
    assert net[3].term == term  # pre-votes never got a quorum, so no term bump
    assert a.role is Role.LEADER
    net.heal()
    net.advance(500)
    assert a.role is Role.LEADER and a.term == term
    assert net[3].leader == a.me


def test_leader_steps_down_without_a_quorum() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.advance(200)
    cut = net.now
    net.isolate(1)
    net.advance(S.election_min_ms - 10, only=[1])
    assert a.role is Role.LEADER  # not before election_min_ms of silence
    net.advance(2 * S.election_min_ms + 30 - (net.now - cut), only=[1])
    assert a.role is Role.FOLLOWER
    assert a.leader is None
    assert any(o.role_changed for o in net.outputs[nid(1)][-20:])


def test_leader_keeps_leading_with_one_follower_of_two() -> None:
    net = make_net(3)
    a = elect(net, 1)
    term = a.term
    net.isolate(3)
    net.advance(3_000, only=[1, 2])
    assert a.role is Role.LEADER and a.term == term


# --------------------------------------------------------------------------------------
# Replication and commit


def test_log_replication() -> None:
    net = make_net(3)
    a = elect(net, 1)
    indices = [net.propose(1, Put(f"k{i}", f"v{i}")) for i in range(5)]
    assert indices == list(range(8, 13))
    net.deliver_all()
    assert a.commit == 12
    net.advance(S.heartbeat_ms + 10)
    for i in (1, 2, 3):
        r = net[i]
        assert r.commit == 12 and r.applied == 12
        assert r.log.entries == a.log.entries
        assert dict(r.state.kv) == {f"k{j}": f"v{j}" for j in range(5)}
        assert [e.index for e in net.applied[nid(i)]] == list(range(1, 13))


def test_followers_refuse_proposals_and_forward_reaches_the_leader() -> None:
    net = make_net(3)
    a = elect(net, 1)
    assert net[2].propose(Put("x", "y"), net.now) is None
    net[2].out.messages.append((a.me.node_id, ForwardProposal(hdr(peer(2), peer(1), a.term), Put("x", "y"))))
    net.flush(nid(2))
    net.deliver_all()
    net.advance(60)
    assert dict(net[3].state.kv) == {"x": "y"}


def test_a_leader_holds_at_most_proposals_pending_max_uncommitted_entries() -> None:
    """A leader cut off from its followers (or flooded with forwarded proposals) refuses
    proposals once proposals_pending_max entries wait to commit; the log stays bounded,
    and proposals are taken again once entries commit."""
    net = make_net(3, settings=dataclasses.replace(S, proposals_pending_max=8))
    a = elect(net, 1)
    net.isolate(2)
    net.isolate(3)
    accepted = [a.propose(Put(f"k{i}", "v"), net.now) for i in range(12)]
    assert sum(i is not None for i in accepted) == 8 and accepted[8:] == [None] * 4
    assert a.log.last_index - a.commit == 8
    net.heal()
    net.deliver_all()
    net.advance(S.heartbeat_ms + 10)
    assert a.commit == a.log.last_index and a.propose(Put("after", "v"), net.now) is not None


def test_commit_only_of_current_term_entries() -> None:
    """Raft §5.4.2 (figure 8): an old-term entry is not committed by counting replicas."""
    settings = Settings(entries_per_append_max=1)
    vs = [peer(1), peer(2), peer(3)]
    net = Net(settings=settings)
    base = Snapshot(0, 0, Config((), ()), empty_state(CL))
    old = Entry(7, 2, Put("old", "term 2"))
    net.add(peer(1), HardState(2, peer(1)), RaftLog(base, founder_log(vs) + [old]))
    net.add(peer(2), HardState(2, peer(1)), RaftLog(base, founder_log(vs)))
    net.add(peer(3), HardState(2, peer(1)), RaftLog(base, founder_log(vs)))
    a = net[1]
    net.now = settings.election_max_ms
    net.tick([nid(1)])
    net.deliver_until(lambda: a.role is Role.LEADER)
    assert a.term == 3 and a.log.entry(8) == Entry(8, 3, Noop())
    saw_old_only = False
    while net.queue:
        net.deliver_one()
        matches = [a.progress[p].match for p in (peer(2), peer(3))]
        if max(matches) == 7:
            saw_old_only = True
            # A quorum (the leader and one follower) holds index 7, but it is of term 2.
            assert a.commit == 0
        assert a.commit in (0, 8)
    assert saw_old_only
    assert a.commit == 8
    net.advance(60)
    for i in (1, 2, 3):
        assert dict(net[i].state.kv) == {"old": "term 2"}


def test_follower_log_conflicts_are_overwritten() -> None:
    vs = [peer(1), peer(2), peer(3)]
    net = Net()
    base = Snapshot(0, 0, Config((), ()), empty_state(CL))
    # B holds uncommitted junk from a term-2 leader that never replicated it anywhere else.
    junk = [Entry(7, 2, Put("junk", "1")), Entry(8, 2, Put("junk2", "x")), Entry(9, 2, Noop())]
    net.add(peer(1), HardState(3, None), RaftLog(base, founder_log(vs) + [Entry(7, 3, Put("good", "1"))]))
    net.add(peer(2), HardState(2, None), RaftLog(base, founder_log(vs) + junk))
    net.add(peer(3), HardState(3, None), RaftLog(base, founder_log(vs)))
    a = elect(net, 1)
    net.advance(100)
    b = net[2]
    assert b.log.entries == a.log.entries
    assert dict(b.state.kv) == {"good": "1"}
    assert all("junk" not in str(e.command) for e in net.applied[nid(2)])
    truncations = [o.log_dirty_from for o in net.outputs[nid(2)] if o.log_dirty_from is not None]
    assert 7 in truncations


def test_stale_term_append_is_rejected_and_stale_leader_steps_down() -> None:
    net = make_net(3)
    a = elect(net, 1)
    old_term = a.term
    net.isolate(1)
    # B and C lose their lease, elect a new leader among themselves (A is not ticked).
    net.advance(1_000, only=[2, 3])
    (new,) = [r for r in (net[2], net[3]) if r.role is Role.LEADER]
    assert new.term > old_term
    new_index = net.propose(int(new.me.node_id, 16), Put("new", "1"))
    net.deliver_all()
    assert a.role is Role.LEADER  # still believes it leads
    stale_index = net.propose(1, Put("stale", "1"))
    net.heal()
    follower = net[3] if new is net[2] else net[2]
    before = len(net.outputs[follower.me.node_id])
    net.deliver_one()  # A's AppendEntries of the old term reaches one of B, C
    replies = [m for o in net.outputs[follower.me.node_id][before:] for m in messages_of(o, AppendResponse)]
    replies += [m for o in net.outputs[new.me.node_id][-1:] for m in messages_of(o, AppendResponse)]
    assert replies and all(not m.success and m.hdr.term == new.term for m in replies)  # type: ignore[union-attr]
    assert follower.leader == new.me  # the stale leader does not become its leader
    net.deliver_all()
    assert a.role is Role.FOLLOWER and a.term == new.term
    net.advance(200)
    assert a.leader == new.me
    assert a.log.entries == new.log.entries
    assert a.log.entry(stale_index).command != Put("stale", "1")
    for node in net.nodes:
        assert Put("stale", "1") not in [e.command for e in net.applied[node]]
        assert Put("new", "1") in [e.command for e in net.applied[node]]
    assert new.log.entry(new_index).command == Put("new", "1")


def test_inflight_appends_are_bounded_but_heartbeats_still_flow() -> None:
    settings = Settings(inflight_appends_max=2)
    net = make_net(3, settings=settings)
    a = elect(net, 1)
    net.blocked.add((nid(1), nid(2)))
    net.blocked.add((nid(2), nid(1)))
    before = len(net.sent_of(AppendEntries, src=1, dst=2))
    for i in range(6):
        net.propose(1, Put(f"k{i}", "v"))
    assert len(net.sent_of(AppendEntries, src=1, dst=2)) - before == 2  # the window is full
    net.deliver_all()
    assert a.commit == a.log.last_index  # C's acks reopened its window
    assert len(net.sent_of(AppendEntries, src=1, dst=2)) - before == 2
    net.now += S.heartbeat_ms
    net.tick([nid(1)])
    assert len(net.sent_of(AppendEntries, src=1, dst=2)) - before == 3  # heartbeats ignore the window
    net.deliver_all()
    net.heal()
    net.advance(200)
    assert net[2].log.entries == a.log.entries
    assert net[2].commit == a.commit


def test_rejected_append_backs_off_and_repairs_the_follower() -> None:
    net = make_net(3)
    a = elect(net, 1)
    b = net[2]
    # Tell the leader B holds far more than it does: the optimistic probe is rejected.
    a.progress[peer(2)].next = a.log.last_index + 1
    net.crash(nid(2))
    for i in range(5):
        net.propose(1, Put(f"k{i}", "v"))
    net.deliver_all()
    net.nodes[nid(2)] = b
    net.now += S.heartbeat_ms
    net.tick([nid(1)])
    net.deliver_all()
    rejections = [m for m in net.sent_of(AppendResponse, src=2) if not m.success]  # type: ignore[union-attr]
    assert rejections
    assert rejections[-1].index == 7  # type: ignore[union-attr]  # hint: B's last index
    net.advance(100)
    assert b.log.entries == a.log.entries


def test_append_responses_of_an_older_term_are_ignored() -> None:
    net = make_net(3)
    a = elect(net, 1)
    match_before = a.progress[peer(2)].match
    a.step(AppendResponse(hdr(peer(2), peer(1), a.term - 1), True, 999, 0), net.now)
    out = net.flush(nid(1))
    assert out.messages == [] and a.progress[peer(2)].match == match_before
    assert a.role is Role.LEADER


def test_leader_never_overwrites_or_commits_beyond_its_log() -> None:
    net = make_net(3)
    a = elect(net, 1)
    for i in range(20):
        net.propose(1, Put(f"k{i}", str(i)))
        if i % 3 == 0:
            net.deliver_one()
    net.deliver_all()
    net.advance(100)
    assert a.commit == a.log.last_index
    for i in (2, 3):
        assert committed_prefix(net[i]) == committed_prefix(a)


# --------------------------------------------------------------------------------------
# Membership changes


def test_config_change_refused_before_own_term_commits_and_while_pending() -> None:
    net = make_net(3)
    a = net[1]
    net.now = S.election_max_ms
    net.tick([nid(1)])
    net.deliver_until(lambda: a.role is Role.LEADER)
    d = peer(9)
    # Own-term Noop not committed yet: config changes wait, ordinary commands do not.
    assert not a.config_change_allowed()
    assert a.propose(AddLearner(d.node_id, d.inc, (), CAPS), net.now) is None
    assert a.propose(RemoveMember(nid(3), peer(3).inc, "x"), net.now) is None
    put_index = a.propose(Put("k", "v"), net.now)
    assert put_index is not None
    net.flush(nid(1))
    net.deliver_all()
    assert a.commit >= a.term_start_index
    assert a.config_change_allowed()
    add_index = net.propose(1, AddLearner(d.node_id, d.inc, (), CAPS))
    assert a.config.learners == (d,)  # effective on append
    assert a.pending_conf_index == add_index
    assert not a.config_change_allowed()
    assert a.propose(Promote(d.node_id, d.inc), net.now) is None
    assert a.propose(RemoveMember(nid(2), peer(2).inc, "x"), net.now) is None
    # A forwarded config change is refused just the same.
    last = a.log.last_index
    a.step(ForwardProposal(hdr(peer(2), peer(1), a.term), Promote(d.node_id, d.inc)), net.now)
    net.flush(nid(1))
    assert a.log.last_index == last
    assert a.propose(Put("k2", "v"), net.now) is not None
    net.flush(nid(1))
    net.deliver_all()  # B and C commit the AddLearner (D does not exist: its messages drop)
    assert a.commit >= add_index
    assert a.config_change_allowed()
    promote_index = net.propose(1, Promote(d.node_id, d.inc))
    assert a.config.voters == (peer(1), peer(2), peer(3), d)
    assert a.quorum() == 3
    net.deliver_all()
    assert a.commit >= promote_index  # A, B, C are 3 of 4


def test_no_op_config_changes_are_refused() -> None:
    net = make_net(3, learners=1)
    a = elect(net, 1)
    assert a.config_change_allowed()
    last = a.log.last_index
    assert a.propose(AddLearner(nid(2), peer(2).inc, (), CAPS), net.now) is None  # already a voter
    assert a.propose(AddLearner(nid(4), peer(4).inc, (), CAPS), net.now) is None  # already a learner
    assert a.propose(Promote(nid(3), peer(3).inc), net.now) is None  # already a voter
    assert a.propose(Promote(nid(9), 1), net.now) is None  # unknown
    assert a.propose(RemoveMember(nid(9), 1, "x"), net.now) is None  # unknown
    assert a.propose(RemoveMember(nid(2), 999, "x"), net.now) is None  # another incarnation
    assert a.log.last_index == last
    assert a.propose(Promote(nid(4), peer(4).inc), net.now) is not None


def test_new_leader_waits_for_its_noop_before_config_changes() -> None:
    net = make_net(3)
    elect(net, 1)
    net.propose(1, Put("a", "1"))
    net.deliver_all()
    # Leadership moves; the new leader must not change the config before its Noop commits.
    net.isolate(1)
    new: Raft | None = None
    while new is None:
        net.now += 10
        net.tick([nid(2), nid(3)])
        while net.queue and new is None:
            net.deliver_one()
            new = next((r for r in (net[2], net[3]) if r.role is Role.LEADER), None)
    assert new.commit < new.term_start_index
    assert new.pending_conf_index == new.term_start_index - 1
    assert not new.config_change_allowed()
    assert new.propose(AddLearner(nid(9), 1, (), CAPS), net.now) is None
    assert new.propose(RemoveMember(nid(1), peer(1).inc, "x"), net.now) is None
    net.deliver_all()
    assert new.commit >= new.term_start_index
    assert new.config_change_allowed()
    assert new.propose(RemoveMember(nid(1), peer(1).inc, "x"), net.now) is not None


def test_removing_the_leader_makes_it_step_down() -> None:
    net = make_net(3)
    a = elect(net, 1)
    index = net.propose(1, RemoveMember(a.me.node_id, a.me.inc, "left"))
    assert a.config.voters == (peer(2), peer(3))
    assert not a.is_voter()
    net.deliver_all()
    assert a.commit >= index
    assert a.role is Role.FOLLOWER
    net.advance(1_000)
    (new,) = net.leaders()
    assert new.me in (peer(2), peer(3))
    assert a.me not in new.config.voters


def test_learners_do_not_count_for_commit() -> None:
    net = make_net(3, learners=1)
    a = elect(net, 1)
    learner = net[4]
    assert learner.config.learners == (peer(4),)
    assert a.progress[peer(4)].match == a.log.last_index  # it does replicate
    net.blocked |= {(nid(1), nid(2)), (nid(1), nid(3))}
    commit = a.commit
    index = net.propose(1, Put("k", "v"))
    net.deliver_all()
    assert a.progress[peer(4)].match == index
    assert learner.log.last_index == index
    assert a.commit == commit  # leader + learner is no quorum of three voters
    net.heal()
    net.advance(100)
    assert a.commit == index
    assert dict(learner.state.kv) == {"k": "v"}


def test_learners_never_campaign_and_are_not_asked_for_votes() -> None:
    net = make_net(3, learners=1)
    net.now = 10_000
    net.tick([nid(4)])
    assert net[4].role is Role.FOLLOWER
    assert net.queue == []
    net.tick([nid(1)])
    dsts = {d for _, d, m in net.queue if isinstance(m, VoteRequest)}
    assert dsts == {nid(2), nid(3)}
    # A learner that receives TimeoutNow does not campaign either.
    net.queue.clear()
    net[4].step(TimeoutNow(hdr(peer(1), peer(4), 1)), net.now)
    out = net.flush(nid(4))
    assert out.messages == [] and net[4].role is Role.FOLLOWER


def test_votes_from_learners_do_not_count() -> None:
    net = make_net(3, learners=2)
    a = net[1]
    net.now = 1_000
    a.campaign(net.now, prevote=False, transfer=False)
    net.flush(nid(1))
    net.queue.clear()
    for learner in (peer(4), peer(5)):
        a.step(VoteResponse(hdr(learner, peer(1), a.term), False, True), net.now)
        net.flush(nid(1))
    assert a.role is Role.CANDIDATE
    a.step(VoteResponse(hdr(peer(2), peer(1), a.term), False, True), net.now)
    net.flush(nid(1))
    assert a.role is Role.LEADER


# --------------------------------------------------------------------------------------
# Leadership transfer


def test_leader_transfer_via_timeout_now() -> None:
    net = make_net(3)
    a = elect(net, 1)
    term = a.term
    assert a.transfer_leadership(peer(2), net.now)
    out = net.flush(nid(1))
    (tn,) = messages_of(out, TimeoutNow)
    assert tn.hdr.dst == nid(2)  # type: ignore[union-attr]
    assert a.propose(Put("during", "transfer"), net.now) is None
    net.deliver_one()  # TimeoutNow reaches B: it campaigns at once, without a pre-vote
    b = net[2]
    assert b.role is Role.CANDIDATE and b.term == term + 1
    reqs = [m for s, _, m in net.queue if s == nid(2) and isinstance(m, VoteRequest)]
    assert len(reqs) == 2 and all(m.transfer and not m.prevote for m in reqs)  # type: ignore[union-attr]
    net.deliver_all()
    assert b.role is Role.LEADER and b.term == term + 1
    assert a.role is Role.FOLLOWER and a.leader == b.me
    net.advance(100)
    assert net[3].leader == b.me
    assert len(net.leaders()) == 1


def test_transfer_to_a_lagging_target_catches_it_up_first() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.blocked.add((nid(1), nid(2)))
    for i in range(3):
        net.propose(1, Put(f"k{i}", "v"))
    net.deliver_all()
    assert net[2].log.last_index < a.log.last_index
    net.heal()
    assert a.transfer_leadership(peer(2), net.now)
    out = net.flush(nid(1))
    assert messages_of(out, TimeoutNow) == []
    assert messages_of(out, AppendEntries)
    net.deliver_all()
    b = net[2]
    assert b.role is Role.LEADER
    assert b.term == a.term and a.leader == b.me
    net.advance(100)
    assert b.log.entries == a.log.entries
    assert dict(b.state.kv) == {"k0": "v", "k1": "v", "k2": "v"}


def test_transfer_to_an_unreachable_target_is_abandoned() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.isolate(2)
    assert a.transfer_leadership(peer(2), net.now)
    net.flush(nid(1))
    assert a.propose(Put("k", "v"), net.now) is None
    net.advance(S.election_max_ms + 20, only=[1, 3])
    assert a.transfer_to is None
    assert a.role is Role.LEADER
    assert a.propose(Put("k", "v"), net.now) is not None


def test_transfer_requests_that_make_no_sense_are_refused() -> None:
    net = make_net(3, learners=1)
    a = elect(net, 1)
    assert not a.transfer_leadership(a.me, net.now)
    assert not a.transfer_leadership(peer(4), net.now)  # a learner
    assert not a.transfer_leadership(peer(77), net.now)  # a stranger
    assert not net[2].transfer_leadership(peer(3), net.now)  # not the leader
    assert a.transfer_to is None


# --------------------------------------------------------------------------------------
# ReadIndex


def test_leader_read_needs_a_quorum_round() -> None:
    net = make_net(3)
    a = elect(net, 1)
    assert net.reads[nid(1)] == []
    a.read(7, net.now)
    out = net.flush(nid(1))
    assert out.reads == []
    beats = messages_of(out, AppendEntries)
    assert len(beats) == 2 and all(m.ctx == a.read_round for m in beats)  # type: ignore[union-attr]
    net.deliver_one()  # heartbeat to B
    assert net.reads[nid(1)] == []
    net.deliver_one()  # heartbeat to C
    assert net.reads[nid(1)] == []
    net.deliver_one()  # B's ack: leader + B is a quorum
    assert net.reads[nid(1)] == [(7, True)]
    net.deliver_all()
    assert net.reads[nid(1)] == [(7, True)]


def test_leader_read_ignores_acks_of_earlier_rounds() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.advance(S.heartbeat_ms)  # a heartbeat in flight carries the old round
    net.now += S.heartbeat_ms
    net.tick([nid(1)])
    assert net.queue
    net.deliver_one()
    net.deliver_one()  # both old-round heartbeats delivered, acks queued
    a.read(8, net.now)
    net.flush(nid(1))
    net.deliver_one()
    net.deliver_one()  # the two old-round acks
    assert net.reads[nid(1)] == []
    net.deliver_all()
    assert net.reads[nid(1)] == [(8, True)]


def test_isolated_leader_cannot_serve_reads() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.isolate(1)
    a.read(9, net.now)
    net.flush(nid(1))
    net.advance(2 * S.election_min_ms + 50, only=[1])
    assert a.role is Role.FOLLOWER
    assert net.reads[nid(1)] == [(9, False)]


def test_deposed_leader_never_serves_a_stale_read() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.isolate(1)
    net.advance(1_000, only=[2, 3])
    (new,) = [r for r in (net[2], net[3]) if r.role is Role.LEADER]
    net.propose(int(new.me.node_id, 16), Put("x", "new"))
    net.deliver_all()
    assert a.role is Role.LEADER
    a.read(10, net.now)
    net.flush(nid(1))
    net.deliver_all()
    assert net.reads[nid(1)] == []
    net.heal()
    net.now += S.heartbeat_ms
    net.tick([nid(1)])
    net.deliver_all()
    assert a.role is Role.FOLLOWER
    assert net.reads[nid(1)] == [(10, False)]


def test_leader_read_refused_before_its_term_commits() -> None:
    net = make_net(3)
    a = net[1]
    net.now = S.election_max_ms
    net.tick([nid(1)])
    net.deliver_until(lambda: a.role is Role.LEADER)
    assert a.commit < a.term_start_index
    a.read(3, net.now)
    out = net.flush(nid(1))
    assert out.reads == [(3, False)]


def test_follower_read_waits_for_the_quorum_round_and_for_apply() -> None:
    net = make_net(3)
    a = elect(net, 1)
    b = net[2]
    # B misses the latest write: only AppendEntries to B are dropped.
    net.drop = lambda s, d, m: d == nid(2) and isinstance(m, AppendEntries)
    index = net.propose(1, Put("k", "v"))
    net.deliver_all()
    assert a.commit == index and b.applied < index
    b.read(21, net.now)
    out = net.flush(nid(2))
    (req,) = messages_of(out, ReadIndexRequest)
    assert req.ctx == 21  # type: ignore[union-attr]
    net.deliver_one()  # the request reaches the leader, which starts a round first
    leader_out = net.outputs[nid(1)][-1]
    assert messages_of(leader_out, ReadIndexResponse) == []
    net.deliver_all()
    (resp,) = net.sent_of(ReadIndexResponse, dst=2)
    assert resp.ok and resp.index == index  # type: ignore[union-attr]
    assert net.reads[nid(2)] == []  # granted, but B has not applied the index yet
    net.heal()
    net.advance(S.heartbeat_ms + 10)
    assert b.applied >= index
    assert net.reads[nid(2)] == [(21, True)]
    assert dict(b.state.kv) == {"k": "v"}


def test_follower_read_without_a_leader_fails_at_once() -> None:
    net = make_net(3)
    net[2].read(5, net.now)
    out = net.flush(nid(2))
    assert out.reads == [(5, False)]
    assert out.messages == []


def test_read_request_to_a_non_leader_is_refused() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    b.step(ReadIndexRequest(hdr(peer(3), peer(2), b.term), 4), net.now)
    out = net.flush(nid(2))
    (resp,) = messages_of(out, ReadIndexResponse)
    assert not resp.ok  # type: ignore[union-attr]
    # and the follower that asked reports the failure to its reader
    c = net[3]
    c.follower_reads[4] = -1
    c.step(resp, net.now)
    assert net.flush(nid(3)).reads == [(4, False)]


def test_pending_follower_reads_fail_when_the_term_changes() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    net.blocked.add((nid(2), nid(1)))  # the request never arrives
    b.read(6, net.now)
    net.flush(nid(2))
    net.deliver_all()
    b.step(AppendEntries(hdr(peer(3), peer(2), b.term + 1), b.log.last_index, b.log.last_term, (), 0, 0), net.now)
    out = net.flush(nid(2))
    assert out.reads == [(6, False)]


# --------------------------------------------------------------------------------------
# Snapshots


def test_compaction_and_install_snapshot_to_a_lagging_follower() -> None:
    settings = Settings(snapshot_every_entries=4)
    net = make_net(3, settings=settings)
    a = elect(net, 1)
    assert a.log.snapshot.index >= 4  # founder entries and Noop applied: compacted
    net.isolate(3)
    for i in range(20):
        net.propose(1, Put(f"k{i}", str(i)))
        net.deliver_all()
    net.advance(60, only=[1, 2])
    assert a.commit == a.log.last_index == 27
    assert a.log.snapshot.index >= 24
    assert len(a.log.entries) < settings.snapshot_every_entries
    assert net.disks[nid(1)].snapshot == a.log.snapshot
    assert net[2].log.snapshot.index >= 24  # followers compact on their own
    c = net[3]
    assert c.log.last_index < a.log.snapshot.index
    net.heal()
    net.advance(200)
    snaps = net.sent_of(InstallSnapshot, src=1, dst=3)
    assert snaps, "the lagging follower must be sent a snapshot"
    assert c.commit == a.commit and c.applied == a.commit
    assert c.state == a.state
    assert dict(c.state.kv) == {f"k{i}": str(i) for i in range(20)}
    assert c.log.last_index == a.log.last_index
    installs = [o for o in net.outputs[nid(3)] if o.snapshot is not None and o.log_dirty_from == o.snapshot.index + 1]
    assert installs
    assert net.disks[nid(3)].snapshot.index >= snaps[0].snapshot.index  # type: ignore[union-attr]
    # Later writes reach it by ordinary appends.
    net.propose(1, Put("after", "snap"))
    net.advance(100)
    assert dict(c.state.kv)["after"] == "snap"


def test_snapshot_carries_the_config_at_its_index() -> None:
    settings = Settings(snapshot_every_entries=3)
    net = make_net(3, settings=settings)
    a = elect(net, 1)
    assert a.log.snapshot.config == Config((peer(1), peer(2), peer(3)), ())
    assert a.config == a.log.snapshot.config
    assert {m.node_id for m in a.log.snapshot.state.members} == {nid(1), nid(2), nid(3)}


def test_stale_install_snapshot_is_acknowledged_without_effect() -> None:
    net = make_net(3)
    a = elect(net, 1)
    for i in range(3):
        net.propose(1, Put(f"k{i}", "v"))
    net.advance(100)
    b = net[2]
    entries = list(b.log.entries)
    old = Snapshot(2, 1, b.log.config_at(2), empty_state(CL))
    b.step(InstallSnapshot(hdr(peer(1), peer(2), a.term), old), net.now)
    out = net.flush(nid(2))
    (resp,) = messages_of(out, AppendResponse)
    assert resp.success and resp.index == b.commit  # type: ignore[union-attr]
    assert b.log.entries == entries and out.snapshot is None


def test_install_snapshot_replaces_a_conflicting_log() -> None:
    net = make_net(3)
    elect(net, 1)
    b = net[2]
    state = apply_command(b.state, Put("from", "snapshot"))
    snap = Snapshot(40, b.term, b.config, state)
    b.step(InstallSnapshot(hdr(peer(1), peer(2), b.term), snap), net.now)
    out = net.flush(nid(2))
    assert out.snapshot == snap and out.log_dirty_from == 41
    assert b.log.entries == [] and b.log.last_index == 40
    assert b.commit == b.applied == 40
    assert b.state == state
    (resp,) = messages_of(out, AppendResponse)
    assert resp.success and resp.index == 40  # type: ignore[union-attr]


def test_install_snapshot_matching_the_log_keeps_later_entries() -> None:
    vs = [peer(1), peer(2), peer(3)]
    net = Net()
    base = Snapshot(0, 0, Config((), ()), empty_state(CL))
    entries = founder_log(vs) + [Entry(i, 2, Put(f"k{i}", "v")) for i in range(7, 11)]
    f = net.add(peer(2), HardState(2, peer(1)), RaftLog(base, entries))
    # The follower holds 1..10 (it acknowledged them) but only knows commit 0. A delayed
    # copy of a snapshot the leader took at index 8 arrives.
    assert f.commit == 0
    snap_state = empty_state(CL)
    for e in entries[:8]:
        snap_state = apply_command(snap_state, e.command)
    snap = Snapshot(8, 2, f.log.config_at(8), snap_state)
    f.step(InstallSnapshot(hdr(peer(1), peer(2), 2), snap), 10)
    net.flush(nid(2))
    assert f.log.last_index == 10
    assert [e.index for e in f.log.entries if e.index > 8] == [9, 10]


def _take(net: Net, src: int, dst: int) -> list[tuple[NodeId, NodeId, Message]]:
    """Pull the queued messages src -> dst out of the network (to hold, reorder or drop)."""
    taken = [q for q in net.queue if q[0] == nid(src) and q[1] == nid(dst)]
    net.queue = [q for q in net.queue if q not in taken]
    return taken


def _deliver(net: Net, item: tuple[NodeId, NodeId, Message]) -> None:
    net.queue.insert(0, item)
    assert net.deliver_one() is not None


def test_delayed_install_snapshot_cannot_lose_a_committed_entry() -> None:
    settings = Settings(snapshot_every_entries=4, entries_per_append_max=1, inflight_appends_max=64)
    net = make_net(3, settings=settings)
    a = elect(net, 1)
    c = net[3]
    assert a.log.snapshot.index == 7 and c.commit == 7 and net.queue == []
    for i in range(8, 13):
        net.propose(1, Put(f"k{i}", "v"))
    to_c = _take(net, 1, 3)  # five one-entry appends (commit 7), held by a slow link
    to_b = _take(net, 1, 2)
    assert len(to_c) == len(to_b) == 5
    for item in to_b[:4]:  # B gets 8..11; its copy of 12 is lost
        _deliver(net, item)
        net.deliver_all()
    assert a.commit == 11 and a.log.snapshot.index == 11
    # The append of 12 overtakes the others on the slow link: C rejects it, and the
    # leader, which compacted 8..11 away, answers with a snapshot at 11 (held too).
    _deliver(net, to_c[4])
    _deliver(net, net.queue.pop(0))  # C's rejection reaches the leader
    (install,) = _take(net, 1, 3)
    assert isinstance(install[2], InstallSnapshot) and install[2].snapshot.index == 11
    for item in to_c[:4]:  # the held appends of 8..11 arrive; C acknowledges them
        _deliver(net, item)
        _deliver(net, net.queue.pop(0))
        _take(net, 1, 3)  # the leader's follow-ups on the slow link are lost
    _deliver(net, to_c[4])  # a network duplicate of the append of 12 (commit 7)
    assert c.log.last_index == 12 and c.commit == 7
    _deliver(net, net.queue.pop(0))  # C's ack of 12: the leader commits 12 with C
    assert a.commit == 12
    assert Put("k12", "v") in [e.command for e in net.applied[nid(1)]]
    _take(net, 1, 3)
    _deliver(net, install)  # the delayed snapshot at 11 finally arrives
    net.queue.clear()
    # The leader crashes; B and C elect a new leader, which must hold committed entry 12.
    net.crash(nid(1))
    net.advance(1_000)
    (new,) = net.leaders()
    assert new.log.term_at(12) == a.log.term_at(12)
    assert new.log.entry(12).command == Put("k12", "v")


# --------------------------------------------------------------------------------------
# Crash and restart


def test_follower_restart_from_persisted_state_catches_up() -> None:
    net = make_net(3)
    a = elect(net, 1)
    net.propose(1, Put("a", "1"))
    net.advance(100)
    net.crash(nid(3))
    net.propose(1, Put("b", "2"))
    net.advance(100)
    c = net.restart(peer(3))
    assert c.term == a.term
    assert c.commit == 0  # commit is not persisted: relearned from the leader
    net.advance(200)
    assert c.commit == a.commit
    assert dict(c.state.kv) == {"a": "1", "b": "2"}
    assert c.log.entries == a.log.entries


def test_leader_restart_elects_someone_with_all_committed_entries() -> None:
    net = make_net(3)
    elect(net, 1)
    committed = [net.propose(1, Put(f"k{i}", "v")) for i in range(4)]
    net.deliver_all()
    net.crash(nid(1))
    net.advance(1_000)
    (new,) = net.leaders()
    for index in committed:
        assert new.log.entry(index).command == Put(f"k{committed.index(index)}", "v")
    a = net.restart(peer(1))
    net.advance(500)
    assert a.role is Role.FOLLOWER and a.leader == new.me
    assert a.log.entries == new.log.entries


# --------------------------------------------------------------------------------------
# Persistence contract


@pytest.mark.parametrize("seed", range(6))
def test_granted_votes_are_always_persisted_with_or_before_the_response(seed: int) -> None:
    rng = random.Random(seed)
    net = make_net(5, seed=seed)
    net.drop = lambda s, d, m: rng.random() < 0.2
    granted = 0
    for _ in range(150):
        net.now += rng.randint(5, 60)
        net.tick()
        net.deliver_all()
        if rng.random() < 0.05:
            victim = rng.choice([i for i in range(1, 6) if nid(i) in net.nodes])
            net.crash(nid(victim))
            net.restart(peer(victim))
    for node, outputs in net.outputs.items():
        hard: HardState | None = None
        for out in outputs:
            if out.hard_state is not None:
                hard = out.hard_state
            for _, m in out.messages:
                if isinstance(m, VoteResponse) and m.granted and not m.prevote:
                    granted += 1
                    # In this very output, or emitted earlier and unchanged since.
                    assert hard == HardState(m.hdr.term, Peer(m.hdr.dst, m.hdr.dst_inc)), (node, m)
    assert granted > 0


def test_restarted_nodes_never_regress_their_term() -> None:
    net = make_net(3)
    elect(net, 1)
    for victim in (2, 3, 1):
        term = net[victim].term
        net.crash(nid(victim))
        r = net.restart(peer(victim))
        assert r.term == term
        net.advance(600)
    assert len(net.leaders()) == 1


def test_next_deadline() -> None:
    net = make_net(3)
    b = net[2]
    assert S.election_min_ms <= b.next_deadline_ms() <= S.election_max_ms
    a = elect(net, 1)
    assert a.next_deadline_ms() <= net.now + S.heartbeat_ms
