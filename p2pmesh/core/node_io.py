"""What goes into the node machine and what comes out of it (core/machine.py).

Inputs are past-tense facts, each handled with the time it happened; a driver (the agent,
the simulator) builds them from frames, timers, discovery, its own tasks and its workers.
The output of every input is one ``Ready``: consensus output only, with the order in which a
driver must carry it out (durable part first, then messages). Once the durable part is on
disk the driver advances the Ready (core/outbox.py) and gets its ``Effects``: what may be
observed only then (log lines, requests for the head worker, tokens for local clients).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import (
    Command,
    Entry,
    LinkProbe,
    Measure,
    MeasureFailed,
    Message,
    Peer,
    PortInfo,
    Snapshot,
    WorkerFault,
)
from p2pmesh.core.serving import ClientEvent, GenerateParams, WorkerSubmit


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
    """A frame arrived over a connection authenticated as ``peer``; ``data`` is still
    encoded: the core decodes it (core/wire.py) and counts a malformed one as rejected."""

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
    """Discovery found a peer, or new addresses of one: an unknown peer is greeted (Hello),
    a known one's addresses are replaced."""

    node_id: NodeId
    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PeerVanished:
    node_id: NodeId


@dataclass(frozen=True, slots=True)
class TimerFired:
    """The machine's next deadline (``next_deadline_ms``) passed, or the driver wants it to
    look at the time now: elections, heartbeats, hellos and retries are all due from here."""


@dataclass(frozen=True, slots=True)
class ProposalRequested:
    command: Command


@dataclass(frozen=True, slots=True)
class ReadRequested:
    """A linearizable read (Raft's ReadIndex): its answer comes back in a Ready's ``reads``
    as (``ctx``, whether it may be served), after what this node applied."""

    ctx: int


@dataclass(frozen=True, slots=True)
class LeaveRequested:
    """The user asked this node to leave its cluster: a node holding model layers first
    waits for a placement without it (make before break), then leaves."""


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
    """Fresh results of the bounded link probes: to cabled peers over their cables, to the
    others over the path to their transport address (LinkProbe.interface PATH_INTERFACE)."""

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
    """The model files of this node's stage in data-plane ``epoch`` are on its disk (the
    agent's fetch, core/stage_fetch.py): published, so the leader sees the stage can load."""

    epoch: int


@dataclass(frozen=True, slots=True)
class GenerateRequested:
    """A local client asked for a generation (``req`` is unique on this node)."""

    req: str
    params: GenerateParams
    """Already checked against core/protocol.py's limits by the agent (at the edge, once),
    so the core takes them as they are."""


@dataclass(frozen=True, slots=True)
class GenerateCancelled:
    """The local client of a request went away before its end (it hung up): stop it."""

    req: str


@dataclass(frozen=True, slots=True)
class WorkerOutput:
    """The local head worker of ``epoch`` streamed tokens (or finished) for a request."""

    epoch: int
    req: str
    tokens: tuple[int, ...]
    """The tokens generated since its last output: one per output while it streams, none
    with the end (``done``)."""
    text: str
    done: bool
    finish: str
    """"" while it streams; with the end: stop, length or error (then ``text`` says why and
    ``code`` names it)."""
    prompt_tokens: tuple[int, ...]
    """The prompt as the worker tokenized it (with its first output only, else empty):
    passed on to the origin, so that a resume needs no tokenizer."""
    attempt: int = 0
    """The attempt the worker serves (the "@N" of its request id): the router drops the
    output of any attempt but the one it serves now."""
    broken: bool = False
    """The worker's pipeline failed under the request (a peer lost): the epoch's fault, not the
    request's, so it resumes on the next epoch. Only an error the worker blames on the request
    itself (a bad prompt, too long) ends it."""
    code: str = ""
    """With finish "error": the core/protocol.ErrorCode the request's client gets."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The local head worker of ``epoch`` reported its batch (its heartbeat): requests
    ``running`` in it, ``queued`` for a place, and ``tokens`` generated since it started."""

    epoch: int
    running: int
    queued: int
    tokens: int


@dataclass(frozen=True, slots=True)
class FetchProgressed:
    """This node's fetch task: ``bytes_done`` of the ``bytes_total`` its stage's missing files
    hold have arrived, copied from other Macs (``source`` "peer") or downloaded from Hugging
    Face ("hub"); reported at most twice a second while it lasts, and once at its end."""

    source: str
    bytes_done: int
    bytes_total: int
    hub_files: tuple[str, ...] = ()
    """The files ("model: file") being downloaded from Hugging Face now (FetchReport.hub_files)."""


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
    | GenerateCancelled
    | WorkerOutput
    | WorkerLoad
    | WorkerCrashed
    | FetchProgressed
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
    """One batch of consensus output. Contract for drivers: first make the durable part
    durable (``hard``; then ``snapshot``, which drops stored entries at or below its index;
    then the log suffix: drop stored entries at ``log_truncate_from`` and after, append
    ``log_entries``, which start at ``max(log_truncate_from, snapshot.index + 1)`` and are
    contiguous), then send ``messages``, then advance it (``Machine.advance``), which returns
    its Effects; act on ``applied``, ``reads`` and ``left`` from then on. Readies are handled
    strictly in order."""

    hard: NodeHardState | None = None
    snapshot: Snapshot | None = None
    log_truncate_from: int | None = None
    log_entries: tuple[Entry, ...] = ()
    messages: list[tuple[NodeId, Message]] = field(default_factory=list)
    applied: list[Entry] = field(default_factory=list)
    reads: list[tuple[int, bool]] = field(default_factory=list)
    left: bool = False

    def durable_part(self) -> bool:
        """Whether there is anything to write (hard state, snapshot or log)."""
        return self.hard is not None or self.snapshot is not None or self.log_truncate_from is not None

    def empty(self) -> bool:
        """Nothing to write, send or act on."""
        return not (self.hard is not None or self.snapshot is not None or self.log_truncate_from is not None
                    or self.messages or self.applied or self.reads or self.left)


@dataclass(frozen=True, slots=True)
class Effects:
    """What one Ready lets the driver show or act on once it is durable (``advance``): a
    request the head worker serves, a token a client reads, a line in the log must never
    stand on a decision a crash could take back."""

    events: tuple[ClusterEvent, ...] = ()
    submits: tuple[WorkerSubmit, ...] = ()
    """Requests for the local head worker."""
    client: tuple[ClientEvent, ...] = ()
    """Tokens and ends of requests local clients asked for."""


NO_EFFECTS = Effects()


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
    durable_index: int = 0
    """The last index of this log that the driver has made durable (``advance``)."""


