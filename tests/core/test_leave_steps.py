"""A graceful leave's next step (core/leave.py), decided from a real Raft in a formed cluster;
the whole leave, step after step, is tested in test_leave_confirmed.py and the simulator."""
from __future__ import annotations

from p2pmesh.core.leave import LeaveStep, next_step, transfer_target
from p2pmesh.core.machine import Machine
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
