"""The vocabulary: every value that crosses the wire or lands in the replicated log.

Wire messages are nouns (VoteRequest, AppendEntries, Hello). Log commands are imperatives
applied to the cluster state (AddLearner, Promote, MarkDown). All are frozen, slotted
dataclasses registered with a small integer tag in wire.py's codec; field types are the
schema the decoder enforces, so a message that decodes is well-formed by construction.

Raft messages carry a header naming the cluster and both ends *with their incarnation*:
an incarnation is a random 63-bit number a node draws whenever it starts a fresh log, so a
Mac that wiped its state (or left and came back) is never mistaken for its old self.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.split_shape import SplitShape
from p2pmesh.core.wire import register

# --------------------------------------------------------------------------------------
# Values inside commands and snapshots


@register(1)
@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a Mac offers: memory for model layers and what chip it is, and the first port
    of its data-plane workers (its --data-port): every member renders each rank's listen
    port from that rank's own data port, so Macs may differ (core/mlx_hostfile.py)."""

    memory_bytes: int
    chip: str
    data_port: int = 0
    """0: not advertised (an agent from before the field); readers use their own port."""


@register(5)
@dataclass(frozen=True, slots=True)
class PortInfo:
    """One network port of a Mac as its agent last saw it (published into the cluster
    state so the leader can pair the two ends of every cable; see core/physical.py)."""

    interface: str
    """The OS interface name: "en2" on macOS, "thunderbolt0" or a bench veth on Linux."""
    kind: str
    """thunderbolt, ethernet or wifi."""
    domain_uuid: str | None
    """This Mac's Thunderbolt domain UUID on that port's bus (None for other kinds)."""
    peer_domain_uuid: str | None
    """The directly cabled Mac's domain UUID (None when nothing, or a dock, is cabled)."""
    up: bool
    """Carrier present."""
    gbps: float | None
    """Nominal link speed."""
    ipv4: tuple[str, ...]
    """IPv4 interface addresses with prefix, "169.254.10.1/30"."""
    rdma: bool
    """An RDMA device (rdma_enX) exists for this port (JACCL usable)."""


@register(6)
@dataclass(frozen=True, slots=True)
class LinkProbe:
    """What a bounded active probe measured over one of this node's ports to a peer, or
    (``interface`` PATH_INTERFACE) over the path to a peer it has no known cable with."""

    interface: str
    peer: NodeId
    rtt_ms: float
    gbps: float
    echo_rtt_ms: float = 0.0
    """The round trip of an activation-sized message (drivers/probe.py's echo phase), what
    a pipeline hop or an all-reduce step pays; 0.0 when the peer's agent does not echo."""


PATH_INTERFACE = ""
"""LinkProbe.interface of a probe over the path the agents already reach each other by (the
peer's transport address): what a "network" hop of the ring travels (core/physical.py)."""


@register(7)
@dataclass(frozen=True, slots=True)
class RingHop:
    """One hop of the committed ring: from ``src`` to the next node ``dst``, over which
    link, with the IPv4 addresses each end has on it (None when it has none yet; see
    `p2pmesh links plan`)."""

    src: NodeId
    dst: NodeId
    kind: str
    gbps: float
    rtt_ms: float | None
    """Measured round trip, when a probe has measured this link."""
    src_interface: str | None
    dst_interface: str | None
    src_ipv4: str | None
    dst_ipv4: str | None
    rdma: bool
    """Both ends have an RDMA device on this link."""


