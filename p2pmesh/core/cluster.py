"""The replicated cluster state and the pure functions that apply log commands to it.

Two views are derived from the same log:
- the Raft configuration (voters and learners), which takes effect when a config command
  is *appended* (apply_config_command, used by log.py);
- the cluster state (members with addresses, capabilities and up/down, the ring, user
  keys), which changes when a command is *applied* after commit (apply_command).
Both are plain functions of immutable values, so any node (and the simulator's checker)
replaying the same log gets the same result.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, TypeVar

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import (
    ActivatePlacement,
    AddLearner,
    ClusterState,
    Drain,
    Command,
    Config,
    MarkDown,
    MarkUp,
    Member,
    Noop,
    Peer,
    Promote,
    MeasureFailed,
    PublishMeasure,
    PublishPorts,
    Put,
    RemoveMember,
    SetModel,
    SetPlacement,
    SetRing,
    UpdateMember,
    WorkerFailed,
    WorkerReady,
    StageFetched,
)

KV_KEYS_MAX = 4096
_T = TypeVar("_T")


def empty_state(cluster_id: ClusterId) -> ClusterState:
    return ClusterState(cluster_id=cluster_id, members=(), ring_epoch=0, ring=(), kv=())


def apply_config_command(config: Config, cmd: Command) -> Config:
    """The configuration after a config command (AddLearner, Promote, RemoveMember)."""
    peer = Peer(cmd.node_id, cmd.inc)  # type: ignore[union-attr]
    if isinstance(cmd, AddLearner) and peer in config.voters:
        return config  # already a voter: adding it as a learner must not demote or drop it
    voters = [p for p in config.voters if p != peer]
    learners = [p for p in config.learners if p != peer]
    if isinstance(cmd, AddLearner):
        if peer not in config.voters:
            learners.append(peer)
    elif isinstance(cmd, Promote):
        if peer in config.learners or peer in config.voters:
            voters.append(peer)
    # RemoveMember: already filtered out of both.
    return Config(voters=tuple(sorted(voters, key=_peer_key)), learners=tuple(sorted(learners, key=_peer_key)))


def _peer_key(p: Peer) -> tuple[str, int]:
    return (p.node_id, p.inc)


def config_of(state: ClusterState) -> Config:
    """The configuration the members of a state imply (used when forming and forking)."""
    voters = tuple(sorted((Peer(m.node_id, m.inc) for m in state.members if m.voter), key=_peer_key))
    learners = tuple(sorted((Peer(m.node_id, m.inc) for m in state.members if not m.voter), key=_peer_key))
    return Config(voters=voters, learners=learners)


def find_member(state: ClusterState, node_id: NodeId) -> Member | None:
    for m in state.members:
        if m.node_id == node_id:
            return m
    return None


def apply_command(state: ClusterState, cmd: Command) -> ClusterState:
    """The cluster state after one committed command. Commands that no longer make sense
    (a member already gone, a stale incarnation) leave the state unchanged."""
    if isinstance(cmd, Noop):
        return state
    if isinstance(cmd, Put):  # (first: the simulator's clients write every 50 ms)
        return _replace(state, kv=_put(state.kv, cmd.key, cmd.value))
    if isinstance(cmd, AddLearner):
        others = tuple(m for m in state.members if m.node_id != cmd.node_id)
        member = Member(cmd.node_id, cmd.inc, voter=False, up=True, addresses=cmd.addresses, caps=cmd.caps)
        return _replace(state, members=_sorted(others + (member,)))
    if isinstance(cmd, RemoveMember):
        members = tuple(m for m in state.members if not (m.node_id == cmd.node_id and m.inc == cmd.inc))
        # The ring keeps its epoch and order minus the node; the leader proposes a new one.
        ring = tuple(n for n in state.ring if n != cmd.node_id)
        hops = tuple(h for h in state.ring_hops if cmd.node_id not in (h.src, h.dst))
        ready = tuple(n for n in state.ready if n != cmd.node_id)
        fetched = tuple(n for n in state.fetched if n != cmd.node_id)
        draining = tuple(n for n in state.draining if n != cmd.node_id)
        return _replace(state, members=members, ring=ring, ring_hops=hops, ready=ready, fetched=fetched, draining=draining)
    if isinstance(cmd, (Promote, MarkDown, MarkUp, UpdateMember, PublishPorts, PublishMeasure)):
        return _replace(state, members=tuple(_update_member(m, cmd) for m in state.members))
    if isinstance(cmd, SetRing):
        if cmd.epoch <= state.ring_epoch:
            return state  # a stale proposal from an earlier leader
        return _replace(state, ring_epoch=cmd.epoch, ring=cmd.order, ring_hops=cmd.hops)
    if isinstance(cmd, Drain):
        member = find_member(state, cmd.node_id)
        if member is None or member.inc != cmd.inc or cmd.node_id in state.draining:
            return state
        return _replace(state, draining=tuple(sorted((*state.draining, cmd.node_id))))
    if isinstance(cmd, (SetModel, SetPlacement, WorkerReady, ActivatePlacement, WorkerFailed, StageFetched)):
        return _apply_dataplane(state, cmd)
    raise AssertionError(f"unknown command {cmd!r}")


def _apply_dataplane(
    state: ClusterState, cmd: SetModel | SetPlacement | WorkerReady | ActivatePlacement | WorkerFailed | StageFetched
) -> ClusterState:
    """The model and the data-plane epochs (core/dataplane.py decides; this only records).
    A placement starts pending; it serves once ActivatePlacement commits (make before
    break), except an empty one (serve nothing), which takes effect at once."""
    if isinstance(cmd, SetModel):
        # A model set again is tried again where it could not be loaded (its files may have
        # been fixed): those members measure it afresh (core/fit.py waits for them).
        members = tuple(_replace(m, measure=None) if isinstance(m.measure, MeasureFailed) else m for m in state.members)
        return _replace(state, model=cmd.model, members=members, fault=None)
    if isinstance(cmd, SetPlacement):
        if cmd.epoch <= state.placement_epoch:
            return state  # a stale proposal from an earlier leader
        state = _replace(
            state,
            placement_epoch=cmd.epoch,
            placement=cmd.stages,
            placement_ring_epoch=cmd.ring_epoch,
            placement_hops=cmd.hops,
            placement_batch=cmd.batch,
            placement_kv_bits=cmd.kv_bits,
            ready=(),
            fetched=(),
            restarts=state.restarts + 1 if cmd.restart else 0,
        )
        if not cmd.stages:
            state = _replace(state, active_epoch=cmd.epoch, active=(), active_hops=(), active_batch=cmd.batch,
                             active_kv_bits=cmd.kv_bits)
        return state
    if isinstance(cmd, WorkerFailed):
        member = find_member(state, cmd.node_id)
        if member is None or member.inc != cmd.inc or cmd.epoch not in (state.active_epoch, state.placement_epoch):
            return state
        fault = cmd.fault if cmd.fault is not None and cmd.epoch >= state.failed_epoch else state.fault
        return _replace(state, failed_epoch=max(state.failed_epoch, cmd.epoch), fault=fault)
    if isinstance(cmd, (WorkerReady, StageFetched)):
        member = find_member(state, cmd.node_id)
        staged = any(s.node_id == cmd.node_id for s in state.placement)
        if cmd.epoch != state.placement_epoch or member is None or member.inc != cmd.inc or not staged:
            return state
        if isinstance(cmd, StageFetched):
            return state if cmd.node_id in state.fetched else _replace(state, fetched=tuple(sorted((*state.fetched, cmd.node_id))))
        if cmd.node_id in state.ready:
            return state
        return _replace(state, ready=tuple(sorted((*state.ready, cmd.node_id))))
    if cmd.epoch != state.placement_epoch or cmd.epoch <= state.active_epoch:
        return state
    # Serving again: the last fault is history.
    return _replace(state, active_epoch=cmd.epoch, active=state.placement, active_hops=state.placement_hops,
                    active_batch=state.placement_batch, active_kv_bits=state.placement_kv_bits, fault=None)


def _update_member(m: Member, cmd: Promote | MarkDown | MarkUp | UpdateMember | PublishPorts | PublishMeasure) -> Member:
    if m.node_id != cmd.node_id or m.inc != cmd.inc:
        return m
    if isinstance(cmd, Promote):
        return _replace(m, voter=True)
    if isinstance(cmd, MarkDown):
        return _replace(m, up=False)
    if isinstance(cmd, MarkUp):
        return _replace(m, up=True)
    if isinstance(cmd, PublishPorts):
        return _replace(m, ports=cmd.ports, probes=cmd.probes)
    if isinstance(cmd, PublishMeasure):
        return _replace(m, measure=cmd.measure)
    return _replace(m, addresses=cmd.addresses, caps=cmd.caps)


_COPIERS: dict[type, Callable[[Any, dict[str, Any]], Any]] = {}
"""Per class: the function _replace copies its values with (made by _copier)."""


def _replace(value: _T, **changes: Any) -> _T:
    """dataclasses.replace for the frozen, slotted values of messages.py (none has a
    __post_init__), about six times as fast: every member applies every command, and a
    Put copies the whole ClusterState (20 fields)."""
    copy = _COPIERS.get(type(value))
    if copy is None:
        copy = _COPIERS[type(value)] = _copier(type(value))
    return copy(value, changes)  # type: ignore[no-any-return]


def _copier(cls: type) -> Callable[[Any, dict[str, Any]], Any]:
    """A copy function for ``cls``, generated once as dataclasses generates __init__: one
    line per field that stores the old value through the field's slot (a frozen class
    refuses plain assignment), then the changed fields. A loop over the fields costs
    half as much again."""
    names = [f.name for f in dataclasses.fields(cls)]  # identifiers: safe to generate code from
    setters = {name: getattr(cls, name).__set__ for name in names}
    source = "\n".join([
        "def copy(value, changes):",
        "    new = new_object(cls)",
        *(f"    set_{name}(new, value.{name})" for name in names),
        "    for name, changed in changes.items():",
        "        setter = setters.get(name)",
        "        if setter is None:",
        "            raise TypeError(f'{cls.__name__} has no field {name!r}')",
        "        setter(new, changed)",
        "    return new",
    ])
    namespace: dict[str, Any] = {"new_object": object.__new__, "cls": cls, "setters": setters,
                                 **{f"set_{name}": setter for name, setter in setters.items()}}
    exec(source, namespace)  # noqa: S102 (our own source, from the class's field names)
    return namespace["copy"]  # type: ignore[no-any-return]


def _put(kv: tuple[tuple[str, str], ...], key: str, value: str) -> tuple[tuple[str, str], ...]:
    """kv (sorted by key, keys unique) with key set to value; a new key only below
    KV_KEYS_MAX. A binary search, not a sort: every member applies every Put."""
    i = bisect_left(kv, (key,))
    if i < len(kv) and kv[i][0] == key:
        return (*kv[:i], (key, value), *kv[i + 1 :])
    if len(kv) >= KV_KEYS_MAX:
        return kv
    return (*kv[:i], (key, value), *kv[i:])


def _sorted(members: tuple[Member, ...]) -> tuple[Member, ...]:
    return tuple(sorted(members, key=lambda m: m.node_id))
