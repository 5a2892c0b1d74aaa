"""The node machine: everything one agent decides, as one pure state machine.

It wraps a Raft object (raft.py) with the logic around consensus that makes p2pmesh
plug-and-play: forming a cluster with no seed, joining, merging clusters, failure
detection, learner promotion, removal, graceful leave and the standalone rule.

Inputs are past-tense facts (FrameReceived, PeerDiscovered, TimerFired, ...), each with
``now_ms``; the output of every input is one Ready batch. The driver persists the Ready's
durable part (hard state, snapshot, log suffix), then sends its messages, then acts on the
rest. The simulator and the agent both run this class unchanged.

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

import enum
import operator
import random
from collections.abc import Generator
from dataclasses import dataclass, field

from p2pmesh.core.cluster import empty_state, find_member
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.log import RaftLog
from p2pmesh.core.messages import (
    AddLearner,
    Capabilities,
    Drain,
    Command,
    Config,
    Entry,
    ForwardProposal,
    Header,
    Hello,
    JoinReply,
    InferRequest,
    InferTokens,
    JoinRequest,
    LinkProbe,
    MarkDown,
    Measure,
    MeasureFailed,
    MarkUp,
    ModelInfo,
    MESSAGE_TYPES,
    Message,
    Peer,
    PortInfo,
    Promote,
    PublishMeasure,
    PublishPorts,
    RemovalNotice,
    RemoveMember,
    SetModel,
    UpdateMember,
    StageFetched,
    Snapshot,
    WorkerFailed,
    WorkerFault,
    WorkerReady,
)
from p2pmesh.core.raft import LEADER, HardState, Raft, RaftOutput
from p2pmesh.core.serving import ClientEvent, GenerateParams, Router, WorkerSubmit
from p2pmesh.core.settings import Settings
from p2pmesh.core import dataplane, physical, validate, wire

INC_MAX = 2**63 - 1
_EVENT_NAMES = {
    AddLearner: "member joined as learner",
    Promote: "member promoted to voter",
    RemoveMember: "member removed",
    MarkDown: "member down",
    MarkUp: "member up",
}


class Mode(enum.Enum):
    UNFORMED = "unformed"
    MEMBER = "member"
    LEFT = "left"


UNFORMED, MEMBER, LEFT = Mode.UNFORMED, Mode.MEMBER, Mode.LEFT
"""The modes as module constants, compared with on every input (see raft.LEADER)."""


# --------------------------------------------------------------------------------------
# Inputs (past-tense facts)


@dataclass(frozen=True, slots=True)
class FrameReceived:
    """A frame arrived over a connection authenticated as ``peer``."""

    peer: NodeId
    data: bytes


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A message from ``peer`` that this process's own driver made from another core's
    output (the simulator): no frame to decode, and no semantic checks (``validate``): a
    correct core makes no message that fails them, and the simulator checks that on a
    sample (sim/world.py, invariant wire-roundtrip). The agent never makes one."""

    peer: NodeId
    message: Message


@dataclass(frozen=True, slots=True)
class PeerDiscovered:
    node_id: NodeId
    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PeerVanished:
    node_id: NodeId


@dataclass(frozen=True, slots=True)
class TimerFired:
    pass


@dataclass(frozen=True, slots=True)
class ProposalRequested:
    command: Command


@dataclass(frozen=True, slots=True)
class ReadRequested:
    ctx: int


@dataclass(frozen=True, slots=True)
class LeaveRequested:
    pass


@dataclass(frozen=True, slots=True)
class AddressesChanged:
    """This node's control-plane addresses ("host:port") changed: a cable came up with an
    address, a laptop moved to another network, DHCP gave another lease."""

    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PortsObserved:
    """The driver's link watcher saw this node's ports change (cable plugged or pulled,
    address added)."""

    ports: tuple[PortInfo, ...]


@dataclass(frozen=True, slots=True)
class ProbesMeasured:
    """Fresh results of the bounded link probes to cabled peers."""

    probes: tuple[LinkProbe, ...]


@dataclass(frozen=True, slots=True)
class ModelMeasured:
    """This node measured the cluster's model: its usable memory and one layer's time (or
    why it cannot load the model at all)."""

    measure: Measure | MeasureFailed


@dataclass(frozen=True, slots=True)
class WorkerLoaded:
    """This node's worker for data-plane ``epoch`` loaded its layers and joined its group."""

    epoch: int


@dataclass(frozen=True, slots=True)
class StageFilesFetched:
    """The model files of this node's stage in data-plane ``epoch`` are on its disk."""

    epoch: int