@register(8)
@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model the cluster serves, as the placement planner needs it (core/model_spec.py
    computes these from config.json and the safetensors headers)."""

    name: str
    """A local path (the same on every Mac) or a Hugging Face id."""
    layers: int
    layer_bytes: int
    kv_bytes_per_token_per_layer: int
    context_tokens: int
    activation_bytes: int
    embed_bytes: int
    batch: int = 1
    """Requests the cluster should serve at once: the placement reserves KV cache for this
    many contexts where memory allows, fewer where it does not (1 in records older than it)."""
    # The shape tensor parallelism splits, and below what a token reads of a layer: the
    # fields of core/split_shape.SplitShape (``split``), flat and in the order they came so
    # that older records decode (0 = unknown: then only one Mac or a pipeline is planned).
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    parallelism: str = "auto"
    """What the user asked for (core/placement.PARALLELISM_CHOICES): "auto", "pipeline",
    "tensor" or "hybrid"; the committed placement says what the planner chose."""
    kv_bits: int = 0
    """The KV cache quantized to this many bits (core/protocol.KV_BITS_CHOICES); 0: full
    precision (core/kv_quant.py counts it)."""
    active_layer_bytes: int = 0
    attention_bytes: int = 0
    even_split: bool = False

    @property
    def split(self) -> SplitShape:
        """What a tensor group splits and a token reads (core/split_shape.py)."""
        return SplitShape(self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                          self.intermediate_size, self.active_layer_bytes, self.attention_bytes, self.even_split)


@register(9)
@dataclass(frozen=True, slots=True)
class Measure:
    """What a member measured for a model: usable memory and one decoder layer's time, with
    the part of it that a tensor rank pays whatever its share (worker/measure.py; 0 when the
    layer could not be cut, and in measurements written before it was measured)."""

    model: str
    memory_bytes: int
    layer_ms: float
    layer_fixed_ms: float = 0.0


@register(42)
@dataclass(frozen=True, slots=True)
class MeasureFailed:
    """A member cannot load the model at all (a family its workers do not run, a broken
    checkpoint): the measuring worker's own error, so the cluster can say why instead of
    waiting for a measurement that never comes (core/fit.py)."""

    model: str
    error: str


@register(24)
@dataclass(frozen=True, slots=True)
class Stage:
    """One rank of a placement: a member and its contiguous layers [start, end). In a
    pipeline every rank is a stage of its own. Consecutive ranks with the same [start, end)
    form a tensor group (a pipeline never has two such stages), each rank running its share
    of every layer of the range (core/dataplane.groups)."""

    node_id: NodeId
    start: int
    end: int
    # A tensor rank's share of every layer (core/placement.Share); 0 = the whole layer (a
    # pipeline stage, and records older than these fields).
    heads: int = 0
    kv_heads: int = 0
    columns: int = 0


@register(2)
@dataclass(frozen=True, slots=True)
class Member:
    """One member of the replicated cluster state."""

    node_id: NodeId
    inc: int
    voter: bool
    up: bool
    addresses: tuple[str, ...]
    caps: Capabilities
    ports: tuple[PortInfo, ...] = ()
    probes: tuple[LinkProbe, ...] = ()
    measure: Measure | MeasureFailed | None = None


@register(3)
@dataclass(frozen=True, slots=True)
class Peer:
    """A Raft participant: a node id at one incarnation."""

    node_id: NodeId
    inc: int


@register(4)
@dataclass(frozen=True, slots=True)
class Config:
    """A Raft configuration: voters decide, learners only follow."""

    voters: tuple[Peer, ...]
    learners: tuple[Peer, ...]


# --------------------------------------------------------------------------------------
# Log commands (applied to ClusterState by cluster.py)


@register(10)
@dataclass(frozen=True, slots=True)
class Noop:
    """Appended by every new leader; it must commit before any config change (Ongaro's fix)."""


@register(11)
@dataclass(frozen=True, slots=True)
class AddLearner:
    node_id: NodeId
    inc: int
    addresses: tuple[str, ...]
    caps: Capabilities


@register(12)
@dataclass(frozen=True, slots=True)
class Promote:
    node_id: NodeId
    inc: int


@register(13)
@dataclass(frozen=True, slots=True)
class RemoveMember:
    node_id: NodeId
    inc: int
    reason: str


@register(14)
@dataclass(frozen=True, slots=True)
class MarkDown:
    node_id: NodeId
    inc: int


@register(15)
@dataclass(frozen=True, slots=True)
class MarkUp:
    node_id: NodeId
    inc: int


@register(16)
@dataclass(frozen=True, slots=True)
class UpdateMember:
    node_id: NodeId
    inc: int
    addresses: tuple[str, ...]
    caps: Capabilities


@register(17)
@dataclass(frozen=True, slots=True)
class SetRing:
    """The ring the data plane uses, with its epoch (proposed by the leader, core/physical.py)."""

    epoch: int
    order: tuple[NodeId, ...]
    hops: tuple[RingHop, ...] = ()


@register(18)
@dataclass(frozen=True, slots=True)
class Put:
    """A user key/value write (client API and tests of linearizability)."""

    key: str
    value: str


@register(19)
@dataclass(frozen=True, slots=True)
class PublishPorts:
    """A member's current ports and latest probe results (sent when they change)."""

    node_id: NodeId
    inc: int
    ports: tuple[PortInfo, ...]
    probes: tuple[LinkProbe, ...]


@register(25)
@dataclass(frozen=True, slots=True)
class SetModel:
    """Serve this model (None: serve nothing). Proposed through any member's API."""

    model: ModelInfo | None


@register(26)
@dataclass(frozen=True, slots=True)
class PublishMeasure:
    node_id: NodeId
    inc: int
    measure: Measure | MeasureFailed


@register(27)
@dataclass(frozen=True, slots=True)
class SetPlacement:
    """A new data-plane epoch: these stages, in pipeline (rank) order. It starts *pending*:
    its workers load while the active epoch keeps serving (make before break)."""

    epoch: int
    model: str
    stages: tuple[Stage, ...]
    ring_epoch: int
    hops: tuple[RingHop, ...]
    """Stage i to stage i+1 (the last back to the first), with the addresses every worker
    of the epoch renders its MLX hostfile from: fixed here so all render the same one."""
    restart: bool = False
    """The same stages again, because a worker of the previous epoch failed."""
    batch: int = 1
    """Requests its head serves at once: the most, up to the model's ``batch``, whose KV
    cache fits beside the layers (core/dataplane.py)."""
    kv_bits: int = 0
    """Its workers' KV cache bits (the model's kv_bits when proposed; 0: full precision)."""


@register(28)
@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A member's worker for a pending epoch has loaded its layers and joined its group."""

    node_id: NodeId
    inc: int
    epoch: int


@register(29)
@dataclass(frozen=True, slots=True)
class ActivatePlacement:
    """Switch serving to the pending epoch (every stage of it is ready)."""

    epoch: int


@register(40)
@dataclass(frozen=True, slots=True)
class Drain:
    """A member is leaving: plan the model without it, then let it go (make before break)."""

    node_id: NodeId
    inc: int


@register(43)
@dataclass(frozen=True, slots=True)
class WorkerFault:
    """Why a worker could not form its epoch's group, when it could tell (status shows it):
    ``code`` is machine-readable (worker/ring_check.py RING_FAULTS), ``node_id`` the member
    at fault (the ring peer it could not reach, or the reporter itself when its own port
    is taken), ``address``:``port`` where."""

    code: str
    node_id: NodeId
    address: str
    port: int
    reporter: NodeId
    epoch: int
    message: str


@register(23)
@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A member's worker for ``epoch`` died or hung: that epoch's group is broken."""

    node_id: NodeId
    inc: int
    epoch: int
    fault: WorkerFault | None = None
    """Why, when the worker said (a ring peer it could not reach, its port taken)."""


@register(41)
@dataclass(frozen=True, slots=True)
class StageFetched:
    """A member of the pending placement has its stage's model files on its disk. Workers
    start (and their MLX group forms) only once every stage's member has said so: a Mac
    still downloading would make the others' ring connect give up."""

    node_id: NodeId
    inc: int
    epoch: int


Command = (
    Noop | AddLearner | Promote | RemoveMember | MarkDown | MarkUp | UpdateMember | SetRing | Put | PublishPorts
    | SetModel | PublishMeasure | SetPlacement | WorkerReady | ActivatePlacement | WorkerFailed | Drain | StageFetched
)
CONFIG_COMMANDS = (AddLearner, Promote, RemoveMember)


@register(20)
@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    term: int
    command: Command


@register(21)
@dataclass(frozen=True, slots=True)
class ClusterState:
    """The replicated state every member applies from the log."""

    cluster_id: ClusterId
    members: tuple[Member, ...]
    ring_epoch: int
    ring: tuple[NodeId, ...]
    kv: tuple[tuple[str, str], ...]
    ring_hops: tuple[RingHop, ...] = ()
    model: ModelInfo | None = None
    placement_epoch: int = 0
    """The newest placement proposed (pending while > active_epoch)."""
    placement: tuple[Stage, ...] = ()
    placement_ring_epoch: int = 0
    placement_hops: tuple[RingHop, ...] = ()
    ready: tuple[NodeId, ...] = ()
    """Members whose worker for placement_epoch is ready."""
    active_epoch: int = 0
    active: tuple[Stage, ...] = ()
    """The stages serving now (empty: not serving)."""
    active_hops: tuple[RingHop, ...] = ()
    failed_epoch: int = 0
    """The newest data-plane epoch a member reported broken (WorkerFailed)."""
    restarts: int = 0
    """Consecutive restarts of the same stages (bounded: core/dataplane.py)."""
    draining: tuple[NodeId, ...] = ()
    """Members leaving gracefully: no new placement gives them layers."""
    fetched: tuple[NodeId, ...] = ()
    """Members whose files for placement_epoch's stage are on their disk (StageFetched)."""
    fault: WorkerFault | None = None
    """Why the newest failed epoch's group could not form (until an epoch serves again)."""
    placement_batch: int = 1
    """The pending (newest) placement's batch (SetPlacement.batch)."""
    active_batch: int = 1
    """The serving epoch's batch."""
    placement_kv_bits: int = 0
    """The pending (newest) placement's KV cache bits (SetPlacement.kv_bits)."""
    active_kv_bits: int = 0
    """The serving epoch's KV cache bits."""


@register(22)
@dataclass(frozen=True, slots=True)
class Snapshot:
    index: int
    term: int
    config: Config
    state: ClusterState


# --------------------------------------------------------------------------------------
# Raft messages


@register(30)
@dataclass(frozen=True, slots=True)
class Header:
    cluster: ClusterId
    src: NodeId
    src_inc: int
    dst: NodeId
    dst_inc: int
    term: int


@register(31)
@dataclass(frozen=True, slots=True)
class VoteRequest:
    hdr: Header
    prevote: bool
    last_index: int
    last_term: int
    transfer: bool


@register(32)
@dataclass(frozen=True, slots=True)
class VoteResponse:
    hdr: Header
    prevote: bool
    granted: bool


@register(33)
@dataclass(frozen=True, slots=True)
class AppendEntries:
    hdr: Header
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]
    commit: int
    ctx: int


