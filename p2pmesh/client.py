"""The client API: a program's typed view of a running agent, over the agent's control
socket (drivers/control.py), and an agent embedded in a program.

This module owns:
- where the agent is: an address (the socket, or a state directory holding agent.sock),
  else $P2PMESH_SOCKET, else agent.sock in the default state directory;
- the async client (`open_client`, trio) and the synchronous one (`connect`). They share
  every decision: each operation is written once as a *plan*, a generator that yields steps
  (ask the agent, sleep, read the clock, run blocking work, emit an event) and is driven
  either by trio or by plain blocking calls. So the two clients cannot drift apart;
- the typed values (frozen dataclasses) built from the agent's JSON, and the typed errors;
- `chat`: rendering messages into a prompt here, on the client (the agent has no chat op);
- `watch`: cluster events from successive status polls;
- `Agent`: `p2pmesh.agent.Agent` run inside the caller's trio program.

The control protocol is one JSON request line per connection, answered by one JSON line,
or for `generate` by one line per event until one with `"final": true`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket as stdsocket
import threading
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import trio

from p2pmesh import chat_template
from p2pmesh.core import fit
from p2pmesh.core.errors import MeshError
from p2pmesh.core.fit import PlacementProblem

if TYPE_CHECKING:
    from p2pmesh.agent import Agent as _CoreAgent
    from p2pmesh.agent import AgentConfig

SOCKET_ENV = "P2PMESH_SOCKET"
SOCKET_NAME = "agent.sock"
REQUEST_TIMEOUT_S = 15.0
"""One request/answer exchange (status, leave, ...). The agent answers in milliseconds."""
QUORUM_TIMEOUT_S = 30.0
"""How long an operation that needs a working cluster waits for one. A fresh agent founds
or joins a cluster within a second or two; a cut-off minority goes standalone after 3 s."""
LOAD_TIMEOUT_S = 600.0
STREAM_IDLE_TIMEOUT_S = 300.0
"""A generation fails when the agent sends nothing for this long (as the agent's own bound)."""
POLL_S = 0.2
MODEL_RESEND_S = 5.0
"""A model proposal can be lost when leadership moves before it commits; send it again if
the cluster has not committed it after this long (the model op is idempotent)."""
LINE_BYTES_MAX = 16 * 1024 * 1024
DEFAULT_CONTEXT_TOKENS = 4096

T = TypeVar("T")

# ----------------------------------------------------------------------------------------
# Errors: each says whose fault it is and what to do.

P2PMeshError = MeshError
"""The base of every error p2pmesh raises (the same class as p2pmesh.core.errors.MeshError,
so one `except P2PMeshError` also catches the embedded agent's errors, e.g. StateCorrupted)."""


class AgentNotRunning(P2PMeshError):
    """No agent answers at the socket (nothing started, or a stopped agent's stale socket).
    The environment's to fix: start `p2pmesh agent`, or point the client at the right one."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class NoQuorum(P2PMeshError):
    """The agent has no working cluster (no leader it can hear) and did not get one within
    the timeout. The network's or the cluster's state, not the caller's: retry later."""


class ModelNotLoaded(P2PMeshError):
    """The cluster serves no model (or not yet the one asked for). Load one first."""


class ModelRefused(ModelNotLoaded):
    """The cluster's verdict on the model (core/fit.py): it will not serve it as things
    stand. ``code`` is machine-readable, ``problem`` has the numbers; the message says why."""

    code = ""

    def __init__(self, problem: PlacementProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class ModelDoesNotFit(ModelRefused):
    """The members' memory cannot hold the model with its KV cache (the cluster's state: a
    shorter context, another Mac or smaller weights). A Mac that joins and makes it fit
    starts the placement by itself."""

    code = fit.DOES_NOT_FIT


class ModelCannotLoad(ModelRefused):
    """No member can load the model at all (a family the workers do not run, a broken
    checkpoint): the model's fault; the message has the members' own errors."""

    code = fit.CANNOT_LOAD


def _refused(problem: PlacementProblem) -> ModelRefused:
    return (ModelCannotLoad if problem.code == fit.CANNOT_LOAD else ModelDoesNotFit)(problem)


class BadRequest(P2PMeshError):
    """The agent refused the request's arguments (the caller's to fix: the message says how)."""


class AgentError(P2PMeshError):
    """The agent failed, stopped answering, or said something this client cannot read
    (the agent's or the data plane's fault; a version mismatch also lands here)."""


# ----------------------------------------------------------------------------------------
# Typed values


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
class PendingPlacement:
    """A committed placement whose workers are still loading (make before break)."""

    epoch: int
    stages: tuple[StageInfo, ...]
    ready: tuple[str, ...]
    """Members whose worker for this epoch reported ready."""
    fetched: tuple[str, ...] = ()
    """Members that have their stage's model files on disk (workers start once all have)."""

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

    @property
    def done(self) -> bool:
        return self.stage == "serving"


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


# ----------------------------------------------------------------------------------------
# Parsing the agent's JSON into typed values. A shape we do not understand is the agent's
# (or a version mismatch's) problem, reported as AgentError, never a KeyError.


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


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


def _placement(d: Mapping[str, Any]) -> Placement:
    pending = d.get("pending")
    return Placement(
        int(d.get("epoch", 0)),
        _opt_str(d.get("model")),
        _stages(d.get("stages")),
        bool(d.get("serving")),
        PendingPlacement(int(pending["epoch"]), _stages(pending.get("stages")), tuple(str(n) for n in pending.get("ready") or ()),
                         tuple(str(n) for n in pending.get("fetched") or ()))
        if pending else None,
        PlacementProblem.from_json(d["problem"]) if d.get("problem") else None,
    )


def _status(d: Any) -> Status:
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
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise AgentError(f"the agent's status has a shape this client does not understand ({exc!r}); "
                         "are the client and the agent the same p2pmesh version?") from None


def _formed(st: Status) -> bool:
    """The agent is in a cluster (it has committed state to report)."""
    return st.cluster_id is not None and st.role not in ("starting", "unformed", "joining", "left")


# ----------------------------------------------------------------------------------------
# Plans: the steps an operation needs, driven by trio (AsyncClient) or blocking (Client).


@dataclass(frozen=True)
class _Ask:
    """Send one request line, return the checked answer (or None at EOF when eof_ok)."""

    request: dict[str, Any]
    timeout_s: float
    eof_ok: bool = False


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Clock:
    """The value is a monotonic time in seconds."""


@dataclass(frozen=True)
class _Blocking:
    """Work that blocks (files, a tokenizer): a worker thread under trio."""

    fn: Callable[[], Any]


@dataclass(frozen=True)
class _Emit:
    event: Event


_Step = _Ask | _Sleep | _Clock | _Blocking | _Emit
_Plan = Generator[_Step, Any, T]


def _checked(answer: Any, op: str) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise AgentError(f"the agent answered {op} with something that is not a JSON object")
    if not answer.get("ok"):
        error = str(answer.get("error") or "no reason given")
        if op == "model":
            raise BadRequest(f"the agent refused the model: {error}")
        if error.startswith(("bad request", "unknown op")):
            raise AgentError(f"the agent does not understand {op!r} ({error}); are the client and the agent the same version?")
        raise AgentError(f"the agent refused {op}: {error}")
    return answer


def _p_status() -> _Plan[Status]:
    answer = yield _Ask({"op": "status"}, REQUEST_TIMEOUT_S)
    return _status(answer.get("status"))


def _p_healthy(timeout_s: float) -> _Plan[Status]:
    """The status, once the agent hears a working leader; NoQuorum after timeout_s."""
    start = yield _Clock()
    while True:
        st = yield from _p_status()
        if st.healthy and _formed(st):
            return st
        now = yield _Clock()
        if now - start >= timeout_s:
            up = sum(1 for m in st.members if m.up)
            raise NoQuorum(
                f"the agent has no working cluster after {timeout_s:g} s (role {st.role}, {len(st.members)} members, "
                f"{up} up, leader {st.leader or 'none'}): a majority of the voters must reach each other. A Mac cut off "
                "from its cluster continues on its own after a few seconds; check `p2pmesh status` and the cables, then retry"
            )
        yield _Sleep(POLL_S)


def _p_model_set(name: str, context_tokens: int, deadline: float) -> _Plan[dict[str, Any]]:
    """Send the model op (the agent may first download the model: it allows that hours).
    A connection that closes unanswered (the agent restarted) is retried until the
    deadline; a finished download is in the cache for the next try."""
    while True:
        now = yield _Clock()
        answer = yield _Ask({"op": "model", "name": name, "context_tokens": context_tokens}, max(1.0, deadline - now),
                            eof_ok=True)
        if answer is not None:
            model = answer.get("model")
            if not isinstance(model, dict):
                raise AgentError("the agent accepted the model but did not describe it")
            return model
        now = yield _Clock()
        if now >= deadline:
            raise ModelNotLoaded(f"the agent did not accept {name} in time (it was still resolving or downloading it)")
        yield _Sleep(POLL_S)


def _newest_epoch(p: Placement | None) -> int:
    if p is None:
        return 0
    return max(p.epoch, p.pending.epoch if p.pending else 0)


def _load_progress(name: str, p: Placement | None, floor: int, same: bool) -> LoadProgress:
    """Where loading `name` stands. Epochs at or below `floor` were planned before our
    request (for another model), unless the model was already this one (`same`)."""
    if p is None or p.model != name:
        return LoadProgress(name, "accepted", detail="waiting for the cluster to commit the model")
    if p.pending is not None and (same or p.pending.epoch > floor):
        n, r, f = len(p.pending.stages), p.pending.ready_count, p.pending.fetched_count
        if f < n:
            return LoadProgress(name, "loading", r, n, p.pending.epoch,
                                f"epoch {p.pending.epoch}: {f} of {n} stages have their model files (fetching)")
        return LoadProgress(name, "loading", r, n, p.pending.epoch, f"epoch {p.pending.epoch}: {r} of {n} stage workers loaded")
    if p.serving and p.stages and p.pending is None and (same or p.epoch > floor):
        n = len(p.stages)
        return LoadProgress(name, "serving", n, n, p.epoch, f"serving on {n} stage{'s' if n != 1 else ''} (epoch {p.epoch})")
    return LoadProgress(name, "planning", detail="members are measuring the model; the leader plans a placement")


def _p_load(model: str | os.PathLike[str], context_tokens: int, timeout_s: float, quorum_timeout_s: float,
            on_progress: Callable[[LoadProgress], None] | None) -> _Plan[LoadedModel]:
    name = model_name(model)
    start = yield _Clock()
    deadline = start + timeout_s
    before = yield from _p_healthy(min(timeout_s, quorum_timeout_s))
    same = before.placement is not None and before.placement.model == name
    floor = _newest_epoch(before.placement)
    stale = before.placement.problem if before.placement is not None else None
    info = yield from _p_model_set(name, context_tokens, deadline)
    sent = yield _Clock()
    # Always report acceptance first: the next poll often finds the model committed already.
    last: LoadProgress | None = _load_progress(name, None, floor, same)
    if on_progress is not None:
        on_progress(last)
    while True:
        st = yield from _p_status()
        problem = st.placement.problem if st.placement is not None else None
        if problem is not None and problem.model == name and problem.context_tokens == context_tokens:
            now = yield _Clock()
            # A verdict seen before our request stands once the cluster had time to take the
            # request (a model set again is measured again where it could not be loaded).
            if problem != stale or now - sent >= MODEL_RESEND_S:
                raise _refused(problem)
        else:
            stale = None
        progress = _load_progress(name, st.placement, floor, same)
        if progress != last:
            last = progress
            if on_progress is not None:
                on_progress(progress)
        if progress.done:
            assert st.placement is not None
            return LoadedModel(str(info.get("name", name)), int(info.get("layers", 0)), int(info.get("layer_bytes", 0)),
                               int(info.get("context_tokens", context_tokens)), st.placement)
        now = yield _Clock()
        if now >= deadline:
            raise ModelNotLoaded(f"{name} is not serving after {timeout_s:g} s: {progress.stage}, {progress.detail}")
        if progress.stage == "accepted" and now - sent >= MODEL_RESEND_S and st.healthy:
            yield from _p_model_set(name, context_tokens, deadline)
            sent = now
        yield _Sleep(POLL_S)


def model_name(model: str | os.PathLike[str]) -> str:
    """What to send as the model's name. A local directory is made absolute, because the
    agent may run in another working directory; anything else (a Hugging Face id, a name
    under the agent's model root) goes as given."""
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
        raise BadRequest("load needs a model: a local directory in the Hugging Face layout or a Hugging Face id (org/name)")
    if isinstance(model, os.PathLike) or Path(model).expanduser().is_dir():
        path = Path(os.fspath(model)).expanduser()
        if path.is_dir():
            return str(path.resolve())
        return str(path)
    return str(model)


def _p_model_ready(quorum_timeout_s: float) -> _Plan[Status]:
    """Before a generation: the cluster must have a model. Without one the agent would hold
    the request for two minutes before failing it; this fails at once with the fix."""
    st = yield from _p_status()
    if not _formed(st):
        st = yield from _p_healthy(quorum_timeout_s)
    if st.placement is None or st.placement.model is None:
        raise ModelNotLoaded("the cluster serves no model yet: load one first (client.load(PATH_OR_HF_ID), "
                             "or `p2pmesh model set PATH_OR_HF_ID`)")
    if st.placement.problem is not None:
        raise _refused(st.placement.problem)
    return st


def _generate_fields(prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> dict[str, Any]:
    if not isinstance(prompt, str):
        raise BadRequest(f"generate needs the prompt as text, got {type(prompt).__name__}")
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}


def _p_generate(fields: dict[str, Any], quorum_timeout_s: float) -> _Plan[dict[str, Any]]:
    yield from _p_model_ready(quorum_timeout_s)
    return {"op": "generate", **fields}


def _p_chat(messages: Sequence[Mapping[str, Any]], fields: dict[str, Any], quorum_timeout_s: float,
            model_root: Path | None) -> _Plan[dict[str, Any]]:
    msgs = _check_messages(messages)
    st = yield from _p_model_ready(quorum_timeout_s)
    assert st.placement is not None and st.placement.model is not None
    name = st.placement.model
    prompt = yield _Blocking(lambda: _chat_prompt(name, msgs, model_root, st.state_dir))
    return {"op": "generate", **fields, **prompt}


def _diff(prev: Status, cur: Status) -> list[Event]:
    """The cluster events between two statuses of the same agent."""
    out: list[Event] = []

    def ev(kind: EventKind, detail: str, **kw: Any) -> None:
        out.append(Event(kind, detail, status=cur, **kw))

    moved = cur.cluster_id != prev.cluster_id and prev.cluster_id is not None and cur.cluster_id is not None
    if moved:
        ev(EventKind.CLUSTER_CHANGED, f"this agent is now in cluster {cur.cluster_id} (was {prev.cluster_id})")
    before = {m.node_id: m for m in prev.members}
    after = {m.node_id: m for m in cur.members}
    for node, m in after.items():
        old = before.get(node)
        if old is None:
            ev(EventKind.MEMBER_JOINED, f"{node[:8]} joined ({'voter' if m.voter else 'learner'})", node_id=node)
        elif old.up and not m.up:
            ev(EventKind.MEMBER_DOWN, f"{node[:8]} is down (the leader stopped hearing it)", node_id=node)
        elif not old.up and m.up:
            ev(EventKind.MEMBER_UP, f"{node[:8]} is up again", node_id=node)
    for node in before.keys() - after.keys():
        ev(EventKind.MEMBER_LEFT, f"{node[:8]} left the cluster", node_id=node)
    if cur.leader != prev.leader:
        ev(EventKind.LEADER_CHANGED, f"the leader is now {cur.leader[:8]}" if cur.leader else "no leader (election under way)",
           node_id=cur.leader)
    # Another cluster numbers its ring and placement epochs from scratch: compare its
    # epochs with nothing rather than with the old cluster's.
    r0, r1 = (None if moved else prev.ring), cur.ring
    if r1 is not None and (r0 is None or r1.epoch != r0.epoch):
        order = " -> ".join(n[:8] for n in r1.order) or "empty"
        ev(EventKind.RING_CHANGED, f"ring epoch {r1.epoch}: {order}", epoch=r1.epoch)
    p0, p1 = prev.placement, cur.placement
    if p1 is None:
        return out
    if p0 is not None and p1.model != p0.model:
        ev(EventKind.MODEL_CHANGED, f"the cluster's model is now {p1.model}" if p1.model else "the cluster serves no model")
    if moved:
        p0 = None
    seen = _newest_epoch(p0)
    pending0 = p0.pending if p0 is not None else None
    if p1.pending is not None:
        pe = p1.pending
        if pe.epoch > seen:
            ev(EventKind.PLAN_COMMITTED, f"placement epoch {pe.epoch} committed: {len(pe.stages)} stages, loading",
               epoch=pe.epoch, ready=pe.ready_count, stages=len(pe.stages))
        elif pending0 is not None and pending0.epoch == pe.epoch and pe.ready_count != pending0.ready_count:
            ev(EventKind.REBALANCE_PROGRESS, f"placement epoch {pe.epoch}: {pe.ready_count} of {len(pe.stages)} stages ready",
               epoch=pe.epoch, ready=pe.ready_count, stages=len(pe.stages))
    if p0 is None or p1.epoch > p0.epoch:
        if p1.epoch > seen:  # activated between two polls: we never saw it pending
            ev(EventKind.PLAN_COMMITTED, f"placement epoch {p1.epoch} committed", epoch=p1.epoch,
               ready=len(p1.stages), stages=len(p1.stages))
        if p0 is not None or p1.epoch > 0:
            n = len(p1.stages)
            ev(EventKind.PLAN_ACTIVATED, f"placement epoch {p1.epoch} serves now ({n} stage{'s' if n != 1 else ''})"
               if n else f"placement epoch {p1.epoch}: nothing to serve", epoch=p1.epoch, ready=n, stages=n)
    return out


def _p_watch(interval_s: float) -> _Plan[None]:
    """Poll and diff. Nothing runs while the consumer does not ask for the next event, so
    there is no backlog to bound: a slow consumer sees the changes between two polls
    coalesced (a member that joined and left meanwhile is not reported)."""
    prev = yield from _p_status()
    while True:
        yield _Sleep(interval_s)
        cur = yield from _p_status()
        for event in _diff(prev, cur):
            yield _Emit(event)
        prev = cur


# ----------------------------------------------------------------------------------------
# Chat: messages -> prompt, on the client (the agent only generates from text or tokens).


def _check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise BadRequest("chat needs a non-empty list of messages such as {'role': 'user', 'content': 'hello'}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"chat message {i} must be a mapping with text 'role' and 'content'")
        out.append(dict(m))
    return tuple(out)


def fallback_chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt chat() sends for a model without a chat template: one "role: content"
    line per message, then "assistant:" for the model to continue."""
    return chat_template.fallback_prompt((m["role"], m["content"]) for m in _check_messages(messages))


_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _model_directory(name: str, model_root: Path | None, state_dir: Path | None = None) -> Path:
    """The model's files on this machine, for its tokenizer and chat template: its own
    directory, the agent's copy of it from another Mac (in the agent's state directory),
    or, for a Hugging Face id, its metadata."""
    from p2pmesh import model_files, models, peer_copy

    local = models.located(name, model_root)
    try:
        return models.resolve(local, allow_download=False)
    except models.ModelError:
        pass
    if state_dir is not None and (peer_copy.copy_dir(state_dir, name) / "config.json").is_file():
        return peer_copy.copy_dir(state_dir, name)

    if not model_files.is_hub_id(name):
        raise P2PMeshError(f"chat needs the tokenizer of {name}, and there is no such directory on this machine; "
                           "run the client where the model's directory is, or render the prompt and call generate()")
    try:  # a Hugging Face id: fetch only the tokenizer and config files, never the weights
        return model_files.fetch_metadata(name)
    except model_files.ModelFilesError as exc:
        raise P2PMeshError(f"chat needs the tokenizer of {name}: {exc}; render the prompt yourself and call generate()") from None


def _tokenizer(directory: Path) -> Any:
    key = str(directory.resolve())
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            try:
                tok = _TOKENIZERS[key] = chat_template.load_tokenizer(directory)
            except ImportError as exc:
                raise P2PMeshError(str(exc)) from None
        return tok


def _chat_prompt(name: str, messages: tuple[dict[str, Any], ...], model_root: Path | None,
                 state_dir: Path | None = None) -> dict[str, Any]:
    """The generate fields for a chat: token ids rendered by the model's chat template, or
    the fallback prompt as text when the model has none."""
    directory = _model_directory(name, model_root, state_dir)
    if not chat_template.directory_has_template(directory):
        return {"prompt": fallback_chat_prompt(messages)}
    try:
        tokens = chat_template.render_tokens(_tokenizer(directory), messages)
    except chat_template.TemplateRefused as exc:
        raise BadRequest(f"{name}: {exc}") from None
    return {"prompt": None, "prompt_tokens": list(tokens)}


# ----------------------------------------------------------------------------------------
# Where the agent is, and the bytes on the socket


def locate_socket(address: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The agent's control socket and how it was chosen (for error messages): the address
    given (a socket or a state directory), else $P2PMESH_SOCKET, else the default state
    directory's socket. The CLI resolves --socket/--state-dir the same way."""
    if address is not None:
        how = "the address given"
        raw = os.fspath(address)
    elif os.environ.get(SOCKET_ENV):
        how = f"from ${SOCKET_ENV}"
        raw = os.environ[SOCKET_ENV]
    else:
        from p2pmesh.agent import default_state_dir

        return default_state_dir() / SOCKET_NAME, "the default state directory"
    path = Path(raw).expanduser()
    return (path / SOCKET_NAME if path.is_dir() else path), how


def _not_running(path: Path, how: str, exc: OSError) -> AgentNotRunning:
    if isinstance(exc, FileNotFoundError):
        why = "no socket there"
    elif isinstance(exc, ConnectionRefusedError):
        why = "the socket exists but nothing listens: an agent that stopped left it behind"
    else:
        why = exc.strerror or str(exc)
    return AgentNotRunning(
        f"no p2pmesh agent is running at {path} ({why}; looked there as {how}). Start one with `p2pmesh agent` "
        f"(with --state-dir DIR, pass DIR or DIR/{SOCKET_NAME} as the address or set ${SOCKET_ENV})", path)


_NO_LINE: Any = object()
_EOF: Any = object()


class _Lines:
    """Bytes in, complete lines out; bounded, so a broken peer cannot exhaust memory."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if len(self.buf) > LINE_BYTES_MAX and b"\n" not in self.buf:
            raise AgentError("the agent sent an oversized line")

    def pop(self) -> Any:
        """The next decoded line, or _NO_LINE when no complete line is buffered."""
        if b"\n" not in self.buf:
            return _NO_LINE
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise AgentError("the agent sent a line that is not JSON") from None


def _encode(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


class _Decoder:
    """The generate stream's events -> text pieces, the result, or a typed error."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.request_id = ""
        self.result: GenerationResult | None = None

    def feed(self, event: Any) -> str:
        if not isinstance(event, dict):
            raise AgentError("the agent sent a generation event that is not a JSON object")
        if not event.get("ok", True):
            error = str(event.get("error") or "the agent refused the request")
            if "id" not in event:  # refused before it started: the arguments were wrong
                raise BadRequest(f"the agent refused the generation: {error}")
            if error.startswith("no serving epoch"):
                raise ModelNotLoaded(f"the generation could not start: {error} (is the model still loading?)")
            raise AgentError(f"the generation failed: {error}")
        self.request_id = str(event.get("id", self.request_id))
        text, tokens = event.get("text") or "", event.get("tokens") or []
        if not isinstance(text, str) or not isinstance(tokens, list):
            raise AgentError("the agent sent a generation event of an unknown shape")
        self.tokens += [int(t) for t in tokens]
        if text:
            self.pieces.append(text)
        if event.get("final"):
            self.result = GenerationResult(self.request_id, "".join(self.pieces), tuple(self.tokens), str(event.get("finish", "")))
        return text


# ----------------------------------------------------------------------------------------
# The async client (trio)


async def _open_async(path: Path, how: str) -> trio.SocketStream:
    try:
        return await trio.open_unix_socket(str(path))
    except OSError as exc:
        raise _not_running(path, how, exc) from None


async def _receive_line(stream: trio.SocketStream, lines: _Lines, timeout_s: float, what: str) -> Any:
    """The next decoded line, or _EOF when the agent closed the connection."""
    while True:
        line = lines.pop()
        if line is not _NO_LINE:
            return line
        try:
            with trio.fail_after(timeout_s):
                chunk = await stream.receive_some(65536)
        except trio.TooSlowError:
            raise AgentError(f"the agent sent nothing for {timeout_s:g} s ({what})") from None
        except trio.BrokenResourceError as exc:
            raise AgentError(f"the connection to the agent broke ({what}): {exc.__cause__ or exc}") from None
        if not chunk:
            return _EOF
        lines.feed(chunk)




class AsyncClient:
    """A client of one agent, for trio programs. Every method opens its own connection to
    the control socket, so one client can be shared by many tasks."""

    def __init__(self, address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S,
                 _model_root: Path | None = None) -> None:
        self.socket_path, self._how = locate_socket(address)
        self.quorum_timeout = quorum_timeout
        self._model_root = _model_root

    def __repr__(self) -> str:
        return f"AsyncClient({str(self.socket_path)!r})"

    async def __aenter__(self) -> Self:
        await self.status()  # fail here, with the fix, when no agent answers
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def _ask(self, step: _Ask) -> Any:
        op = str(step.request.get("op"))
        stream = await _open_async(self.socket_path, self._how)
        async with stream:
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    await stream.send_all(_encode(step.request))
            except trio.TooSlowError:
                raise AgentError(f"the agent did not take the {op} request within {REQUEST_TIMEOUT_S:g} s") from None
            except trio.BrokenResourceError:
                raise AgentError(f"the agent closed the connection before reading the {op} request") from None
            line = await _receive_line(stream, _Lines(), step.timeout_s, f"waiting for the answer to {op}")
        if line is _EOF:
            if step.eof_ok:
                return None
            raise AgentError(f"the agent closed the connection without answering {op} (is it stopping?)")
        return _checked(line, op)

    async def _step(self, step: _Step) -> Any:
        if isinstance(step, _Ask):
            return await self._ask(step)
        if isinstance(step, _Sleep):
            await trio.sleep(step.seconds)
            return None
        if isinstance(step, _Clock):
            return trio.current_time()
        if isinstance(step, _Blocking):
            return await trio.to_thread.run_sync(step.fn)
        raise AssertionError(f"a plan emitted {step!r} where no event is expected")

    async def _run(self, plan: _Plan[T]) -> T:
        value: Any = None
        try:
            while True:
                try:
                    step = plan.send(value)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value = await self._step(step)
        finally:
            plan.close()

    async def status(self) -> Status:
        """This agent's view right now (no waiting: `healthy` says whether it has a cluster)."""
        return await self._run(_p_status())

    async def members(self) -> tuple[Member, ...]:
        """The cluster's members (waits up to quorum_timeout for a working cluster)."""
        return (await self._run(_p_healthy(self.quorum_timeout))).members

    async def ring(self) -> Ring:
        """The committed ring (epoch 0 and no order before the leader commits one)."""
        st = await self._run(_p_healthy(self.quorum_timeout))
        return st.ring or Ring(0, (), ())

    async def placement(self) -> Placement:
        """The model's placement: the serving epoch's stages, and a pending one if loading."""
        st = await self._run(_p_healthy(self.quorum_timeout))
        return st.placement or Placement(0, None, (), False)

    async def load(self, model: str | os.PathLike[str], *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   timeout: float = LOAD_TIMEOUT_S, on_progress: Callable[[LoadProgress], None] | None = None) -> LoadedModel:
        """Serve `model` (a local directory or a Hugging Face id) cluster-wide and wait until
        it serves. `on_progress` is called with each new LoadProgress."""
        return await self._run(_p_load(model, context_tokens, timeout, self.quorum_timeout, on_progress))

    def generate(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> AsyncGeneration:
        """Stream the completion of `prompt` as text pieces: `async for piece in ...`."""
        fields = _generate_fields(prompt, max_tokens, temperature, top_p, seed)
        return AsyncGeneration(self, _p_generate(fields, self.quorum_timeout))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> AsyncGeneration:
        """Stream the assistant's reply to `messages` ({"role", "content"} mappings),
        rendered with the model's chat template (or the documented fallback)."""
        fields = _generate_fields("", max_tokens, temperature, top_p, seed)
        return AsyncGeneration(self, _p_chat(messages, fields, self.quorum_timeout, self._model_root))

    async def watch(self, *, interval: float = POLL_S) -> AsyncIterator[Event]:
        """Yield cluster Events as they happen (polling the agent every `interval` s).
        Ends with AgentNotRunning when the agent stops."""
        plan = _p_watch(interval)
        value: Any = None
        try:
            while True:
                step = plan.send(value)
                if isinstance(step, _Emit):
                    value = None
                    yield step.event
                else:
                    value = await self._step(step)
        finally:
            plan.close()

    async def leave(self, *, timeout: float = 90.0) -> bool:
        """Leave the cluster gracefully; the agent then exits. True once the cluster confirmed."""
        answer = await self._run(_p_leave(timeout))
        return answer


def _p_leave(timeout_s: float) -> _Plan[bool]:
    answer = yield _Ask({"op": "leave", "timeout_s": timeout_s}, timeout_s + REQUEST_TIMEOUT_S)
    # `confirmed`: the cluster committed this Mac's removal (an agent that only stopped at
    # its deadline has `left` but not `confirmed`); older agents answer `left` alone.
    return bool(answer.get("confirmed", answer.get("left")))


class AsyncGeneration:
    """A streaming generation: `async for piece in gen` yields text pieces; afterwards
    `gen.result` holds the GenerationResult. Nothing is sent before the first iteration.
    Closing it early (`aclose`, `async with`) disconnects; the agent finishes the request
    on its own and drops the rest."""

    def __init__(self, client: AsyncClient, prepare: _Plan[dict[str, Any]]) -> None:
        self._client = client
        self._prepare: _Plan[dict[str, Any]] | None = prepare
        self._stream: trio.SocketStream | None = None
        self._lines = _Lines()
        self._decoder = _Decoder()
        self._finished = False

    @property
    def result(self) -> GenerationResult | None:
        return self._decoder.result

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._finished = True
        if self._prepare is not None:
            self._prepare.close()
            self._prepare = None
        if self._stream is not None:
            self._stream.socket.close()  # synchronous: safe while a cancellation unwinds
            self._stream = None

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._stream is None:
                assert self._prepare is not None
                request = await self._client._run(self._prepare)
                self._prepare = None
                self._stream = await _open_async(self._client.socket_path, self._client._how)
                try:
                    with trio.fail_after(REQUEST_TIMEOUT_S):
                        await self._stream.send_all(_encode(request))
                except (trio.TooSlowError, trio.BrokenResourceError):
                    raise AgentError("the agent did not take the generate request") from None
            while True:
                event = await _receive_line(self._stream, self._lines, STREAM_IDLE_TIMEOUT_S, "generating")
                if event is _EOF:
                    raise AgentError("the agent closed the stream before the generation ended (did it stop?)")
                piece = self._decoder.feed(event)
                if self._decoder.result is not None:
                    await self.aclose()
                    if piece:
                        return piece
                    raise StopAsyncIteration
                if piece:
                    return piece
        except BaseException:
            await self.aclose()
            raise

    async def collect(self) -> GenerationResult:
        """Consume the rest of the stream and return the result (all the text, not only
        the pieces not yet read)."""
        async for _ in self:
            pass
        if self._decoder.result is None:
            raise AgentError("the generation was closed before its end")
        return self._decoder.result


def open_client(address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> AsyncClient:
    """The async client of the agent at `address` (its socket, or its state directory;
    default $P2PMESH_SOCKET, else the default state directory). Use it as
    `async with open_client() as client:`; entering checks that the agent answers."""
    return AsyncClient(address, quorum_timeout=quorum_timeout)


# ----------------------------------------------------------------------------------------
# The synchronous client (blocking sockets; no event loop, so it also works in notebooks)


def _open_sync(path: Path, how: str, timeout_s: float) -> stdsocket.socket:
    s = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(str(path))
    except OSError as exc:
        s.close()
        raise _not_running(path, how, exc) from None
    return s


def _receive_line_sync(s: stdsocket.socket, lines: _Lines, timeout_s: float, what: str) -> Any:
    while True:
        line = lines.pop()
        if line is not _NO_LINE:
            return line
        s.settimeout(timeout_s)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AgentError(f"the agent sent nothing for {timeout_s:g} s ({what})") from None
        except OSError as exc:
            raise AgentError(f"the connection to the agent broke ({what}): {exc}") from None
        if not chunk:
            return _EOF
        lines.feed(chunk)


class Client:
    """The synchronous client: the same methods as AsyncClient, blocking."""

    def __init__(self, address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S,
                 _model_root: Path | None = None) -> None:
        self.socket_path, self._how = locate_socket(address)
        self.quorum_timeout = quorum_timeout
        self._model_root = _model_root

    def __repr__(self) -> str:
        return f"Client({str(self.socket_path)!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Nothing to release (each call has its own connection); for symmetry with `with`."""

    def _ask(self, step: _Ask) -> Any:
        op = str(step.request.get("op"))
        s = _open_sync(self.socket_path, self._how, REQUEST_TIMEOUT_S)
        try:
            try:
                s.sendall(_encode(step.request))
            except OSError as exc:
                raise AgentError(f"the agent did not take the {op} request: {exc}") from None
            line = _receive_line_sync(s, _Lines(), step.timeout_s, f"waiting for the answer to {op}")
        finally:
            s.close()
        if line is _EOF:
            if step.eof_ok:
                return None
            raise AgentError(f"the agent closed the connection without answering {op} (is it stopping?)")
        return _checked(line, op)

    def _step(self, step: _Step) -> Any:
        if isinstance(step, _Ask):
            return self._ask(step)
        if isinstance(step, _Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, _Clock):
            return time.monotonic()
        if isinstance(step, _Blocking):
            return step.fn()
        raise AssertionError(f"a plan emitted {step!r} where no event is expected")

    def _run(self, plan: _Plan[T]) -> T:
        value: Any = None
        try:
            while True:
                try:
                    step = plan.send(value)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value = self._step(step)
        finally:
            plan.close()

    def status(self) -> Status:
        return self._run(_p_status())

    def members(self) -> tuple[Member, ...]:
        return self._run(_p_healthy(self.quorum_timeout)).members

    def ring(self) -> Ring:
        return self._run(_p_healthy(self.quorum_timeout)).ring or Ring(0, (), ())

    def placement(self) -> Placement:
        return self._run(_p_healthy(self.quorum_timeout)).placement or Placement(0, None, (), False)

    def load(self, model: str | os.PathLike[str], *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
             timeout: float = LOAD_TIMEOUT_S, on_progress: Callable[[LoadProgress], None] | None = None) -> LoadedModel:
        return self._run(_p_load(model, context_tokens, timeout, self.quorum_timeout, on_progress))

    def generate(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> Generation:
        fields = _generate_fields(prompt, max_tokens, temperature, top_p, seed)
        return Generation(self, _p_generate(fields, self.quorum_timeout))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> Generation:
        fields = _generate_fields("", max_tokens, temperature, top_p, seed)
        return Generation(self, _p_chat(messages, fields, self.quorum_timeout, self._model_root))

    def watch(self, *, interval: float = POLL_S) -> Iterator[Event]:
        plan = _p_watch(interval)
        value: Any = None
        try:
            while True:
                step = plan.send(value)
                if isinstance(step, _Emit):
                    value = None
                    yield step.event
                else:
                    value = self._step(step)
        finally:
            plan.close()

    def leave(self, *, timeout: float = 90.0) -> bool:
        return self._run(_p_leave(timeout))


class Generation:
    """The synchronous streaming generation: `for piece in gen`, then `gen.result`."""

    def __init__(self, client: Client, prepare: _Plan[dict[str, Any]]) -> None:
        self._client = client
        self._prepare: _Plan[dict[str, Any]] | None = prepare
        self._sock: stdsocket.socket | None = None
        self._lines = _Lines()
        self._decoder = _Decoder()
        self._finished = False

    @property
    def result(self) -> GenerationResult | None:
        return self._decoder.result

    def __iter__(self) -> Generation:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._finished = True
        if self._prepare is not None:
            self._prepare.close()
            self._prepare = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        try:
            if self._sock is None:
                assert self._prepare is not None
                request = self._client._run(self._prepare)
                self._prepare = None
                self._sock = _open_sync(self._client.socket_path, self._client._how, REQUEST_TIMEOUT_S)
                try:
                    self._sock.sendall(_encode(request))
                except OSError as exc:
                    raise AgentError(f"the agent did not take the generate request: {exc}") from None
            while True:
                event = _receive_line_sync(self._sock, self._lines, STREAM_IDLE_TIMEOUT_S, "generating")
                if event is _EOF:
                    raise AgentError("the agent closed the stream before the generation ended (did it stop?)")
                piece = self._decoder.feed(event)
                if self._decoder.result is not None:
                    self.close()
                    if piece:
                        return piece
                    raise StopIteration
                if piece:
                    return piece
        except BaseException:
            self.close()
            raise

    def collect(self) -> GenerationResult:
        for _ in self:
            pass
        if self._decoder.result is None:
            raise AgentError("the generation was closed before its end")
        return self._decoder.result


def connect(address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> Client:
    """The synchronous client of the agent at `address` (as open_client). Raises
    AgentNotRunning at once when no agent answers. Do not call it from the trio thread of
    an embedded Agent: it blocks, and that agent could not answer."""
    client = Client(address, quorum_timeout=quorum_timeout)
    client.status()
    return client


# ----------------------------------------------------------------------------------------
# An agent inside this program


_TUPLE_FIELDS = ("listen", "peers", "interfaces", "advertise")
_PATH_FIELDS = ("state_dir", "cluster_key_file", "model_root")


class Agent:
    """Run a p2pmesh agent inside this trio program: `async with p2pmesh.Agent(state_dir=...,
    listen=("0.0.0.0:7741",)) as agent:`. Keyword arguments are AgentConfig's fields (or
    pass `config=`). The agent runs until the block ends (then it stops, without leaving the
    cluster: call `await agent.client().leave()` first for that). It installs no signal
    handlers: the program owns them."""

    def __init__(self, config: AgentConfig | None = None, **fields: Any) -> None:
        from p2pmesh.agent import AgentConfig

        for name in _TUPLE_FIELDS:  # accept one address as a string, or a list
            if name in fields:
                v = fields[name]
                fields[name] = (v,) if isinstance(v, str) else tuple(v)
        for name in _PATH_FIELDS:
            if fields.get(name) is not None:
                fields[name] = Path(fields[name]).expanduser()
        try:
            self.config: AgentConfig = dataclasses.replace(config, **fields) if config is not None else AgentConfig(**fields)
        except TypeError as exc:
            raise BadRequest(f"p2pmesh.Agent takes AgentConfig's fields: {exc}") from None
        self._agent: _CoreAgent | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def socket_path(self) -> Path:
        return self.config.socket_path

    @property
    def node_id(self) -> str:
        if self._agent is None:
            raise P2PMeshError("the agent is not running: use it as `async with p2pmesh.Agent(...) as agent`")
        return str(self._agent.identity.node_id)

    @property
    def running(self) -> bool:
        return self._agent is not None and not self._agent.left.is_set()

    def client(self, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> AsyncClient:
        """An async client of this agent (no need to enter it)."""
        return AsyncClient(self.socket_path, quorum_timeout=quorum_timeout, _model_root=self.config.model_root)

    async def __aenter__(self) -> Self:
        from p2pmesh.agent import Agent as CoreAgent

        if self._stack is not None:
            raise P2PMeshError("this p2pmesh.Agent is already running")
        agent = CoreAgent(self.config)  # opens the state directory: StateCorrupted surfaces here
        stack = contextlib.AsyncExitStack()
        stack.callback(agent.storage.close)  # last, once the nursery has stopped every task
        self._stack, self._agent = stack, agent
        try:
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            await self._nursery.start(agent.run)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        stack, nursery = self._stack, self._nursery
        assert stack is not None
        self._stack = self._nursery = self._agent = None
        if nursery is not None:
            nursery.cancel_scope.cancel()  # stops the agent: its workers, control socket, links
        try:
            return bool(await stack.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            # trio wraps even a single error of the body in a group; give it back plain.
            leaves = _leaves(group)
            if len(leaves) == 1:
                raise leaves[0] from None
            raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


__all__ = [
    "Agent",
    "AgentError",
    "AgentNotRunning",
    "AsyncClient",
    "AsyncGeneration",
    "BadRequest",
    "Client",
    "Event",
    "EventKind",
    "Generation",
    "GenerationResult",
    "Hop",
    "LoadProgress",
    "LoadedModel",
    "Member",
    "ModelCannotLoad",
    "ModelDoesNotFit",
    "ModelNotLoaded",
    "ModelRefused",
    "NoQuorum",
    "P2PMeshError",
    "PendingPlacement",
    "Placement",
    "PlacementProblem",
    "Port",
    "Ring",
    "StageInfo",
    "Status",
    "connect",
    "fallback_chat_prompt",
    "open_client",
]
