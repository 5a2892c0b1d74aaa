"""The node machine: everything one agent decides, as one pure state machine.

It wraps a Raft object (raft.py) with the logic around consensus that makes p2pmesh
plug-and-play: forming a cluster with no seed, joining, merging clusters, failure
detection, learner promotion, removal, graceful leave and the standalone rule.

Inputs are past-tense facts (FrameReceived, PeerDiscovered, TimerFired, ...), each with
``now_ms``; the output of every input is one Ready of consensus output. The driver persists
its durable part (hard state, snapshot, log suffix), sends its messages, then ``advance``s
it and acts on the Effects that returns (core/outbox.py). The simulator and the agent both
run this class unchanged.

Formation and merging (no seed node, no configuration)
- A fresh node is *unformed*. It greets every discovered peer (Hello). If it sees a
  healthy cluster it asks to join it; otherwise, after ``formation_wait_ms``, the unformed
  node with the lowest node id among those it hears bootstraps a one-member cluster and
  the rest join it.
- Clusters are ranked by (committed member count, then lowest cluster id). A member that
  hears a Hello from a healthy cluster of higher rank leaves its cluster and joins that one
  with a fresh incarnation; the losing side's committed state is given up, the surviving
  side loses nothing. Ranks only change by committed membership changes, and a losing
  cluster never grows, so two clusters never swap members back and forth.
- A member whose cluster has had no working leader for ``standalone_after_ms`` (its side
  holds no quorum) joins a healthy cluster it can see, or else continues alone as a new
  standalone cluster with a new cluster id. It never commits anything in the old cluster
  without a quorum. When connectivity returns the merge rule folds it back in.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from p2pmesh.core.cluster import empty_state
from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.log import RaftLog
from p2pmesh.core.messages import (
    AddLearner, Capabilities, Drain, Command, Config, Entry, FetchReport, ForwardProposal, Header, Hello,
    JoinReply, JoinRequest, MarkDown, MarkUp, ModelInfo, MESSAGE_TYPES, Message, Peer, Promote, RemovalNotice,
    RemoveMember, SetModel, SetPlacement, Snapshot,
)
from p2pmesh.core.node_io import (  # the machine's inputs and outputs, importable from here too
    AddressesChanged,
    ClusterEvent,
    Effects,
    FetchProgressed,
    FrameReceived,
    GenerateCancelled,
    GenerateRequested,
    LEFT,
    MEMBER,
    UNFORMED,
    Input,
    LeaveRequested,
    MessageReceived,
    Mode,
    ModelMeasured,
    NodeHardState,
    PeerDiscovered,
    PeerVanished,
    PersistedState,
    PortsObserved,
    ProbesMeasured,
    ProposalRequested,
    ReadRequested,
    Ready,
    StageFilesFetched,
    Status,
    TimerFired,
    WorkerCrashed,
    WorkerLoad,
    WorkerLoaded,
    WorkerOutput,
)
from p2pmesh.core.leader import LeaderDuties
from p2pmesh.core.leave import LeaveStep
from p2pmesh.core.outbox import Outbox
from p2pmesh.core.peers import PeerBook, rank
from p2pmesh.core.publishing import LocalFacts, Publisher
from p2pmesh.core.raft import LEADER, HardState, Raft, RaftOutput
from p2pmesh.core.serving import ROUTED, Router
from p2pmesh.core.settings import Settings
from p2pmesh.core.transfers import Transfers
from p2pmesh.core import dataplane, leave, validate, wire

INC_MAX = 2**63 - 1
_EVENT_NAMES = {
    AddLearner: "member joined as learner",
    Promote: "member promoted to voter",
    RemoveMember: "member removed",
    MarkDown: "member down",
    MarkUp: "member up",
}


# --------------------------------------------------------------------------------------


class Machine:
    """One node's complete decision logic. Construct with ``Machine.boot``."""

    raft_class: type[Raft] = Raft
    leader_class: type[LeaderDuties] = LeaderDuties

    def __init__(
        self,
        *,
        node_id: NodeId,
        settings: Settings,
        rng: random.Random,
        now_ms: int,
        addresses: tuple[str, ...],
        caps: Capabilities,
        outbox: Outbox,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.rng = rng
        self.mode = UNFORMED
        self.inc = self._new_inc()
        self.raft: Raft | None = None
        self.started_ms = now_ms
        self.now_ms = now_ms
        self.peers = PeerBook(settings.peers_known_max, settings.peer_silent_ms)
        self.last_heard: dict[NodeId, int] = {}
        self.unhealthy_since_ms: int | None = now_ms
        self.hello_due_ms = now_ms
        self.joining: NodeId | None = None
        self.join_started_ms = 0
        self.leaving = False
        self.leave_confirmed = False
        """A graceful leave ended because the cluster committed this incarnation's removal
        (not because the deadline passed, or because there was no cluster to leave)."""
        self.leave_deadline_ms = 0
        self.rejected_frames = 0
        """Frames dropped for any reason (stale cluster or incarnation included)."""
        self.malformed_frames = 0
        """Frames that no correct peer sends: the driver closes the connection they came on."""
        self.ready = Ready()
        self.out = outbox
        """Effects collected for the next Ready, the Readies not yet advanced, what is durable."""
        self._last_leader: NodeId | None = None
        self.facts = LocalFacts(addresses, caps)
        """What this Mac knows about itself, to be published (core/publishing.py)."""
        self.publisher = Publisher(node_id, settings.hello_ms)
        self.duties = self.leader_class(settings)
        """The leader's proposals (core/leader.py), kept while this node leads."""
        self.router = Router(node_id)
        self.transfers = Transfers(node_id)  # every member's fetch of its stage's files
        self._inputs = self._input_table()

    # ------------------------------------------------------------------------------
    # Construction

    @classmethod
    def boot(
        cls,
        *,
        node_id: NodeId,
        persisted: PersistedState | None,
        settings: Settings,
        rng: random.Random,
        now_ms: int,
        addresses: tuple[str, ...] = (),
        caps: Capabilities = Capabilities(0, "unknown"),
        pipelined: bool = False,
    ) -> tuple[Machine, Ready]:
        """A machine and its first Ready. ``pipelined``: the driver may handle inputs before
        it advances earlier Readies (the simulator's disk; core/outbox.py)."""
        out = Outbox(pipelined=pipelined, persisted=persisted)
        m = cls(node_id=node_id, settings=settings, rng=rng, now_ms=now_ms, addresses=addresses, caps=caps, outbox=out)
        if persisted is None or persisted.hard.cluster is None:
            if persisted is not None:
                m.inc = persisted.hard.inc
            m._persist_hard()
        else:
            m.inc = persisted.hard.inc
            m.mode = MEMBER
            log = RaftLog(persisted.snapshot, list(persisted.entries))
            hard = HardState(persisted.hard.term, persisted.hard.vote)
            m.raft = m._new_raft(persisted.hard.cluster, hard, log, now_ms)
            out.events.append(ClusterEvent("restarted", f"cluster {persisted.hard.cluster}"))
        return m, m._take_ready()

    def _new_inc(self) -> int:
        return self.rng.randint(1, INC_MAX)

    def _new_raft(self, cluster: ClusterId, hard: HardState, log: RaftLog, now_ms: int) -> Raft:
        return self.raft_class(
            me=Peer(self.node_id, self.inc),
            cluster=cluster,
            hard=hard,
            log=log,
            settings=self.settings,
            rng=self.rng,
            now_ms=now_ms,
        )

    # ------------------------------------------------------------------------------
    # Queries

    @property
    def me(self) -> Peer:
        return Peer(self.node_id, self.inc)

    @property
    def cluster(self) -> ClusterId | None:
        return self.raft.cluster if self.raft else None

    def status(self) -> Status:
        r = self.raft
        role = "unformed" if self.mode is UNFORMED else "left" if self.mode is LEFT else "joining"
        if r is not None:
            if r.is_voter():
                role = r.role.value
            elif self.me in r.config.learners:
                role = "learner"
            if len(r.config.voters) == 1 and r.is_voter() and r.role is LEADER:
                role = "standalone"
        return Status(
            node_id=self.node_id,
            inc=self.inc,
            mode=self.mode,
            cluster=self.cluster,
            role=role,
            term=r.term if r else 0,
            leader=r.leader.node_id if r and r.leader else None,
            commit_index=r.commit if r else 0,
            applied_index=r.applied if r else 0,
            healthy=self._healthy(self.now_ms),
            durable_index=self.out.durable_index_of(self.cluster, self.inc),
        )

    def next_deadline_ms(self) -> int:
        due = self.hello_due_ms
        if self.raft is not None:
            due = min(due, self.raft.next_deadline_ms())
        return due

    def _healthy(self, now_ms: int) -> bool:
        r = self.raft
        if r is None or self.mode is not MEMBER:
            return False
        if r.role is LEADER:
            return True
        return r.leader is not None and r.leader_contact_ms is not None and now_ms - r.leader_contact_ms <= self.settings.election_max_ms

    # ------------------------------------------------------------------------------
    # The one entry point

    def handle(self, event: Input, now_ms: int) -> Ready:
        self.out.check_free()
        self.now_ms = now_ms
        if self.mode is LEFT:
            return self._take_ready()
        on_input = self._inputs.get(type(event))
        if on_input is None:
            raise LocalProtocolError(f"not an input of the node machine: {type(event).__name__}")
        on_input(event, now_ms)
        self._after(now_ms)
        if self.router.pending():
            self._route(now_ms)  # (else nothing in flight and nothing to collect: a hot path)
        return self._take_ready()

    def _input_table(self) -> dict[type, Callable[[Any, int], None]]:
        """Each input's handler, bound (so a subclass's override is the one called)."""
        return {
            FrameReceived: self._on_frame,
            MessageReceived: self._on_message,
            TimerFired: self._on_timer,
            PeerDiscovered: self._on_discovered,
            PeerVanished: self._on_vanished,
            ProposalRequested: self._on_proposal,
            ReadRequested: self._on_read,
            PortsObserved: self._on_ports,
            AddressesChanged: self._on_addresses,
            ProbesMeasured: self._on_probes,
            ModelMeasured: self._on_measured,
            StageFilesFetched: self._on_fetched,
            WorkerLoaded: self._on_loaded,
            GenerateRequested: lambda event, now_ms: self.router.requested(event.req, event.params, now_ms),
            GenerateCancelled: lambda event, now_ms: self.router.cancelled(event.req, now_ms),
            WorkerLoad: lambda e, now_ms: self.router.worker_load(e.epoch, e.running, e.queued, e.tokens, now_ms),
            WorkerOutput: self._on_worker_output,
            WorkerCrashed: self._on_worker_crashed,
            FetchProgressed: self._on_fetch_progress,
            LeaveRequested: self._on_leave,
        }

    # ------------------------------------------------------------------------------
    # Inputs that only record a fact or hand it on

    def _on_message(self, event: MessageReceived, now_ms: int) -> None:
        self.receive(event.peer, event.message, now_ms, trusted=True)

    def _on_vanished(self, event: PeerVanished, now_ms: int) -> None:
        self.peers.forget(event.node_id)

    def _on_proposal(self, event: ProposalRequested, now_ms: int) -> None:
        self._propose(event.command, now_ms)

    def _on_read(self, event: ReadRequested, now_ms: int) -> None:
        if self.raft is None:
            self.ready.reads.append((event.ctx, False))
        else:
            self.raft.read(event.ctx, now_ms)

    def _on_ports(self, event: PortsObserved, now_ms: int) -> None:
        self.facts.ports = event.ports

    def _on_addresses(self, event: AddressesChanged, now_ms: int) -> None:
        self.facts.addresses = tuple(event.addresses[:validate.ADDRESSES_MAX])

    def _on_probes(self, event: ProbesMeasured, now_ms: int) -> None:
        self.facts.probes = event.probes

    def _on_measured(self, event: ModelMeasured, now_ms: int) -> None:
        self.publisher.measured(self.facts, event.measure)

    def _on_fetched(self, event: StageFilesFetched, now_ms: int) -> None:
        self.facts.worker_event("fetched", event.epoch)

    def _on_fetch_progress(self, event: FetchProgressed, now_ms: int) -> None:
        report = self.transfers.local(event.source, event.bytes_done, event.bytes_total, now_ms, event.hub_files)
        if report is not None and self.raft is not None and self.mode is MEMBER:
            self.ready.messages.extend((m.node_id, report) for m in self.raft.state.members if m.node_id != self.node_id)

    def _on_loaded(self, event: WorkerLoaded, now_ms: int) -> None:
        self.facts.worker_event("loaded", event.epoch)

    def _on_worker_crashed(self, event: WorkerCrashed, now_ms: int) -> None:
        self.facts.worker_event("crashed", event.epoch, event.fault)

    def _on_worker_output(self, event: WorkerOutput, now_ms: int) -> None:
        self.router.worker_event(
            event.epoch, event.req, event.tokens, event.text, event.done, event.finish, event.prompt_tokens, event.attempt, now_ms,
            broken=event.broken, code=event.code,
        )

    def _on_leave(self, event: LeaveRequested, now_ms: int) -> None:
        if not self.leaving:
            self.leaving = True
            self.leave_deadline_ms = now_ms + self.settings.leave_timeout_ms
            if self._holds_layers():
                self.leave_deadline_ms += self.settings.drain_timeout_ms
        self._drive_leave(now_ms)

    def _take_ready(self) -> Ready:
        ready, self.ready = self.ready, Ready()
        return self.out.hand_out(ready)

    def advance(self, ready: Ready) -> Effects:
        """The driver made ``ready``'s durable part durable and sent its messages: record what
        is on disk and return what may now be observed (core/outbox.py)."""
        return self.out.advance(ready)

    def effects_of(self, ready: Ready) -> Effects:
        """What ``advance(ready)`` will return, without advancing: for the simulator's trace,
        which records a node's decisions when it makes them. Never acted on before advance."""
        return self.out.effects_of(ready)

    # ------------------------------------------------------------------------------
    # Frames

    def _on_frame(self, event: FrameReceived, now_ms: int) -> None:
        try:
            msg = wire.decode(event.data)
        except RemoteProtocolError:
            self.rejected_frames += 1
            self.malformed_frames += 1
            return
        self.receive(event.peer, msg, now_ms)

    def receive(self, peer: NodeId, msg: Message, now_ms: int, *, trusted: bool = False) -> None:
        """Handle a decoded message from an authenticated peer (checks who claims what, and
        unless ``trusted``, a MessageReceived, that its numbers make sense)."""
        if not isinstance(msg, MESSAGE_TYPES):
            self.rejected_frames += 1  # a registered value that is not a message
            self.malformed_frames += 1
            return
        hdr = getattr(msg, "hdr", None)  # Raft's messages have a header, the others not
        claimed = msg.src if hdr is None else hdr.src  # type: ignore[union-attr]
        if claimed != peer or (not trusted and validate.problem(msg) is not None):
            self.rejected_frames += 1  # a peer claiming another node's id, or nonsense
            self.malformed_frames += 1
            return
        self.last_heard[peer] = now_ms
        if hdr is not None:
            self._on_raft_message(msg, now_ms)
        elif isinstance(msg, Hello):
            self._on_hello(msg, now_ms)
        elif isinstance(msg, JoinRequest):
            self._on_join_request(msg, now_ms)
        elif isinstance(msg, JoinReply):
            self._on_join_reply(msg)
        elif isinstance(msg, RemovalNotice):
            self._on_removal_notice(peer, msg, now_ms)
        elif isinstance(msg, (*ROUTED, FetchReport)):
            self._on_infer(peer, msg, now_ms)

    def _on_infer(self, peer: NodeId, msg: Message, now_ms: int) -> None:
        r = self.raft
        # Authenticated peers only reach us at all; also accept a Mac that joined so recently
        # that this node has not applied its membership yet (it knows it from discovery).
        if r is None or not (any(m.node_id == peer for m in r.state.members) or peer in self.peers):
            self.rejected_frames += 1
        elif isinstance(msg, FetchReport):
            self.transfers.heard(peer, msg, now_ms)
        else:
            self.router.on_message(peer, msg, r.state, now_ms)

    def _on_raft_message(self, msg: Message, now_ms: int) -> None:
        r = self.raft
        hdr: Header = msg.hdr  # type: ignore[union-attr]
        if r is None or hdr.cluster != r.cluster or hdr.dst != self.node_id or hdr.dst_inc != self.inc:
            self.rejected_frames += 1
            return
        info = self.peers.get(hdr.src)
        if info is not None and (info.mate is None or info.mate.inc != hdr.src_inc):
            info.mate = Peer(hdr.src, hdr.src_inc)
        r.step(msg, now_ms)

    # ------------------------------------------------------------------------------
    # Discovery and formation

    def _on_discovered(self, event: PeerDiscovered, now_ms: int) -> None:
        if event.node_id == self.node_id:
            return
        info = self.peers.get(event.node_id)
        if info is None:
            if self.peers.learn(event.node_id, event.addresses) is not None:
                self._send_hello(event.node_id, now_ms)
        else:
            info.addresses = event.addresses

    def _hello(self, now_ms: int) -> Hello:
        r = self.raft
        members = len(r.state.members) if r is not None and self.mode is MEMBER else 0
        leader = r.leader.node_id if r is not None and r.leader is not None else None
        return Hello(self.node_id, self.inc, self.cluster, members, self._healthy(now_ms), leader, self.facts.addresses, self.facts.caps)

    def _send_hello(self, to: NodeId, now_ms: int) -> None:
        self.ready.messages.append((to, self._hello(now_ms)))

    def _on_hello(self, h: Hello, now_ms: int) -> None:
        info = self.peers.learn(h.src, h.addresses)
        if info is None:
            return
        info.hello = h
        info.hello_ms = now_ms
        info.mate = None
        if h.cluster != self.cluster or h.cluster is None:
            # Answer someone outside our cluster at once (at most once per hello period):
            # it speeds up formation and lets a rejoining Mac hear about us.
            if now_ms - info.replied_ms >= self.settings.hello_ms:
                info.replied_ms = now_ms
                self._send_hello(h.src, now_ms)

    def _formation_step(self, now_ms: int) -> None:
        """Decide, on the hello timer, whether to bootstrap, join, switch or go standalone."""
        if self.leaving:
            return
        best = self.peers.best_foreign_cluster(self.cluster, now_ms)
        if self.mode is UNFORMED:
            if best is not None:
                self._join(best, now_ms)
            elif now_ms - self.started_ms >= self.settings.formation_wait_ms and self.peers.lowest_unformed(self.node_id, now_ms):
                self._bootstrap(now_ms, reason="formed")
            return
        r = self.raft
        assert r is not None
        if self.joining is not None and r.me not in r.config.voters and r.me not in r.config.learners:
            # Still waiting to be added: keep asking, give up after a while.
            if now_ms - self.join_started_ms > self.settings.standalone_after_ms:
                self._become_unformed(now_ms, "join timed out")
            else:
                self._send_join(self.joining)
            return
        self.joining = None
        unhealthy_long = (
            self.unhealthy_since_ms is not None and now_ms - self.unhealthy_since_ms >= self.settings.standalone_after_ms
        )
        if best is not None:
            mine = rank(len(r.state.members), r.cluster)
            if rank(best.members, best.cluster) > mine or unhealthy_long:  # type: ignore[arg-type]
                self._join(best, now_ms)
                return
        if unhealthy_long:
            # Our own cluster is alive without us (we were removed, or cut off from the
            # leader for long): come back as a fresh incarnation.
            mates = [h for h in self.peers.fresh_hellos(now_ms) if h.cluster == r.cluster and h.healthy and h.leader]
            if mates:
                self._join(mates[0], now_ms)
                return
        if unhealthy_long and r.config.voters != (self.me,):
            # The user's choice of model outlives the cluster it was made in: a Mac left
            # alone (the other of two died) keeps serving it, and the merge keeps it after.
            self._bootstrap(now_ms, reason="standalone", model=r.state.model)

    def _bootstrap(self, now_ms: int, *, reason: str, model: ModelInfo | None = None) -> None:
        """Found a new one-member cluster (a first formation, or continuing standalone with
        the old cluster's model: nothing else carries over, placement is planned afresh)."""
        cluster = ClusterId(f"{self.rng.getrandbits(64):016x}")
        self._reset_identity()
        me = self.me
        base = Snapshot(0, 0, Config((), ()), empty_state(cluster))
        entries = [
            Entry(1, 1, AddLearner(self.node_id, self.inc, self.facts.addresses, self.facts.caps)),
            Entry(2, 1, Promote(self.node_id, self.inc)),
        ]
        if model is not None:
            entries.append(Entry(3, 1, SetModel(model)))
        log = RaftLog(base, entries)
        self.raft = self._new_raft(cluster, HardState(1, me), log, now_ms)
        self.raft.commit_founding(len(entries))
        self.mode = MEMBER
        self.joining = None
        self.unhealthy_since_ms = now_ms
        self._persist_switch(base)
        self.out.events.append(ClusterEvent(f"cluster {reason}", cluster))
        self.raft.campaign(now_ms, prevote=True, transfer=False)

    def _join(self, target: Hello, now_ms: int) -> None:
        assert target.cluster is not None
        old = self.cluster
        self._reset_identity()
        base = Snapshot(0, 0, Config((), ()), empty_state(target.cluster))
        self.raft = self._new_raft(target.cluster, HardState(0, None), RaftLog(base), now_ms)
        self.mode = MEMBER
        self.joining = target.src
        self.join_started_ms = now_ms
        self.unhealthy_since_ms = now_ms
        self._persist_switch(base)
        detail = f"{target.cluster} (from {old})" if old else target.cluster
        self.out.events.append(ClusterEvent("joining cluster", detail))
        self._send_join(target.src)

    def _send_join(self, to: NodeId) -> None:
        r = self.raft
        assert r is not None
        self.ready.messages.append((to, JoinRequest(self.node_id, self.inc, r.cluster, self.facts.addresses, self.facts.caps)))

    def _become_unformed(self, now_ms: int, reason: str) -> None:
        self._reset_identity()
        self.raft = None
        self.mode = UNFORMED
        self.joining = None
        self.started_ms = now_ms
        self.out.events.append(ClusterEvent("unformed", reason))
        self._persist_hard()

    def _reset_identity(self) -> None:
        # A fresh log always comes with a fresh incarnation: nobody may mistake the new,
        # empty log for the old one (the node-id reuse hazard of etcd-io/raft).
        self.inc = self._new_inc()
        self.last_heard = {}
        self.facts.fetched = set()  # epochs of the old log's placements, not the new one's
        # Raft messages of the abandoned log must not go out after the switch is persisted.
        self.ready.messages = [(dst, m) for dst, m in self.ready.messages if not hasattr(m, "hdr")]

    def _persist_switch(self, base: Snapshot) -> None:
        r = self.raft
        assert r is not None
        self.ready.snapshot = base
        self.ready.log_truncate_from = base.index + 1
        self.ready.log_entries = tuple(r.log.entries)
        r.log_persisted()
        self._persist_hard()

    def _persist_hard(self) -> None:
        r = self.raft
        self.ready.hard = NodeHardState(
            self.cluster,
            self.inc,
            r.term if r else 0,
            r.vote if r else None,
        )

    # ------------------------------------------------------------------------------
    # Joining (leader side), promotion, failure detection, removal

    def _on_join_request(self, j: JoinRequest, now_ms: int) -> None:
        r = self.raft
        if r is None or j.cluster != r.cluster:
            self.ready.messages.append((j.src, JoinReply(self.node_id, self.cluster or ClusterId(""), False, None)))
            return
        if r.role is not LEADER:
            hint = r.leader.node_id if r.leader is not None else None
            self.ready.messages.append((j.src, JoinReply(self.node_id, r.cluster, False, hint)))
            return
        peer = Peer(j.src, j.inc)
        config = r.config
        stale = [p for p in (*config.voters, *config.learners) if p.node_id == j.src and p != peer]
        if peer in config.voters or peer in config.learners:
            accepted = True
        elif stale:
            # The same Mac with a fresh log: retire the old incarnation first.
            self._propose_once(RemoveMember(stale[0].node_id, stale[0].inc, "rejoined with a new log"), now_ms)
            accepted = False
        else:
            accepted = self._propose_once(AddLearner(j.src, j.inc, j.addresses, j.caps), now_ms)
        self.last_heard[j.src] = now_ms
        self.ready.messages.append((j.src, JoinReply(self.node_id, r.cluster, accepted, self.node_id)))

    def _on_join_reply(self, reply: JoinReply) -> None:
        r = self.raft
        if r is None or self.joining is None or reply.cluster != r.cluster:
            return
        if not reply.accepted and reply.leader is not None and reply.leader != self.joining:
            self.joining = reply.leader
            self._send_join(reply.leader)

    def _on_removal_notice(self, peer: NodeId, notice: RemovalNotice, now_ms: int) -> None:
        r = self.raft
        if r is None or notice.cluster != r.cluster or notice.node_id != self.node_id or notice.inc != self.inc:
            return
        if not any(p.node_id == peer for p in r.config.voters):
            self.rejected_frames += 1  # only a voter of our cluster may tell us this
            return
        if self.leaving:
            self._finish_leave(confirmed=True)
        else:
            self._become_unformed(now_ms, "removed from the cluster")

    def _propose_once(self, command: Command, now_ms: int) -> bool:
        assert self.raft is not None
        return self.duties.propose_once(self.raft, command, now_ms)

    def _publish(self, now_ms: int) -> None:
        """Bring this member's committed record up to date with its local facts (any role;
        core/publishing.py). Peers dial the committed addresses, and LAN hops of the MLX
        hostfile use them: a Mac that moved must not be left behind at the old address."""
        r = self.raft
        if r is None or self.mode is not MEMBER or self.leaving or r.leader is None:
            return
        for command in self.publisher.commands(self.facts, r, self.inc, now_ms):
            self._propose(command, now_ms)

    def _route(self, now_ms: int) -> None:
        """Move inference requests along (core/serving.py) and collect their effects."""
        r = self.raft
        state = r.state if r is not None and self.mode is MEMBER else None
        head = dataplane.head(state) if state is not None else None
        epoch = state.active_epoch if state is not None else 0
        messages, submits, client = self.router.step(state, head, epoch, now_ms)
        self.ready.messages.extend(messages)
        self.out.submits.extend(submits)
        self.out.client.extend(client)

    # ------------------------------------------------------------------------------
    # Proposals and leaving

    def _propose(self, command: Command, now_ms: int) -> None:
        r = self.raft
        if r is None or validate.command_problem(command) is not None:
            return
        if r.role is LEADER:
            r.propose(command, now_ms)
        elif r.leader is not None:
            self.ready.messages.append((r.leader.node_id, ForwardProposal(r.header_to(r.leader), command)))

    def _drive_leave(self, now_ms: int) -> None:
        r = self.raft
        if r is None or self.mode is not MEMBER:
            self._finish_leave()
            return
        step = leave.next_step(
            r, self.me, joining=self.joining is not None, holds_layers=self._holds_layers(),
            draining=self.node_id in r.state.draining, now_ms=now_ms, deadline_ms=self.leave_deadline_ms,
            drain_until_ms=self.leave_deadline_ms - self.settings.leave_timeout_ms,
        )
        if step is LeaveStep.TIMED_OUT:
            self.out.events.append(ClusterEvent("leave not confirmed", "stopping anyway"))
            self._finish_leave()
        elif step in (LeaveStep.FINISH, LeaveStep.FINISH_CONFIRMED):
            self._finish_leave(confirmed=step is LeaveStep.FINISH_CONFIRMED)
        elif step is LeaveStep.DRAIN:
            self._propose(Drain(self.node_id, self.inc), now_ms)
        elif step is LeaveStep.TRANSFER:
            r.transfer_leadership(leave.transfer_target(r, self.me), now_ms)
        elif step is LeaveStep.REMOVE_SELF:
            r.propose(RemoveMember(self.node_id, self.inc, "left"), now_ms)
        elif step is LeaveStep.FORWARD_REMOVE:
            self._propose(RemoveMember(self.node_id, self.inc, "left"), now_ms)

    def _holds_layers(self) -> bool:
        """Whether a leave has something to hand over first (leave.holds_layers)."""
        return self.raft is not None and self.mode is MEMBER and leave.holds_layers(self.raft.state, self.node_id)

    def _finish_leave(self, *, confirmed: bool = False) -> None:
        self.leave_confirmed = confirmed
        self.mode = LEFT
        self.ready.left = True
        self.out.events.append(ClusterEvent("left cluster", self.cluster or "-"))

    # ------------------------------------------------------------------------------
    # Timers and bookkeeping after every input

    def _on_timer(self, event: TimerFired, now_ms: int) -> None:
        if self.raft is not None:
            self.raft.tick(now_ms)
        if now_ms >= self.hello_due_ms:
            self.hello_due_ms = now_ms + self.settings.hello_ms
            self._formation_step(now_ms)
            self._greet(now_ms)
            if self.leaving:
                self._drive_leave(now_ms)

    def _greet(self, now_ms: int) -> None:
        """Hello every known peer that is not a current cluster-mate (mates hear Raft)."""
        r = self.raft
        # (node id, incarnation) pairs, not Peers: hashing a Peer is a Python-level call.
        mates = {(p.node_id, p.inc) for p in (*r.config.voters, *r.config.learners)} if r else set()
        hello: Hello | None = None  # made for the first peer that needs one (often none does)
        for node_id, info in self.peers.items():
            if info.mate is not None and (info.mate.node_id, info.mate.inc) in mates:
                continue
            if hello is None:
                hello = self._hello(now_ms)
            info.replied_ms = now_ms
            self.ready.messages.append((node_id, hello))

    def _after(self, now_ms: int) -> None:
        r = self.raft
        if r is None:
            return
        if r.role is LEADER:
            if self._last_leader != self.node_id:
                self.duties.became_leader(now_ms)
            self.duties.run(r, self.me, self.last_heard, now_ms)
        self._publish(now_ms)
        if self._healthy(now_ms):
            self.unhealthy_since_ms = None
        elif self.unhealthy_since_ms is None:
            self.unhealthy_since_ms = now_ms
        applied: list[Entry] = []
        if r.has_output():  # (half of all inputs leave Raft nothing to report)
            out = r.take_output()
            self._merge_output(out, now_ms)
            applied = out.applied
        leader = r.leader.node_id if r.leader else None
        if leader != self._last_leader:
            self._last_leader = leader
            if leader is not None:
                self.out.events.append(ClusterEvent("leader elected", f"{leader} term {r.term}"))
        if self.leaving and applied:
            self._drive_leave(now_ms)
        if applied and self.mode is MEMBER and not self.leaving and self._removed_in(applied):
            self._become_unformed(now_ms, "removed from the cluster")

    def _removed_in(self, applied: list[Entry]) -> bool:
        """True when a committed entry removes this very incarnation."""
        for e in applied:
            cmd = e.command
            if isinstance(cmd, RemoveMember) and cmd.node_id == self.node_id and cmd.inc == self.inc:
                return True
        return False

    def _merge_output(self, out: RaftOutput, now_ms: int) -> None:
        ready = self.ready
        r = self.raft
        assert r is not None
        ready.messages.extend(out.messages)
        ready.applied.extend(out.applied)
        ready.reads.extend(out.reads)
        if out.hard_state is not None:
            self._persist_hard()
        if out.snapshot is not None:
            ready.snapshot = out.snapshot  # the latest snapshot supersedes any earlier one
        if out.log_dirty_from is not None:
            start = out.log_dirty_from
            if ready.log_truncate_from is None or start < ready.log_truncate_from:
                ready.log_truncate_from = start
            ready.log_entries = tuple(r.log.entries[max(0, ready.log_truncate_from - r.log.first_index) :])
        for entry in out.applied:
            cmd = entry.command
            if isinstance(cmd, RemoveMember) and r.role is LEADER and cmd.node_id != self.node_id:
                ready.messages.append((cmd.node_id, RemovalNotice(self.node_id, r.cluster, cmd.node_id, cmd.inc)))
            if isinstance(cmd, (AddLearner, Promote, RemoveMember, MarkDown, MarkUp)):
                self.out.events.append(ClusterEvent(_EVENT_NAMES[type(cmd)], cmd.node_id))
            elif isinstance(cmd, SetPlacement):  # (in the agent's log: where a model went, and when)
                stages = ", ".join(f"{s.node_id[:8]} [{s.start}, {s.end})" for s in cmd.stages) or "nothing"
                self.out.events.append(ClusterEvent("placement", f"epoch {cmd.epoch}: {stages}"))