@register(34)
@dataclass(frozen=True, slots=True)
class AppendResponse:
    hdr: Header
    success: bool
    index: int
    """On success the follower's match index; on rejection a hint where to probe next."""
    ctx: int


@register(35)
@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    hdr: Header
    snapshot: Snapshot


@register(36)
@dataclass(frozen=True, slots=True)
class TimeoutNow:
    hdr: Header


@register(37)
@dataclass(frozen=True, slots=True)
class ReadIndexRequest:
    hdr: Header
    ctx: int


@register(38)
@dataclass(frozen=True, slots=True)
class ReadIndexResponse:
    hdr: Header
    ctx: int
    index: int
    ok: bool


@register(39)
@dataclass(frozen=True, slots=True)
class ForwardProposal:
    hdr: Header
    command: Command


RaftMessage = (
    VoteRequest
    | VoteResponse
    | AppendEntries
    | AppendResponse
    | InstallSnapshot
    | TimeoutNow
    | ReadIndexRequest
    | ReadIndexResponse
    | ForwardProposal
)

# --------------------------------------------------------------------------------------
# Formation and discovery messages (no term: they are about which cluster to be in)


@register(50)
@dataclass(frozen=True, slots=True)
class Hello:
    """Sent to every discovered peer: who I am and which cluster I am in."""

    src: NodeId
    inc: int
    cluster: ClusterId | None
    """None while the node has not formed or joined a cluster."""
    members: int
    healthy: bool
    """True when the sender hears from a leader that holds a quorum."""
    leader: NodeId | None
    addresses: tuple[str, ...]
    caps: Capabilities


