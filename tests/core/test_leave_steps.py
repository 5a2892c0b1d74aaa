"""A graceful leave's next step (core/leave.py), decided from a real Raft in a formed cluster;
the whole leave, step after step, is tested in test_leave_confirmed.py and the simulator."""
from __future__ import annotations

import dataclasses

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.leave import LeaveStep, holds_layers, next_step, transfer_target
from p2pmesh.core.machine import Machine
from p2pmesh.core.messages import Capabilities, ClusterState, Measure, Member, ModelInfo, Stage
from tests.core.test_machine import a_follower, formed, leader_of


def _step(m: Machine, *, now_ms: int = 0, deadline_ms: int = 10_000, drain_until_ms: int = 5_000,
          holds_layers: bool = False, draining: bool = False, joining: bool = False) -> LeaveStep:
    assert m.raft is not None
    return next_step(m.raft, m.me, joining=joining, holds_layers=holds_layers, draining=draining,
                     now_ms=now_ms, deadline_ms=deadline_ms, drain_until_ms=drain_until_ms)


def test_a_follower_forwards_its_removal_and_the_deadline_ends_any_leave() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    assert _step(f) is LeaveStep.FORWARD_REMOVE
    assert _step(f, now_ms=10_000) is LeaveStep.TIMED_OUT
    assert _step(leader_of(d), now_ms=10_001) is LeaveStep.TIMED_OUT


def test_a_mac_with_layers_drains_first_then_leaves_when_its_drain_time_is_over() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    assert _step(f, holds_layers=True) is LeaveStep.DRAIN
    assert _step(f, holds_layers=True, draining=True) is LeaveStep.WAIT
    assert _step(f, holds_layers=True, draining=True, now_ms=5_000) is LeaveStep.FORWARD_REMOVE


def test_a_leader_hands_over_to_the_most_caught_up_voter_once() -> None:
    d, _ = formed(3)
    leader = leader_of(d)
    r = leader.raft
    assert r is not None
    assert _step(leader) is LeaveStep.TRANSFER
    target = transfer_target(r, leader.me)
    assert target != leader.me and target in r.config.voters
    r.transfer_leadership(target, 0)
    assert _step(leader) is LeaveStep.WAIT  # one hand-over at a time


def test_the_last_voter_finishes_unconfirmed() -> None:
    d, _ = formed(1)
    assert _step(leader_of(d)) is LeaveStep.FINISH


def test_what_a_leaving_mac_hands_over_first() -> None:
    """Its layers (serving or pending); and while a pending placement still fetches, the
    files of the model it has (it measured it): the others may be copying them from it."""
    a, b, c = NodeId("a"), NodeId("b"), NodeId("c")
    caps = Capabilities(1 << 30, "m")
    measured = Measure("m", 1 << 30, 1.0)
    members = tuple(Member(n, 1, True, True, (), caps, measure=measured if n != c else None) for n in (a, b, c))
    state = ClusterState(ClusterId("x"), members, 1, (a, b, c), (), model=ModelInfo("m", 4, 10, 1, 8, 4, 10),
                         placement_epoch=1, placement=(Stage(a, 0, 4),))
    assert holds_layers(state, a)  # its layers
    assert holds_layers(state, b)  # has the model, and a's stage has not its files yet
    assert not holds_layers(state, c)  # never measured it: nothing anyone copies from it
    fetched = dataclasses.replace(state, fetched=(a,))
    assert holds_layers(fetched, a) and not holds_layers(fetched, b)
