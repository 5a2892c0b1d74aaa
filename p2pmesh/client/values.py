"""The typed values a client returns (frozen dataclasses), and the parsing of the agent's
status JSON into them. A shape this client does not understand is the agent's (or a version
mismatch's) problem, reported as AgentError, never a KeyError.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from p2pmesh.core.fit import PlacementProblem
from p2pmesh.core.protocol import AgentError


@dataclass(frozen=True)
class Port:
    """A network port a member published (a Thunderbolt cable end, an Ethernet port, ...)."""

    interface: str
    kind: str
    up: bool
    gbps: float
    ipv4: tuple[str, ...] = ()
    rdma: bool = False
    domain_uuid: str | None = None
    peer_domain_uuid: str | None = None


@dataclass(frozen=True)
class Member:
    node_id: str
    voter: bool
    """False for a learner (a joining Mac still catching up)."""
    up: bool
    """False while the leader has not heard from it for a second (marked down)."""
    addresses: tuple[str, ...] = ()
    ports: tuple[Port, ...] = ()


@dataclass(frozen=True)
class Hop:
    """One cable of the committed ring, from `src` to the next node `dst`."""

    src: str
    dst: str
    kind: str
    """thunderbolt, ethernet, wifi, ... (anything but thunderbolt is a slow hop)."""
    gbps: float
    rtt_ms: float | None = None
    src_interface: str | None = None
    dst_interface: str | None = None
    src_ipv4: str | None = None
    dst_ipv4: str | None = None
    rdma: bool = False

    @property
    def slow(self) -> bool:
        return self.kind != "thunderbolt"


@dataclass(frozen=True)
class Ring:
    epoch: int
    """0 until the leader commits a ring."""
    order: tuple[str, ...]
    hops: tuple[Hop, ...]
    bottleneck_gbps: float | None = None

    @property
    def slow_hops(self) -> tuple[Hop, ...]:
        return tuple(h for h in self.hops if h.slow)


@dataclass(frozen=True)
class StageInfo:
    """One stage of a placement: the member holding layers [start, end) of the model."""

    node_id: str
    start: int
    end: int

    @property
    def layer_count(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GroupInfo:
    """A group of a placement: Macs that run the layers [start, end) together, each a share
    of every layer (a tensor group; ``node_ids[0]`` takes the hop in), or one Mac (a
    pipeline stage). The status JSON's ``groups``, as `plan solve --json` prints them."""

    node_ids: tuple[str, ...]
    start: int
    end: int
    shares: tuple[ShareInfo, ...] = ()
    """A tensor group's per-Mac shares, in node_ids' order; empty for one Mac."""


@dataclass(frozen=True)
class ShareInfo:
    """One Mac's part of every layer of its tensor group."""

    node_id: str
    heads: int
    """Attention (query) heads this Mac computes: more for a faster Mac (uneven split)."""
    kv_heads: int
    """Key/value heads it holds the cache of (grouped-query attention: fewer than heads)."""
    columns: int
    """MLP intermediate columns it computes (for an MoE layer, of every expert)."""


@dataclass(frozen=True)
class PendingPlacement:
    """A committed placement whose workers are still loading (make before break)."""

    epoch: int
    stages: tuple[StageInfo, ...]
    ready: tuple[str, ...]
    """Members whose worker for this epoch reported ready."""
    fetched: tuple[str, ...] = ()
    """Members that have their stage's model files on disk (workers start once all have)."""
    batch: int = 1
    """Requests its head will serve at once (its KV cache reservation)."""
    parallelism: str | None = None
    groups: tuple[GroupInfo, ...] = ()
    kv_bits: int | None = None
    """Its workers' KV cache bits (4 or 8); None: full precision."""

    @property
    def ready_count(self) -> int:
        holders = {s.node_id for s in self.stages}
        return sum(1 for n in set(self.ready) if n in holders)

    @property
    def fetched_count(self) -> int:
        holders = {s.node_id for s in self.stages}
        return sum(1 for n in set(self.fetched) if n in holders)