@register(51)
@dataclass(frozen=True, slots=True)
class JoinRequest:
    src: NodeId
    inc: int
    cluster: ClusterId
    addresses: tuple[str, ...]
    caps: Capabilities


@register(52)
@dataclass(frozen=True, slots=True)
class JoinReply:
    src: NodeId
    cluster: ClusterId
    accepted: bool
    leader: NodeId | None


@register(53)
@dataclass(frozen=True, slots=True)
class RemovalNotice:
    """Sent by a leader to a member whose removal committed: once removed, the member no
    longer receives the log, so it could not learn this any other way."""

    src: NodeId
    cluster: ClusterId
    node_id: NodeId
    inc: int


# --------------------------------------------------------------------------------------
# Inference requests between agents (not in the log: a request lives as long as its client)


@register(54)
@dataclass(frozen=True, slots=True)
class InferRequest:
    """Run a generation on the receiver's head worker for data-plane ``epoch``. A resumed
    request carries the prompt tokens plus every token already generated."""

    src: NodeId
    req: str
    epoch: int
    prompt: str | None
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    attempt: int = 0
    """Counts the origin's sends of this request: a head keeps only the newest attempt, and
    replies name it, so nothing of an abandoned attempt is mixed into the stream."""


@register(55)
@dataclass(frozen=True, slots=True)
class InferTokens:
    """Tokens of a request, streamed from the head's agent back to the request's origin."""

    src: NodeId
    req: str
    epoch: int
    tokens: tuple[int, ...]
    text: str
    done: bool
    finish: str
    """stop, length, or error (then ``text`` says why)."""
    prompt_tokens: tuple[int, ...]
    """The prompt as the head tokenized it (first reply only), so a resume needs no tokenizer."""
    attempt: int = 0
    seq: int = 0
    """How many tokens of this attempt came before these: a gap (a frame the transport
    dropped) is detected, and the origin sends the request again."""
    code: str = ""
    """With finish "error": why, as a core/protocol.ErrorCode ("stale_epoch": the origin
    sends the request again; any other: the request's end, passed to its client)."""