@dataclass(frozen=True, slots=True)
class GenerateRequested:
    """A local client asked for a generation (``req`` is unique on this node)."""

    req: str
    params: GenerateParams


@dataclass(frozen=True, slots=True)
class WorkerOutput:
    """The local head worker of ``epoch`` streamed tokens (or finished) for a request."""

    epoch: int
    req: str
    tokens: tuple[int, ...]
    text: str
    done: bool
    finish: str
    prompt_tokens: tuple[int, ...]
    attempt: int = 0
    broken: bool = False
    """The worker's pipeline failed under the request (a peer lost): the epoch's fault, not the
    request's, so it resumes on the next epoch. Only an error the worker blames on the request
    itself (a bad prompt, too long) ends it."""


@dataclass(frozen=True, slots=True)
class WorkerCrashed:
    """This node's worker for data-plane ``epoch`` exited or stopped answering."""

    epoch: int
    fault: WorkerFault | None = None
    """Why, when the worker said (its ring peer unreachable, its port taken)."""


Input = (
    FrameReceived
    | MessageReceived
    | PeerDiscovered
    | PeerVanished
    | TimerFired
    | ProposalRequested
    | ReadRequested
    | LeaveRequested
    | PortsObserved
    | AddressesChanged
    | ProbesMeasured
    | ModelMeasured
    | WorkerLoaded
    | StageFilesFetched
    | GenerateRequested
    | WorkerOutput
    | WorkerCrashed
)


# --------------------------------------------------------------------------------------
# Outputs


@dataclass(frozen=True, slots=True)
class NodeHardState:
    """Durable per-node facts besides the log: which cluster, which incarnation, Raft's
    term and vote. Written before any message of the same Ready is sent."""

    cluster: ClusterId | None
    inc: int
    term: int
    vote: Peer | None


@dataclass(frozen=True, slots=True)
class PersistedState:
    """What a driver hands back at boot: the last hard state, snapshot and entries."""

    hard: NodeHardState
    snapshot: Snapshot
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class ClusterEvent:
    """Something worth one log line: kind is a short verb phrase, detail a node or term."""

    kind: str
    detail: str


@dataclass(slots=True)
class Ready:
    """One batch of effects. Contract for drivers: first make the durable part durable
    (``hard``; then ``snapshot``, which drops stored entries at or below its index; then
    the log suffix: drop stored entries at ``log_truncate_from`` and after, append
    ``log_entries``, which start at ``max(log_truncate_from, snapshot.index + 1)`` and are
    contiguous), then send ``messages``, then act on ``applied``, ``reads``, ``events``
    and ``left``. Readies are handled strictly in order."""

    hard: NodeHardState | None = None
    snapshot: Snapshot | None = None
    log_truncate_from: int | None = None
    log_entries: tuple[Entry, ...] = ()
    messages: list[tuple[NodeId, Message]] = field(default_factory=list)
    applied: list[Entry] = field(default_factory=list)
    reads: list[tuple[int, bool]] = field(default_factory=list)
    events: list[ClusterEvent] = field(default_factory=list)
    left: bool = False
    submits: list[WorkerSubmit] = field(default_factory=list)
    """Requests for the local head worker (after the messages)."""
    client: list[ClientEvent] = field(default_factory=list)
    """Tokens and ends of requests local clients asked for."""


@dataclass(frozen=True, slots=True)
class Status:
    node_id: NodeId
    inc: int
    mode: Mode
    cluster: ClusterId | None
    role: str
    term: int
    leader: NodeId | None
    commit_index: int
    applied_index: int
    healthy: bool


@dataclass(slots=True)
class _PeerInfo:
    addresses: tuple[str, ...]
    hello: Hello | None = None
    hello_ms: int = -1
    mate: Peer | None = None
    """The incarnation last seen speaking Raft in our cluster (so no Hello is needed)."""
    replied_ms: int = -(10**9)


# --------------------------------------------------------------------------------------