@dataclass(frozen=True)
class Placement:
    epoch: int
    """The serving (active) data-plane epoch; 0 before the first one."""
    model: str | None
    """The model the cluster committed (the name as given to load), None when none."""
    stages: tuple[StageInfo, ...]
    """The active epoch's stages, in pipeline order (rank 0 first)."""
    serving: bool
    """True when an epoch is active and every member holding a stage is up."""
    pending: PendingPlacement | None = None
    problem: PlacementProblem | None = None
    """Why the model cannot be placed (it does not fit, no Mac can load it), else None."""
    batch: int = 1
    """Requests the serving epoch's head serves at once: KV cache is reserved for them."""
    batch_asked: int = 1
    """What the model asked for (load's batch, or the agent's --max-batch): ``batch`` is
    less only where memory did not allow more."""
    parallelism: str | None = None
    """How the serving epoch runs the model: "single" (one Mac), "pipeline", "tensor" (one
    group of Macs sharing every layer) or "hybrid" (tensor groups in a row); None: none."""
    groups: tuple[GroupInfo, ...] = ()
    """The serving epoch's groups (a pipeline's: one Mac each)."""
    parallelism_asked: str = "auto"
    """What the model asked for (load's ``parallelism``)."""
    kv_bits: int | None = None
    """The serving epoch's KV cache bits (load's ``kv_bits``: 4 or 8); None: full precision."""


@dataclass(frozen=True)
class Requests:
    """The cluster's requests now, as the serving head reports them (at most a few seconds old)."""

    active: int
    """Requests in the head worker's batch, generating."""
    queued: int
    """Requests waiting for a place in the batch."""
    tokens_per_s: float
    """Tokens the head produced per second over the last few seconds (every request together)."""
    head: str
    epoch: int


@dataclass(frozen=True)
class Transfer:
    """A Mac copying its stage's files from the other Macs (``source`` "peer") or
    downloading them from Hugging Face ("hub"), as its latest report says (at most a few
    seconds old)."""

    node_id: str
    source: str
    bytes_done: int
    bytes_total: int
    """Bytes of the files it has to fetch: arrived, and in all (files it had are not counted)."""
    mb_s: float
    """Over the last few seconds."""
    eta_s: float | None
    """Seconds left at that rate; None while unknown."""
    hub_files: tuple[str, ...] = ()
    """What it is downloading from the hub right now, each as "model: file"."""


@dataclass(frozen=True)
class Status:
    """The agent's view of the cluster, at one moment."""

    node_id: str
    pid: int
    cluster_id: str | None
    role: str
    """starting, unformed, joining, learner, follower, candidate, leader, standalone, left."""
    term: int
    leader: str | None
    commit_index: int
    applied_index: int
    healthy: bool
    """The agent hears a working leader (it is one, or heard from one recently)."""
    members: tuple[Member, ...]
    ring: Ring | None
    placement: Placement | None
    requests_resumed: int = 0
    requests_asked_again: int = 0
    """Times this Mac, as origin, asked a silent head again (frames lost on a dying path)."""
    state_dir: Path | None = None
    requests: Requests | None = None
    """Active and queued requests and tokens/s; None when nothing serves or the head has
    not reported yet."""
    transfers: tuple[Transfer, ...] = ()
    """The Macs fetching their stage's files now (and for a few seconds after)."""

    @property
    def is_leader(self) -> bool:
        return self.leader is not None and self.leader == self.node_id

    def member(self, node_id: str) -> Member | None:
        return next((m for m in self.members if m.node_id == node_id), None)


@dataclass(frozen=True)
class LoadProgress:
    """Where loading a model stands. Stages, in order: accepted (the agent read the model
    and proposed it), planning (committed; members measure it and the leader plans a
    placement), loading (a placement is committed; `ready` of `stages` workers loaded),
    serving (done)."""

    model: str
    stage: str
    ready: int = 0
    stages: int = 0
    epoch: int | None = None
    detail: str = ""
    transfers: tuple[Transfer, ...] = ()
    """While stages fetch their files: each Mac's bytes done and in all, MB/s, time left."""

    @property
    def done(self) -> bool:
        return self.stage == "serving"


