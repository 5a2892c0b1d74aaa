"""What only the leader decides, after every input while it leads: promote caught-up
learners, mark members down and up, remove the long-silent ones, and negotiate the ring and
the placement. Each decision is a proposal, made at most once while it is in flight.

The node machine (core/machine.py) owns one ``LeaderDuties`` and calls ``run`` after each
input when its Raft leads; the state here (proposals in flight, the ring plan being solved)
belongs to one term of leadership and is reset by ``became_leader``.
"""
from __future__ import annotations

from collections.abc import Generator

from p2pmesh.core import dataplane, fit, physical
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Command, MarkDown, MarkUp, Peer, Promote, RemoveMember
from p2pmesh.core.raft import Raft
from p2pmesh.core.settings import Settings

_NOTHING_CHECKED = (-1, -1)


class LeaderDuties:
    """The leader's proposals (see the module comment). Subclass and set
    ``Machine.leader_class`` to plant a bug in them (sim/plants.py, tests/sim)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.since_ms = 0
        """When this node last became leader: silence is counted from then at the latest."""
        self.inflight: dict[tuple[str, str], int] = {}
        """Log index of each (command type, node id) proposed and not yet applied."""
        self.ring_checked_at = _NOTHING_CHECKED
        """(term, applied index) at which the ring was last compared (solving is the
        costliest pure step, so it runs once per state change, not per input)."""
        self.ring_settled: tuple[object, ...] | None = None
        """The inputs of physical.negotiate (members, ring, hops) when it last found nothing
        to propose: a pure function, so the same inputs need no new solve (most applied
        entries change neither)."""
        self.ring_plan: tuple[tuple[tuple[object, ...], ...], physical.RingPlan | None] | None = None
        """(physical.plan_inputs, physical.plan_ring) of the last solve, kept while its inputs stay."""
        self.ring_solving: tuple[tuple[tuple[object, ...], ...], Generator[None, None, physical.RingPlan | None]] | None = None
        """A solve spread over several steps (physical.plan_ring_steps): its inputs, its rest."""
        self.placement_checked_at = _NOTHING_CHECKED
        self.measure_wait: tuple[object, int] | None = None
        """(the model, since when) the first placement has been waiting for measurements."""
        self._quiet_members: tuple[object, ...] = (None, None, None, 0)
        """(members, last_heard, since_ms, until_ms): silence detection found nothing to do
        for these members, and cannot before until_ms (``detect``)."""

    def became_leader(self, now_ms: int) -> None:
        self.since_ms = now_ms
        self.inflight = {}
        self.ring_checked_at = _NOTHING_CHECKED

    def in_flight(self, r: Raft, key: tuple[str, str]) -> bool:
        index = self.inflight.get(key)
        return index is not None and index > r.applied and r.log.last_index >= index

    def propose_once(self, r: Raft, command: Command, now_ms: int) -> bool:
        """Propose unless the same command is already in flight (not yet applied)."""
        key = (type(command).__name__, getattr(command, "node_id", ""))
        if self.in_flight(r, key):
            return True
        index = r.propose(command, now_ms)
        if index is None:
            return False
        self.inflight[key] = index
        return True

    def run(self, r: Raft, me: Peer, last_heard: dict[NodeId, int], now_ms: int) -> None:
        self.negotiate_ring(r, now_ms)
        self.negotiate_placement(r, now_ms)
        if not r.config_change_allowed() or r.transfer_to is not None:
            self.detect(r, me, last_heard, now_ms, config_ok=False)
            return
        # Promote one caught-up learner at a time.
        for peer in r.config.learners:
            pr = r.progress.get(peer)
            if pr is not None and pr.match >= r.commit - self.settings.promote_lag_entries and pr.match > 0:
                if self.propose_once(r, Promote(peer.node_id, peer.inc), now_ms):
                    return
        self.detect(r, me, last_heard, now_ms, config_ok=True)

    def detect(self, r: Raft, me: Peer, last_heard: dict[NodeId, int], now_ms: int, *, config_ok: bool) -> None:
        """Failure detection: down after ``down_after_ms`` of silence, up when heard again,
        removed after ``remove_after_ms`` when the rest keeps a quorum."""
        members = r.state.members
        quiet = self._quiet_members
        if members is quiet[0] and last_heard is quiet[1] and self.since_ms == quiet[2] and now_ms < quiet[3]:
            return  # (checked after every input of the leader; last_heard only grows in place)
        s = self.settings
        silent_max_ms = 0
        for member in members:
            if member.node_id == me.node_id:
                if not member.up and member.inc == me.inc:
                    self.propose_once(r, MarkUp(member.node_id, member.inc), now_ms)  # marked down by a predecessor
                continue
            heard = last_heard.get(member.node_id)
            silent_ms = now_ms - max(self.since_ms if heard is None else heard, self.since_ms)
            silent_max_ms = max(silent_max_ms, silent_ms)
            if member.up and silent_ms >= s.down_after_ms:
                self.propose_once(r, MarkDown(member.node_id, member.inc), now_ms)
            elif not member.up and heard is not None and now_ms - heard < s.down_after_ms:
                # Up when heard again. Silence counted from this election at the latest only
                # delays marking members down: counted for marking up, each new leader would
                # mark a dead Mac up (and the placement take it back) until it is down again.
                self.propose_once(r, MarkUp(member.node_id, member.inc), now_ms)
            elif config_ok and not member.up and silent_ms >= s.remove_after_ms and removal_keeps_quorum(r, me.node_id, member.node_id):
                if self.propose_once(r, RemoveMember(member.node_id, member.inc, "unreachable"), now_ms):
                    config_ok = False
        if silent_max_ms < s.down_after_ms and all(m.up for m in members):
            # Every member up and none silent for down_after_ms: nothing to propose until the
            # most silent one gets there, unless the members or what was heard change.
            self._quiet_members = (members, last_heard, self.since_ms, now_ms + s.down_after_ms - silent_max_ms)

    def negotiate_ring(self, r: Raft, now_ms: int) -> None:
        """Propose a new ring epoch when members, cables or addresses changed."""
        if r.transfer_to is not None or ((r.term, r.applied) == self.ring_checked_at and self.ring_solving is None):
            return
        if self.in_flight(r, ("SetRing", "")):
            return  # one ring change at a time: the next is computed from its result
        self.ring_checked_at = (r.term, r.applied)
        inputs = (r.state.members, r.state.ring, r.state.ring_hops)
        if inputs == self.ring_settled:
            self.ring_solving = None
            return
        used = physical.plan_inputs(r.state)
        if self.ring_plan is None or self.ring_plan[0] != used:
            if self.ring_solving is None or self.ring_solving[0] != used:
                self.ring_solving = (used, physical.plan_ring_steps(r.state))  # the costly part: the solve
            try:
                next(self.ring_solving[1])
                return  # one slice per step: the next step goes on, heartbeats keep flowing
            except StopIteration as done:
                self.ring_plan, self.ring_solving = (used, done.value), None
        proposal = physical.negotiate(r.state, self.ring_plan[1])
        if proposal is None:
            self.ring_settled = inputs
        elif not self.propose_once(r, proposal, now_ms):
            self.ring_checked_at = _NOTHING_CHECKED  # not accepted now (e.g. log full): retry

    def negotiate_placement(self, r: Raft, now_ms: int) -> None:
        """Propose the next data-plane step (a new placement, or activating the pending
        one) when the committed state calls for it (core/dataplane.py)."""
        if r.transfer_to is not None or (r.term, r.applied) == self.placement_checked_at or self.ring_solving is not None:
            return  # (a ring being solved may change the placement: wait for it as for a SetRing)
        if any(self.in_flight(r, key) for key in (("SetPlacement", ""), ("ActivatePlacement", ""), ("SetRing", ""))):
            return  # one data-plane step at a time, and after the ring settles
        if self.awaiting_measurements(r, now_ms):
            return  # (looked at again on the next input: heartbeats come every heartbeat_ms)
        self.placement_checked_at = (r.term, r.applied)
        proposal = dataplane.negotiate(r.state)
        if proposal is not None and not self.propose_once(r, proposal, now_ms):
            self.placement_checked_at = _NOTHING_CHECKED

    def awaiting_measurements(self, r: Raft, now_ms: int) -> bool:
        """While nothing serves, hold the first placement of a model for the candidates'
        measurements still to come, for at most measure_grace_ms after this leader first saw
        some missing (Settings says why). Serving clusters re-plan at once: a Mac that died
        cannot wait, and one that joins is planned in once it has measured."""
        state = r.state
        if state.active or not fit.measurements_awaited(state):
            self.measure_wait = None
            return False
        if self.measure_wait is None or self.measure_wait[0] != state.model:
            self.measure_wait = (state.model, now_ms)
        return now_ms - self.measure_wait[1] < self.settings.measure_grace_ms


def removal_keeps_quorum(r: Raft, self_id: NodeId, node_id: NodeId) -> bool:
    """Whether the voters left after removing ``node_id`` still have a quorum that is up."""
    voters = [p for p in r.config.voters if p.node_id != node_id]
    if len(voters) == len(r.config.voters):
        return True  # a learner: always safe to remove
    up = {m.node_id for m in r.state.members if m.up}
    up.add(self_id)
    live = sum(1 for p in voters if p.node_id in up)
    return len(voters) >= 1 and live >= len(voters) // 2 + 1