class Machine:
    """One node's complete decision logic. Construct with ``Machine.boot``."""

    raft_class: type[Raft] = Raft

    def __init__(
        self,
        *,
        node_id: NodeId,
        settings: Settings,
        rng: random.Random,
        now_ms: int,
        addresses: tuple[str, ...],
        caps: Capabilities,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.rng = rng
        self.addresses = addresses
        self.caps = caps
        self.mode = UNFORMED
        self.inc = self._new_inc()
        self.raft: Raft | None = None
        self.started_ms = now_ms
        self.now_ms = now_ms
        self.peers: dict[NodeId, _PeerInfo] = {}
        self.last_heard: dict[NodeId, int] = {}
        self.leader_since_ms = 0
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
        self._last_leader: NodeId | None = None
        self._inflight: dict[tuple[str, str], int] = {}
        self.ports: tuple[PortInfo, ...] = ()
        self.probes: tuple[LinkProbe, ...] = ()
        self._ports_sent_ms = -(10**9)
        self._addresses_sent_ms = -(10**9)
        self._quiet_members: tuple[object, ...] = (None, None, None, 0)
        """(members, last_heard, leader_since_ms, until_ms): the leader's silence detection
        found nothing to do for these members, and cannot before until_ms (_detect)."""
        self._ports_current: tuple[object, ...] = (None,) * 6
        """(committed state, incarnation, addresses, caps, ports, probes) when the committed
        member last matched the local facts: nothing to publish while they stay the same."""
        self.measure: Measure | MeasureFailed | None = None
        self._failure_committed = False  # our MeasureFailed was committed (then cluster.py may forget it)
        self._measure_sent_ms = -(10**9)
        self.loaded: set[int] = set()
        """Data-plane epochs whose local worker reported ready."""
        self._ready_sent: dict[int, int] = {}
        self.fetched: set[int] = set()
        """Data-plane epochs whose stage files the driver reported on disk."""
        self._fetched_sent: dict[int, int] = {}
        self.crashed: set[int] = set()
        """Data-plane epochs whose local worker died or hung."""
        self.faults: dict[int, WorkerFault] = {}
        """Why a crashed epoch's worker failed, when it said (bounded like ``crashed``)."""
        self._failed_sent: dict[int, int] = {}
        self._placement_checked_at: tuple[int, int] = (-1, -1)
        self.router = Router(node_id)
        self._ring_checked_at: tuple[int, int] = (-1, -1)
        """(term, applied index) at which the leader last compared the ring (solving is
        the costliest pure step, so it runs once per state change, not per input)."""
        self._ring_settled: tuple[object, ...] | None = None
        """The inputs of physical.negotiate (members, ring, hops) when it last found nothing
        to propose: a pure function, so the same inputs need no new solve (most applied
        entries change neither)."""
        self._ring_plan: tuple[tuple[tuple[object, ...], ...], physical.RingPlan | None] | None = None
        """(physical.plan_inputs, physical.plan_ring) of the last solve, kept while its inputs stay."""
        self._ring_solving: tuple[tuple[tuple[object, ...], ...], Generator[None, None, physical.RingPlan | None]] | None = None
        """A solve spread over several steps (physical.plan_ring_steps): its inputs, its rest."""

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
    ) -> tuple[Machine, Ready]:
        m = cls(node_id=node_id, settings=settings, rng=rng, now_ms=now_ms, addresses=addresses, caps=caps)
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
            m.ready.events.append(ClusterEvent("restarted", f"cluster {persisted.hard.cluster}"))
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
        self.now_ms = now_ms
        if self.mode is LEFT:
            return self._take_ready()
        if isinstance(event, FrameReceived):
            self._on_frame(event, now_ms)
        elif isinstance(event, MessageReceived):
            self.receive(event.peer, event.message, now_ms, trusted=True)
        elif isinstance(event, TimerFired):
            self._on_timer(now_ms)
        elif isinstance(event, PeerDiscovered):
            self._on_discovered(event, now_ms)
        elif isinstance(event, PeerVanished):
            self.peers.pop(event.node_id, None)
        elif isinstance(event, ProposalRequested):
            self._propose(event.command, now_ms)
        elif isinstance(event, ReadRequested):
            if self.raft is None:
                self.ready.reads.append((event.ctx, False))
            else:
                self.raft.read(event.ctx, now_ms)
        elif isinstance(event, PortsObserved):
            self.ports = event.ports
        elif isinstance(event, AddressesChanged):
            self.addresses = tuple(event.addresses[:validate.ADDRESSES_MAX])
        elif isinstance(event, ProbesMeasured):
            self.probes = event.probes
        elif isinstance(event, ModelMeasured):
            self.measure, self._failure_committed = event.measure, False
        elif isinstance(event, StageFilesFetched):
            self.fetched = {e for e in self.fetched if e >= event.epoch - 2} | {event.epoch}
        elif isinstance(event, WorkerLoaded):
            self.loaded = {e for e in self.loaded if e >= event.epoch - 2} | {event.epoch}
        elif isinstance(event, GenerateRequested):
            self.router.requested(event.req, event.params, now_ms)
        elif isinstance(event, WorkerOutput):
            self.router.worker_event(
                event.epoch, event.req, event.tokens, event.text, event.done, event.finish, event.prompt_tokens, event.attempt, now_ms,
                broken=event.broken,
            )
        elif isinstance(event, WorkerCrashed):
            self.crashed = {e for e in self.crashed if e >= event.epoch - 2} | {event.epoch}
            if event.fault is not None:
                self.faults = {e: f for e, f in self.faults.items() if e >= event.epoch - 2} | {event.epoch: event.fault}
        elif isinstance(event, LeaveRequested):
            if not self.leaving:
                self.leaving = True
                self.leave_deadline_ms = now_ms + self.settings.leave_timeout_ms
                if self._holds_layers():
                    self.leave_deadline_ms += self.settings.drain_timeout_ms
            self._drive_leave(now_ms)
        self._after(now_ms)
        router = self.router
        if router.origins or router.served or router.messages or router.submits or router.client:
            self._route(now_ms)  # (else nothing in flight and nothing to collect: a hot path)
        return self._take_ready()

    def _take_ready(self) -> Ready:
        ready, self.ready = self.ready, Ready()
        return ready

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
        elif isinstance(msg, (InferRequest, InferTokens)):
            self._on_infer(peer, msg, now_ms)

    def _on_infer(self, peer: NodeId, msg: InferRequest | InferTokens, now_ms: int) -> None:
        r = self.raft
        # Authenticated peers only reach us at all; also accept a Mac that joined so recently
        # that this node has not applied its membership yet (it knows it from discovery).
        if r is None or not (any(m.node_id == peer for m in r.state.members) or peer in self.peers):
            self.rejected_frames += 1
            return
        if isinstance(msg, InferRequest):
            self.router.on_request(peer, msg, r.state)
        else:
            self.router.on_tokens(msg, now_ms)

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
            if len(self.peers) >= self.settings.peers_known_max:
                return
            self.peers[event.node_id] = _PeerInfo(event.addresses)
            self._send_hello(event.node_id, now_ms)
        else:
            info.addresses = event.addresses

    def _hello(self, now_ms: int) -> Hello:
        r = self.raft
        members = len(r.state.members) if r is not None and self.mode is MEMBER else 0
        leader = r.leader.node_id if r is not None and r.leader is not None else None
        return Hello(self.node_id, self.inc, self.cluster, members, self._healthy(now_ms), leader, self.addresses, self.caps)

    def _send_hello(self, to: NodeId, now_ms: int) -> None:
        self.ready.messages.append((to, self._hello(now_ms)))

    def _on_hello(self, h: Hello, now_ms: int) -> None:
        info = self.peers.get(h.src)
        if info is None:
            if len(self.peers) >= self.settings.peers_known_max:
                return
            info = self.peers[h.src] = _PeerInfo(h.addresses)
        info.hello = h
        info.hello_ms = now_ms
        info.mate = None
        if h.cluster != self.cluster or h.cluster is None:
            # Answer someone outside our cluster at once (at most once per hello period):
            # it speeds up formation and lets a rejoining Mac hear about us.
            if now_ms - info.replied_ms >= self.settings.hello_ms:
                info.replied_ms = now_ms
                self._send_hello(h.src, now_ms)

    def _fresh_hellos(self, now_ms: int) -> list[Hello]:
        horizon = now_ms - self.settings.peer_silent_ms
        return [p.hello for p in self.peers.values() if p.hello is not None and p.hello_ms >= horizon]

    @staticmethod
    def _rank(members: int, cluster: ClusterId) -> tuple[int, str]:
        # Larger clusters win; between equals the lower id wins (negate by inverting chars).
        return (members, "".join(chr(0x10FFFF - ord(c)) for c in cluster))

    def _best_foreign_cluster(self, now_ms: int) -> Hello | None:
        best: Hello | None = None
        for h in self._fresh_hellos(now_ms):
            if h.cluster is None or not h.healthy or h.cluster == self.cluster or h.members == 0:
                continue
            if best is None or self._rank(h.members, h.cluster) > self._rank(best.members, best.cluster):  # type: ignore[arg-type]
                best = h
        return best

    def _formation_step(self, now_ms: int) -> None:
        """Decide, on the hello timer, whether to bootstrap, join, switch or go standalone."""
        if self.leaving:
            return
        best = self._best_foreign_cluster(now_ms)
        if self.mode is UNFORMED:
            if best is not None:
                self._join(best, now_ms)
            elif now_ms - self.started_ms >= self.settings.formation_wait_ms and self._lowest_unformed(now_ms):
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
            mine = self._rank(len(r.state.members), r.cluster)
            if self._rank(best.members, best.cluster) > mine or unhealthy_long:  # type: ignore[arg-type]
                self._join(best, now_ms)
                return
        if unhealthy_long:
            # Our own cluster is alive without us (we were removed, or cut off from the
            # leader for long): come back as a fresh incarnation.
            mates = [h for h in self._fresh_hellos(now_ms) if h.cluster == r.cluster and h.healthy and h.leader]
            if mates:
                self._join(mates[0], now_ms)
                return
        if unhealthy_long and r.config.voters != (self.me,):
            # The user's choice of model outlives the cluster it was made in: a Mac left
            # alone (the other of two died) keeps serving it, and the merge keeps it after.
            self._bootstrap(now_ms, reason="standalone", model=r.state.model)

    def _lowest_unformed(self, now_ms: int) -> bool:
        return all(h.src > self.node_id for h in self._fresh_hellos(now_ms) if h.cluster is None)

    def _bootstrap(self, now_ms: int, *, reason: str, model: ModelInfo | None = None) -> None:
        """Found a new one-member cluster (a first formation, or continuing standalone with
        the old cluster's model: nothing else carries over, placement is planned afresh)."""
        cluster = ClusterId(f"{self.rng.getrandbits(64):016x}")
        self._reset_identity()
        me = self.me
        base = Snapshot(0, 0, Config((), ()), empty_state(cluster))
        entries = [
            Entry(1, 1, AddLearner(self.node_id, self.inc, self.addresses, self.caps)),
            Entry(2, 1, Promote(self.node_id, self.inc)),
        ]
        if model is not None:
            entries.append(Entry(3, 1, SetModel(model)))
        log = RaftLog(base, entries)
        self.raft = self._new_raft(cluster, HardState(1, me), log, now_ms)
        self.raft.commit = len(entries)
        self.raft._apply_committed()
        self.mode = MEMBER
        self.joining = None
        self.unhealthy_since_ms = now_ms
        self._persist_switch(base)
        self.ready.events.append(ClusterEvent(f"cluster {reason}", cluster))
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
        self.ready.events.append(ClusterEvent("joining cluster", detail))
        self._send_join(target.src)

    def _send_join(self, to: NodeId) -> None:
        r = self.raft
        assert r is not None
        self.ready.messages.append((to, JoinRequest(self.node_id, self.inc, r.cluster, self.addresses, self.caps)))

    def _become_unformed(self, now_ms: int, reason: str) -> None:
        self._reset_identity()
        self.raft = None
        self.mode = UNFORMED
        self.joining = None
        self.started_ms = now_ms
        self.ready.events.append(ClusterEvent("unformed", reason))
        self._persist_hard()

    def _reset_identity(self) -> None:
        # A fresh log always comes with a fresh incarnation: nobody may mistake the new,
        # empty log for the old one (the node-id reuse hazard of etcd-io/raft).
        self.inc = self._new_inc()
        self.last_heard = {}
        self.fetched = set()  # epochs of the old log's placements, not the new one's
        # Raft messages of the abandoned log must not go out after the switch is persisted.
        self.ready.messages = [(dst, m) for dst, m in self.ready.messages if not hasattr(m, "hdr")]

    def _persist_switch(self, base: Snapshot) -> None:
        r = self.raft
        assert r is not None
        self.ready.snapshot = base
        self.ready.log_truncate_from = base.index + 1
        self.ready.log_entries = tuple(r.log.entries)
        r.out.log_dirty_from = None
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
        """Propose unless the same command is already in flight (not yet applied)."""
        r = self.raft
        assert r is not None
        key = (type(command).__name__, getattr(command, "node_id", ""))
        index = self._inflight.get(key)
        if index is not None and index > r.applied and r.log.last_index >= index:
            return True
        index = r.propose(command, now_ms)
        if index is None:
            return False
        self._inflight[key] = index
        return True

    def _leader_duties(self, now_ms: int) -> None:
        r = self.raft
        assert r is not None and r.role is LEADER
        self._negotiate_ring(now_ms)
        self._negotiate_placement(now_ms)
        if not r.config_change_allowed() or r.transfer_to is not None:
            self._detect(now_ms, config_ok=False)
            return
        # Promote one caught-up learner at a time.
        for peer in r.config.learners:
            pr = r.progress.get(peer)
            if pr is not None and pr.match >= r.commit - self.settings.promote_lag_entries and pr.match > 0:
                if self._propose_once(Promote(peer.node_id, peer.inc), now_ms):
                    return
        self._detect(now_ms, config_ok=True)

    def _detect(self, now_ms: int, *, config_ok: bool) -> None:
        r = self.raft
        assert r is not None
        members = r.state.members
        quiet = self._quiet_members
        if members is quiet[0] and self.last_heard is quiet[1] and self.leader_since_ms == quiet[2] and now_ms < quiet[3]:
            return  # (checked after every input of the leader; last_heard only grows in place)
        s = self.settings
        silent_max_ms = 0
        for member in members:
            if member.node_id == self.node_id:
                if not member.up and member.inc == self.inc:
                    self._propose_once(MarkUp(member.node_id, member.inc), now_ms)  # marked down by a predecessor
                continue
            heard = self.last_heard.get(member.node_id, self.leader_since_ms)
            silent_ms = now_ms - max(heard, self.leader_since_ms)
            silent_max_ms = max(silent_max_ms, silent_ms)
            if member.up and silent_ms >= s.down_after_ms:
                self._propose_once(MarkDown(member.node_id, member.inc), now_ms)
            elif not member.up and silent_ms < s.down_after_ms:
                self._propose_once(MarkUp(member.node_id, member.inc), now_ms)
            elif config_ok and not member.up and silent_ms >= s.remove_after_ms and self._removal_keeps_quorum(member.node_id):
                if self._propose_once(RemoveMember(member.node_id, member.inc, "unreachable"), now_ms):
                    config_ok = False
        if silent_max_ms < s.down_after_ms and all(m.up for m in members):
            # Every member up and none silent for down_after_ms: nothing to propose until the
            # most silent one gets there, unless the members or what was heard change.
            self._quiet_members = (members, self.last_heard, self.leader_since_ms, now_ms + s.down_after_ms - silent_max_ms)

    def _negotiate_ring(self, now_ms: int) -> None:
        """Propose a new ring epoch when members, cables or addresses changed (leader only)."""
        r = self.raft
        assert r is not None
        if r.transfer_to is not None or ((r.term, r.applied) == self._ring_checked_at and self._ring_solving is None):
            return
        index = self._inflight.get(("SetRing", ""))
        if index is not None and index > r.applied and r.log.last_index >= index:
            return  # one ring change at a time: the next is computed from its result
        self._ring_checked_at = (r.term, r.applied)
        inputs = (r.state.members, r.state.ring, r.state.ring_hops)
        if inputs == self._ring_settled:
            self._ring_solving = None
            return
        used = physical.plan_inputs(r.state)
        if self._ring_plan is None or self._ring_plan[0] != used:
            if self._ring_solving is None or self._ring_solving[0] != used:
                self._ring_solving = (used, physical.plan_ring_steps(r.state))  # the costly part: the solve
            try:
                next(self._ring_solving[1])
                return  # one slice per step: the next step goes on, heartbeats keep flowing
            except StopIteration as done:
                self._ring_plan, self._ring_solving = (used, done.value), None
        proposal = physical.negotiate(r.state, self._ring_plan[1])
        if proposal is None:
            self._ring_settled = inputs
        elif not self._propose_once(proposal, now_ms):
            self._ring_checked_at = (-1, -1)  # not accepted now (e.g. log full): retry

    def _negotiate_placement(self, now_ms: int) -> None:
        """Propose the next data-plane step (a new placement, or activating the pending
        one) when the committed state calls for it (leader only; core/dataplane.py)."""
        r = self.raft
        assert r is not None
        if r.transfer_to is not None or (r.term, r.applied) == self._placement_checked_at or self._ring_solving is not None:
            return  # (a ring being solved may change the placement: wait for it as for a SetRing)
        for key in (("SetPlacement", ""), ("ActivatePlacement", ""), ("SetRing", "")):
            index = self._inflight.get(key)
            if index is not None and index > r.applied and r.log.last_index >= index:
                return  # one data-plane step at a time, and after the ring settles
        self._placement_checked_at = (r.term, r.applied)
        proposal = dataplane.negotiate(r.state)
        if proposal is not None and not self._propose_once(proposal, now_ms):
            self._placement_checked_at = (-1, -1)

    def _publish_measure(self, now_ms: int) -> None:
        """Bring this member's committed measurement and worker readiness up to date (a
        member that follows a leader and is not leaving, with something to publish)."""
        r = self.raft
        assert r is not None
        mine = find_member(r.state, self.node_id)
        if mine is None or mine.inc != self.inc:
            return
        if isinstance(self.measure, MeasureFailed):
            if mine.measure == self.measure:
                self._failure_committed = True
            elif self._failure_committed:  # cluster.py forgot it: the model was set again
                self.measure, self._failure_committed = None, False
        if self.measure is not None and mine.measure != self.measure and now_ms - self._measure_sent_ms >= self.settings.hello_ms:
            self._measure_sent_ms = now_ms
            self._propose(PublishMeasure(self.node_id, self.inc, self.measure), now_ms)
        state = r.state
        epoch = state.placement_epoch
        staged = any(s.node_id == self.node_id for s in state.placement)
        if epoch in self.fetched and staged and self.node_id not in state.fetched:
            if now_ms - self._fetched_sent.get(epoch, -(10**9)) >= self.settings.hello_ms:
                self._fetched_sent = {epoch: now_ms}
                self._propose(StageFetched(self.node_id, self.inc, epoch), now_ms)
        if epoch in self.loaded and staged and self.node_id not in state.ready:
            if now_ms - self._ready_sent.get(epoch, -(10**9)) >= self.settings.hello_ms:
                self._ready_sent = {epoch: now_ms}
                self._propose(WorkerReady(self.node_id, self.inc, epoch), now_ms)
        for broken in sorted(self.crashed):
            if broken in (state.active_epoch, state.placement_epoch) and state.failed_epoch < broken:
                if now_ms - self._failed_sent.get(broken, -(10**9)) >= self.settings.hello_ms:
                    self._failed_sent = {broken: now_ms}
                    self._propose(WorkerFailed(self.node_id, self.inc, broken, self.faults.get(broken)), now_ms)

    def _route(self, now_ms: int) -> None:
        """Move inference requests along (core/serving.py) and collect their effects."""
        r = self.raft
        state = r.state if r is not None and self.mode is MEMBER else None
        head = dataplane.head(state) if state is not None else None
        epoch = state.active_epoch if state is not None else 0
        self.router.tick(state, head, epoch, now_ms)
        for _ in range(8):  # requests a node sends itself (it is origin and head) loop back here
            messages, submits, client = self.router.take()
            self.ready.submits.extend(submits)
            self.ready.client.extend(client)
            local = [(dst, m) for dst, m in messages if dst == self.node_id]
            self.ready.messages.extend((dst, m) for dst, m in messages if dst != self.node_id)
            if not local:
                break
            for _, m in local:
                if isinstance(m, InferRequest):
                    self.router.on_request(self.node_id, m, state)
                elif isinstance(m, InferTokens):
                    self.router.on_tokens(m, now_ms)
            self.router.tick(state, head, epoch, now_ms)

    def _publish_ports(self, now_ms: int) -> None:
        """Bring this member's committed addresses, ports and probe results up to date (any
        role). Peers dial the committed addresses, and LAN hops of the MLX hostfile use them:
        a Mac that moved to another address must not be left behind at the old one. (Called
        for a member that follows a leader and is not leaving.)"""
        r = self.raft
        assert r is not None
        facts = (r.state, self.inc, self.addresses, self.caps, self.ports, self.probes)
        if all(map(operator.is_, facts, self._ports_current)):
            return  # the very objects found up to date last time (this runs after every input)
        mine = find_member(r.state, self.node_id)
        if mine is None or mine.inc != self.inc:
            return
        # Capabilities too: an agent restarted with another --data-port keeps its
        # incarnation, and its ranks must be rendered at the new port.
        changed = (self.addresses and mine.addresses != self.addresses) or mine.caps != self.caps
        if changed and now_ms - self._addresses_sent_ms >= self.settings.hello_ms:
            self._addresses_sent_ms = now_ms
            self._propose(UpdateMember(self.node_id, self.inc, self.addresses or mine.addresses, self.caps), now_ms)
        if mine.ports == self.ports and mine.probes == self.probes:
            if not changed:
                self._ports_current = facts
            return
        if now_ms - self._ports_sent_ms < self.settings.hello_ms:
            return  # at most one update in flight per hello period
        self._ports_sent_ms = now_ms
        self._propose(PublishPorts(self.node_id, self.inc, self.ports, self.probes), now_ms)

    def _removal_keeps_quorum(self, node_id: NodeId) -> bool:
        r = self.raft
        assert r is not None
        voters = [p for p in r.config.voters if p.node_id != node_id]
        if len(voters) == len(r.config.voters):
            return True  # a learner: always safe to remove
        up = {m.node_id for m in r.state.members if m.up}
        up.add(self.node_id)
        live = sum(1 for p in voters if p.node_id in up)
        return len(voters) >= 1 and live >= len(voters) // 2 + 1

    # ------------------------------------------------------------------------------
    # Proposals and leaving

    def _propose(self, command: Command, now_ms: int) -> None:
        r = self.raft
        if r is None or validate.command_problem(command) is not None:
            return
        if r.role is LEADER:
            r.propose(command, now_ms)
        elif r.leader is not None:
            self.ready.messages.append((r.leader.node_id, ForwardProposal(r._hdr(r.leader), command)))

    def _drive_leave(self, now_ms: int) -> None:
        r = self.raft
        if r is None or self.mode is not MEMBER:
            self._finish_leave()
            return
        if now_ms >= self.leave_deadline_ms:
            # No leader acknowledged in time: stop anyway; the cluster will mark us down
            # and remove us after remove_after_ms, exactly as for a crash.
            self.ready.events.append(ClusterEvent("leave not confirmed", "stopping anyway"))
            self._finish_leave()
            return
        still_member = any(p.node_id == self.node_id for p in (*r.config.voters, *r.config.learners))
        if not still_member and self.joining is not None:
            # Still joining: the leader may already have added us without our knowing yet.
            # Leaving silently would leave a member behind that is down until removed minutes
            # later; wait for the log (or the deadline) and then leave properly.
            return
        if not still_member:
            # Our removal is in our log, but a config entry takes effect when appended, so it
            # may not be committed yet: stopping now could leave a departed voter in the
            # configuration. The leader's RemovalNotice (sent when the removal commits) or
            # applying the removal ourselves ends the leave; the deadline bounds the wait.
            # (A leader outside its own configuration was the last voter: nobody confirms.)
            if r.role is not LEADER and any(m.node_id == self.node_id and m.inc == self.inc for m in r.state.members):
                return
            self._finish_leave(confirmed=r.role is not LEADER)
            return
        if len(r.config.voters) <= 1 and not r.config.learners:
            self._finish_leave()
            return
        if self._holds_layers() and now_ms < self.leave_deadline_ms - self.settings.leave_timeout_ms:
            # Drain first: the cluster plans the model without us and switches to that
            # epoch while we still serve; only then do we leave (make before break).
            if self.node_id not in r.state.draining:
                self._propose(Drain(self.node_id, self.inc), now_ms)
            return
        if r.role is LEADER:
            others = [p for p in r.config.voters if p != self.me]
            if others and r.transfer_to is None:
                best = max(others, key=lambda p: (r.progress[p].match if p in r.progress else -1, p.node_id))
                r.transfer_leadership(best, now_ms)
            elif not others:
                r.propose(RemoveMember(self.node_id, self.inc, "left"), now_ms)
        elif r.leader is not None:
            cmd = RemoveMember(self.node_id, self.inc, "left")
            self.ready.messages.append((r.leader.node_id, ForwardProposal(r._hdr(r.leader), cmd)))

    def _holds_layers(self) -> bool:
        """Whether the serving or the pending placement gives this node model layers."""
        r = self.raft
        if r is None or self.mode is not MEMBER:
            return False
        return any(s.node_id == self.node_id for s in (*r.state.active, *r.state.placement))

    def _finish_leave(self, *, confirmed: bool = False) -> None:
        self.leave_confirmed = confirmed
        self.mode = LEFT
        self.ready.left = True
        self.ready.events.append(ClusterEvent("left cluster", self.cluster or "-"))

    # ------------------------------------------------------------------------------
    # Timers and bookkeeping after every input

    def _on_timer(self, now_ms: int) -> None:
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
                self.leader_since_ms = now_ms
                self._inflight = {}
                self._ring_checked_at = (-1, -1)
            self._leader_duties(now_ms)
        if self.mode is MEMBER and not self.leaving and r.leader is not None:
            self._publish_ports(now_ms)
            if self.measure is not None or self.fetched or self.loaded or self.crashed:
                self._publish_measure(now_ms)  # (else nothing measured or reported by workers: a hot path)
        if self._healthy(now_ms):
            self.unhealthy_since_ms = None
        elif self.unhealthy_since_ms is None:
            self.unhealthy_since_ms = now_ms
        applied: list[Entry] = []
        if not r.out.is_empty():  # (half of all inputs leave Raft nothing to report)
            out = r.take_output()
            self._merge_output(out, now_ms)
            applied = out.applied
        leader = r.leader.node_id if r.leader else None
        if leader != self._last_leader:
            self._last_leader = leader
            if leader is not None:
                self.ready.events.append(ClusterEvent("leader elected", f"{leader} term {r.term}"))
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
                ready.events.append(ClusterEvent(_EVENT_NAMES[type(cmd)], cmd.node_id))