@dataclass(frozen=True)
class ModelInfo:
    """A model the agent accepted (the model op's answer, before the cluster commits it);
    the fields in the agent's order, so `dataclasses.asdict` is its JSON object."""

    name: str
    layers: int
    layer_bytes: int
    context_tokens: int
    batch: int = 1
    """Requests to serve at once (the placement reserves KV cache for them where it can)."""
    parallelism: str = "auto"
    """What was asked for: "auto", "pipeline", "tensor" or "hybrid" (the placement says
    what was chosen)."""
    kv_bits: int | None = None
    """The KV cache's bits (4 or 8); None: full precision."""


@dataclass(frozen=True)
class LoadedModel:
    name: str
    layers: int
    layer_bytes: int
    context_tokens: int
    placement: Placement


@dataclass(frozen=True)
class GenerationResult:
    """The end of a generation: all its text, its token ids and why it stopped."""

    request_id: str
    text: str
    tokens: tuple[int, ...]
    finish: str
    """stop (end-of-sequence token) or length (max_tokens reached, or the context is full)."""
    ttft_s: float | None = None
    """Time to first token, measured by the agent that took the request: from its arrival to
    its first token (queueing, prefill and any resume included); None if it produced none."""


class EventKind(StrEnum):
    MEMBER_JOINED = "member_joined"
    MEMBER_LEFT = "member_left"
    MEMBER_DOWN = "member_down"
    MEMBER_UP = "member_up"
    LEADER_CHANGED = "leader_changed"
    CLUSTER_CHANGED = "cluster_changed"
    """This agent is now in another cluster (it merged, or went standalone)."""
    RING_CHANGED = "ring_changed"
    MODEL_CHANGED = "model_changed"
    PLAN_COMMITTED = "plan_committed"
    """A new placement epoch is committed (pending until its workers are ready)."""
    REBALANCE_PROGRESS = "rebalance_progress"
    """More workers of the pending epoch are ready (`ready` of `stages`)."""
    REQUESTS_CHANGED = "requests_changed"
    """The number of requests running or queued at the serving head changed."""
    FETCH_PROGRESS = "fetch_progress"
    """A Mac fetching its stage's files got another tenth of them (or started, or finished):
    ``transfer`` says how far."""
    PLAN_ACTIVATED = "plan_activated"
    """The pending epoch serves now (or the model was cleared)."""


@dataclass(frozen=True)
class Event:
    kind: EventKind
    detail: str
    """One human-readable sentence."""
    node_id: str | None = None
    """The member concerned (member_*, leader_changed: the new leader or None)."""
    epoch: int | None = None
    """The ring epoch (ring_changed) or placement epoch (plan_*, rebalance_progress)."""
    ready: int | None = None
    stages: int | None = None
    status: Status | None = field(default=None, repr=False, compare=False)
    """The status in which the change was seen."""
    transfer: Transfer | None = None
    """fetch_progress: the Mac's transfer (node_id is its Mac)."""


def _transfer(d: Mapping[str, Any]) -> Transfer:
    return Transfer(str(d["node_id"]), str(d["source"]), int(d["bytes_done"]), int(d["bytes_total"]), float(d["mb_s"]),
                    _opt_float(d.get("eta_s")), tuple(str(f) for f in d.get("hub_files") or ()))


def _requests(d: Any) -> Requests | None:
    if not d:
        return None
    return Requests(int(d["active"]), int(d["queued"]), float(d["tokens_per_s"]), str(d["head"]), int(d["epoch"]))


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _port(d: Mapping[str, Any]) -> Port:
    return Port(str(d["interface"]), str(d.get("kind", "")), bool(d.get("up")), float(d.get("gbps") or 0.0),
                tuple(str(a) for a in d.get("ipv4") or ()), bool(d.get("rdma")), _opt_str(d.get("domain_uuid")),
                _opt_str(d.get("peer_domain_uuid")))


def _member(d: Mapping[str, Any]) -> Member:
    return Member(str(d["node_id"]), bool(d.get("voter")), bool(d.get("up")), tuple(str(a) for a in d.get("addresses") or ()),
                  tuple(_port(p) for p in d.get("ports") or ()))


def _hop(d: Mapping[str, Any]) -> Hop:
    return Hop(str(d["from"]), str(d["to"]), str(d.get("kind", "")), float(d.get("gbps") or 0.0), _opt_float(d.get("rtt_ms")),
               _opt_str(d.get("from_interface")), _opt_str(d.get("to_interface")), _opt_str(d.get("from_ipv4")),
               _opt_str(d.get("to_ipv4")), bool(d.get("rdma")))