@register(56)
@dataclass(frozen=True, slots=True)
class InferCancel:
    """The origin's client of a request hung up: the head stops the attempt and frees its
    worker's slot (a lost one costs only the tokens the worker goes on making: the head's
    replies to a request its origin forgot are dropped there)."""

    src: NodeId
    req: str
    epoch: int
    attempt: int


@register(57)
@dataclass(frozen=True, slots=True)
class LoadReport:
    """The serving head's batch, sent to every member when it changes (at most twice a
    second: its worker's heartbeat), so any Mac's status shows the cluster's load."""

    src: NodeId
    epoch: int
    running: int
    queued: int
    tokens_per_s: float


@register(58)
@dataclass(frozen=True, slots=True)
class FetchReport:
    """A Mac's copy or download of its stage's files, sent to every member at most twice a
    second while it lasts (core/transfers.py), so any Mac's status shows every Mac's."""

    src: NodeId
    source: str
    """"peer" (copied from other Macs) or "hub" (downloaded from Hugging Face)."""
    bytes_done: int
    bytes_total: int
    mb_s: float
    """Over the last few seconds (core/transfers.RATE_WINDOW_MS)."""
    eta_s: float | None
    """Seconds left at that rate; None while the rate is not known yet (or is zero)."""
    hub_files: tuple[str, ...] = ()
    """The files ("model: file") this Mac is downloading from Hugging Face right now: a Mac
    about to download one of them waits for this one instead (agent/tasks/hub_share.py)."""


Message = (RaftMessage | Hello | JoinRequest | JoinReply | RemovalNotice | InferRequest | InferTokens | InferCancel
           | LoadReport | FetchReport)
MESSAGE_TYPES: tuple[type, ...] = typing.get_args(Message)
"""Every type that may arrive as a frame on its own (for isinstance checks)."""
