"""A graceful leave, one decision at a time: what a member that was asked to leave does
next, from its Raft state (pure; core/machine.py carries the step out).

Make before break: a Mac holding model layers first asks the cluster to plan without it
(Drain) and waits, within its drain time, for the new placement, and for a pending placement
to have its files (the Macs taking layers may be copying them from it, or waiting for its
download from the hub); a leader hands its
leadership to the most caught-up voter; then the member's removal is proposed (or forwarded
to the leader) and the leave ends when the cluster confirms it, or at the deadline, after
which the cluster treats the Mac as it treats a crash.
"""
from __future__ import annotations

import enum

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import ClusterState, Measure, Peer
from p2pmesh.core.raft import Raft, Role


class LeaveStep(enum.Enum):
    WAIT = "wait"
    """Nothing to do on this input: the next one (a timer, an applied entry) decides."""
    TIMED_OUT = "timed out"
    """No leader confirmed in time: stop anyway (the cluster removes us as after a crash)."""
    FINISH = "finish"
    """Nothing to leave, or we were the last voter: stop, unconfirmed."""
    FINISH_CONFIRMED = "finish confirmed"
    """Our removal is in effect: stop, confirmed by the cluster."""
    DRAIN = "drain"
    """Ask the cluster to place the model without us, and keep serving meanwhile."""
    TRANSFER = "transfer"
    """We lead: hand leadership to the most caught-up other voter."""
    REMOVE_SELF = "remove self"
    """We lead and no other voter remains: propose our own removal."""
    FORWARD_REMOVE = "forward remove"
    """We follow: send our removal to the leader."""


def holds_layers(state: ClusterState, node_id: NodeId) -> bool:
    """Whether the serving or the pending placement gives this node model layers, or a
    pending placement still fetches the files of the model this node has (it measured it):
    the Macs taking the layers may be copying them from here, or waiting for its download
    from the hub. A leave hands both over first (within its drain time)."""
    if any(s.node_id == node_id for s in (*state.active, *state.placement)):
        return True
    name = state.model.name if state.model is not None else None
    has_model = any(m.node_id == node_id and isinstance(m.measure, Measure) and m.measure.model == name
                    for m in state.members)
    fetching = state.placement_epoch > state.active_epoch and any(s.node_id not in state.fetched for s in state.placement)
    return has_model and fetching


def next_step(r: Raft, me: Peer, *, joining: bool, holds_layers: bool, draining: bool,
              now_ms: int, deadline_ms: int, drain_until_ms: int) -> LeaveStep:
    """The next step of a leave (``draining``: the Drain is committed already)."""
    if now_ms >= deadline_ms:
        return LeaveStep.TIMED_OUT
    still_member = any(p.node_id == me.node_id for p in (*r.config.voters, *r.config.learners))
    if not still_member and joining:
        # Still joining: the leader may already have added us without our knowing yet.
        # Leaving silently would leave a member behind that is down until removed minutes
        # later; wait for the log (or the deadline) and then leave properly.
        return LeaveStep.WAIT
    if not still_member:
        # Our removal is in our log, but a config entry takes effect when appended, so it
        # may not be committed yet: stopping now could leave a departed voter in the
        # configuration. The leader's RemovalNotice (sent when the removal commits) or
        # applying the removal ourselves ends the leave; the deadline bounds the wait.
        # (A leader outside its own configuration was the last voter: nobody confirms.)
        if r.role is not Role.LEADER and any(m.node_id == me.node_id and m.inc == me.inc for m in r.state.members):
            return LeaveStep.WAIT
        return LeaveStep.FINISH_CONFIRMED if r.role is not Role.LEADER else LeaveStep.FINISH
    if len(r.config.voters) <= 1 and not r.config.learners:
        return LeaveStep.FINISH
    if holds_layers and now_ms < drain_until_ms:
        return LeaveStep.WAIT if draining else LeaveStep.DRAIN
    if r.role is Role.LEADER:
        others = [p for p in r.config.voters if p != me]
        if others:
            return LeaveStep.TRANSFER if r.transfer_to is None else LeaveStep.WAIT
        return LeaveStep.REMOVE_SELF
    return LeaveStep.FORWARD_REMOVE if r.leader is not None else LeaveStep.WAIT


def transfer_target(r: Raft, me: Peer) -> Peer:
    """The other voter with the most of the log (ties: the highest node id)."""
    others = [p for p in r.config.voters if p != me]
    return max(others, key=lambda p: (r.progress[p].match if p in r.progress else -1, p.node_id))