def _ring(d: Mapping[str, Any]) -> Ring:
    return Ring(int(d.get("epoch", 0)), tuple(str(n) for n in d.get("order") or ()), tuple(_hop(h) for h in d.get("hops") or ()),
                _opt_float(d.get("bottleneck_gbps")))


def _stages(ss: Any) -> tuple[StageInfo, ...]:
    return tuple(StageInfo(str(s["node_id"]), int(s["layers"][0]), int(s["layers"][1])) for s in ss or ())


def _groups(gs: Any) -> tuple[GroupInfo, ...]:
    return tuple(GroupInfo(tuple(str(n) for n in g["node_ids"]), int(g["layers"][0]), int(g["layers"][1]),
                           tuple(ShareInfo(str(x["node_id"]), int(x["heads"]), int(x["kv_heads"]), int(x["columns"]))
                                 for x in g.get("shares") or ()))
                 for g in gs or ())


def _placement(d: Mapping[str, Any]) -> Placement:
    pending = d.get("pending")
    return Placement(
        int(d.get("epoch", 0)),
        _opt_str(d.get("model")),
        _stages(d.get("stages")),
        bool(d.get("serving")),
        PendingPlacement(int(pending["epoch"]), _stages(pending.get("stages")), tuple(str(n) for n in pending.get("ready") or ()),
                         tuple(str(n) for n in pending.get("fetched") or ()), int(pending.get("batch") or 1),
                         _opt_str(pending.get("parallelism")), _groups(pending.get("groups")), _opt_int(pending.get("kv_bits")))
        if pending else None,
        PlacementProblem.from_json(d["problem"]) if d.get("problem") else None,
        int(d.get("batch") or 1),
        int(d.get("batch_asked") or 1),
        _opt_str(d.get("parallelism")),
        _groups(d.get("groups")),
        str(d.get("parallelism_asked") or "auto"),
        _opt_int(d.get("kv_bits")),
    )


def parse_model(d: Any) -> ModelInfo:
    """The model op's description of the model it accepted."""
    try:
        return ModelInfo(str(d["name"]), int(d.get("layers", 0)), int(d.get("layer_bytes", 0)), int(d["context_tokens"]),
                         int(d.get("batch") or 1), str(d.get("parallelism") or "auto"), _opt_int(d.get("kv_bits")))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise AgentError("the agent accepted the model but did not describe it") from None


def parse_status(d: Any) -> Status:
    try:
        return Status(
            node_id=str(d["node_id"]),
            pid=int(d.get("pid") or 0),
            cluster_id=_opt_str(d.get("cluster_id")),
            role=str(d.get("role", "")),
            term=int(d.get("term") or 0),
            leader=_opt_str(d.get("leader")),
            commit_index=int(d.get("commit_index") or 0),
            applied_index=int(d.get("applied_index") or 0),
            healthy=bool(d.get("healthy")),
            members=tuple(_member(m) for m in d.get("members") or ()),
            ring=_ring(d["ring"]) if d.get("ring") else None,
            placement=_placement(d["placement"]) if d.get("placement") else None,
            requests_resumed=int(d.get("requests_resumed") or 0),
            requests_asked_again=int(d.get("requests_asked_again") or 0),
            state_dir=Path(d["state_dir"]) if d.get("state_dir") else None,
            requests=_requests(d.get("requests")),
            transfers=tuple(_transfer(t) for t in d.get("transfers") or ()),
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise AgentError(f"the agent's status has a shape this client does not understand ({exc!r}); "
                         "are the client and the agent the same p2pmesh version?") from None


def formed(st: Status) -> bool:
    """The agent is in a cluster (it has committed state to report)."""
    return st.cluster_id is not None and st.role not in ("starting", "unformed", "joining", "left")


def newest_epoch(p: Placement | None) -> int:
    """The newest placement epoch a status shows (serving or pending), 0 for none."""
    if p is None:
        return 0
    return max(p.epoch, p.pending.epoch if p.pending else 0)

