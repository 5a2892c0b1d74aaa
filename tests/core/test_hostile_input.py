"""Hostile input to a member of a formed cluster: never a crash, and a rejected frame
changes nothing.

Messages are generated from the wire schema itself (every registered type, recursively,
with numbers and ids drawn to hit edges: zero, negatives, huge, the real ids of the cluster),
encoded, and fed as frames from an authenticated peer.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pmesh.core import messages, wire
from p2pmesh.core.machine import FrameReceived, Machine
from p2pmesh.core.wire import INT_MAX, INT_MIN
from sim.world import World


def _formed_world() -> World:
    w = World(3, nodes=3)
    for n in w.nodes:
        w.boot(n)
    assert w.run_until(5_000_000, stop=w.converged)
    return w


WORLD = _formed_world()
IDS = [n.node_id for n in WORLD.nodes]
INCS = [n.machine.inc for n in WORLD.nodes if n.machine]
CLUSTER = WORLD.nodes[0].machine.cluster if WORLD.nodes[0].machine else ""

_ints = st.one_of(
    st.integers(-3, 8), st.sampled_from(INCS), st.integers(INT_MIN, INT_MAX), st.just(INT_MAX)
)
_strs = st.one_of(st.sampled_from(IDS + [CLUSTER or "", ""]), st.text(max_size=40))


def _strategy(hint: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    while hasattr(hint, "__supertype__"):
        hint = hint.__supertype__
    if hint is int:
        return _ints
    if hint is bool:
        return st.booleans()
    if hint is float:
        return st.floats(allow_nan=True, allow_infinity=True)
    if hint is str:
        return _strs
    if hint is bytes:
        return st.binary(max_size=16)
    if hint is type(None):
        return st.none()
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0], depth + 1), max_size=0 if depth > 3 else 4).map(tuple)
        return st.tuples(*[_strategy(a, depth + 1) for a in args])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_strategy(a, depth + 1) for a in typing.get_args(hint)])
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return st.builds(hint, **{f.name: _strategy(hints[f.name], depth + 1) for f in dataclasses.fields(hint)})
    raise AssertionError(f"no strategy for {hint!r}")


MESSAGE = _strategy(messages.Message)


def _fingerprint(m: Machine) -> tuple[Any, ...]:
    r = m.raft
    assert r is not None
    return (m.mode, m.inc, r.cluster, r.term, r.vote, r.role, r.commit, r.applied, r.log.last_index, r.state)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=MESSAGE, peer_index=st.integers(0, 2), target_index=st.integers(0, 2))
def test_generated_messages_never_crash_a_member(msg: Any, peer_index: int, target_index: int) -> None:
    target = WORLD.nodes[target_index].machine
    assert target is not None
    peer = IDS[peer_index]
    before = _fingerprint(target)
    rejected = target.rejected_frames
    data = wire.encode(msg)
    target.handle(FrameReceived(peer, data), WORLD.now_ms)
    r = target.raft
    assert r is not None
    assert r.applied == r.commit <= r.log.last_index
    assert r.term >= before[3]
    if target.rejected_frames > rejected:
        assert _fingerprint(target) == before


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_frames_are_counted_and_change_nothing(data: bytes) -> None:
    target = WORLD.nodes[1].machine
    assert target is not None
    before = _fingerprint(target)
    rejected = target.rejected_frames
    try:
        wire.decode(data)
        decodes = True
    except Exception:
        decodes = False
    target.handle(FrameReceived(IDS[0], data), WORLD.now_ms)
    if not decodes:
        assert target.rejected_frames == rejected + 1
        assert _fingerprint(target) == before


def test_a_peer_claiming_another_id_is_refused() -> None:
    w = _formed_world()
    leader = w.leader()
    assert leader is not None and leader.machine is not None and leader.machine.raft is not None
    follower = next(n for n in w.nodes if n is not leader)
    impostor = next(n for n in w.nodes if n is not leader and n is not follower)
    lr = leader.machine.raft
    forged = messages.AppendEntries(
        lr._hdr(messages.Peer(follower.node_id, follower.machine.inc)),  # type: ignore[union-attr]
        lr.log.last_index, lr.log.last_term, (), lr.commit, 0,
    )
    m = follower.machine
    assert m is not None
    before = _fingerprint(m)
    m.handle(FrameReceived(impostor.node_id, wire.encode(forged)), w.now_ms)
    assert m.rejected_frames == 1 and _fingerprint(m) == before
