"""This Mac's local facts and their publication into the committed cluster state.

A member knows things about itself that the cluster needs from the log: its addresses and
capabilities, its ports and cable probes, its measurement of the model, and what its
data-plane worker did (stage files fetched, worker ready, worker failed). The drivers report
them as inputs; after every input the machine compares each with the member's committed
record and proposes an update where they differ. One rule covers them all: the local fact
differs from the committed one, so propose it, and again after ``hello_ms`` while it still
differs (a proposal can be lost with a leader), never more often.
"""
from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

from p2pmesh.core.cluster import find_member
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import (
    Capabilities,
    ClusterState,
    Command,
    LinkProbe,
    Measure,
    MeasureFailed,
    Member,
    PortInfo,
    PublishMeasure,
    PublishPorts,
    StageFetched,
    UpdateMember,
    WorkerFailed,
    WorkerFault,
    WorkerReady,
)
from p2pmesh.core.raft import Raft

EPOCHS_KEPT = 3
"""Data-plane epochs remembered per kind of worker report (the current one and two before)."""


@dataclass(slots=True)
class LocalFacts:
    """What this Mac knows about itself (from its drivers), newest first."""

    addresses: tuple[str, ...]
    caps: Capabilities
    ports: tuple[PortInfo, ...] = ()
    probes: tuple[LinkProbe, ...] = ()
    measure: Measure | MeasureFailed | None = None
    fetched: set[int] = field(default_factory=set)
    """Data-plane epochs whose stage files the driver reported on disk."""
    loaded: set[int] = field(default_factory=set)
    """Data-plane epochs whose local worker reported ready."""
    crashed: set[int] = field(default_factory=set)
    """Data-plane epochs whose local worker died or hung."""
    faults: dict[int, WorkerFault] = field(default_factory=dict)
    """Why a crashed epoch's worker failed, when it said (bounded like ``crashed``)."""

    def worker_event(self, kind: str, epoch: int, fault: WorkerFault | None = None) -> None:
        """Record a worker report for ``epoch`` ("fetched", "loaded" or "crashed")."""
        oldest = epoch - (EPOCHS_KEPT - 1)
        kept = {e for e in getattr(self, kind) if e >= oldest} | {epoch}
        setattr(self, kind, kept)
        if kind == "crashed" and fault is not None:
            self.faults = {e: f for e, f in self.faults.items() if e >= oldest} | {epoch: fault}


class Publisher:
    """Proposes this member's facts where its committed record differs (the one rule of the
    module comment). ``membership`` covers addresses, capabilities, ports and probes;
    ``data_plane`` the measurement and the worker reports."""

    def __init__(self, node_id: NodeId, hello_ms: int) -> None:
        self.node_id = node_id
        self.hello_ms = hello_ms
        self._sent: dict[str, tuple[object, int]] = {}
        self._failure_committed = False
        """Our MeasureFailed was committed (cluster.py may then forget it, see data_plane)."""
        self._up_to_date: tuple[object, ...] = (None,) * 6
        """(committed state, incarnation, addresses, caps, ports, probes) when the committed
        member last matched the local facts: nothing to publish while they stay the same."""

    def commands(self, facts: LocalFacts, r: Raft, inc: int, now_ms: int) -> Iterator[Command]:
        """What to propose, one command at a time: the caller proposes each before the next
        is made (a one-member cluster commits at once, and the data-plane rules read the
        state that follows)."""
        current = (r.state, inc, facts.addresses, facts.caps, facts.ports, facts.probes)
        if not all(map(operator.is_, current, self._up_to_date)):  # (else the very objects found up to date)
            mine = find_member(r.state, self.node_id)
            if mine is None or mine.inc != inc:
                return
            if self.up_to_date(facts, mine):
                self._up_to_date = current
            else:
                yield from self.membership(facts, mine, inc, now_ms)
        if facts.measure is None and not facts.fetched and not facts.loaded and not facts.crashed:
            return  # nothing measured or reported by workers: nothing more to publish (a hot path)
        mine = find_member(r.state, self.node_id)
        if mine is None or mine.inc != inc:
            return
        yield from self.data_plane(facts, mine, r.state, inc, now_ms)

    def measured(self, facts: LocalFacts, measure: Measure | MeasureFailed) -> None:
        facts.measure, self._failure_committed = measure, False

    def _due(self, kind: str, now_ms: int, key: object = None) -> bool:
        """True (and noted) when ``kind`` for ``key`` was not proposed in the last hello_ms."""
        last = self._sent.get(kind)
        if last is not None and last[0] == key and now_ms - last[1] < self.hello_ms:
            return False
        self._sent[kind] = (key, now_ms)
        return True

    @staticmethod
    def _moved(facts: LocalFacts, mine: Member) -> bool:
        # Capabilities too: an agent restarted with another --data-port keeps its
        # incarnation, and its ranks must be rendered at the new port.
        return bool(facts.addresses and mine.addresses != facts.addresses) or mine.caps != facts.caps

    def up_to_date(self, facts: LocalFacts, mine: Member) -> bool:
        """Nothing of ``membership``'s to publish: addresses, caps, ports and probes as committed."""
        return not self._moved(facts, mine) and mine.ports == facts.ports and mine.probes == facts.probes

    def membership(self, facts: LocalFacts, mine: Member, inc: int, now_ms: int) -> list[Command]:
        out: list[Command] = []
        if self._moved(facts, mine) and self._due("addresses", now_ms):
            out.append(UpdateMember(self.node_id, inc, facts.addresses or mine.addresses, facts.caps))
        if (mine.ports != facts.ports or mine.probes != facts.probes) and self._due("ports", now_ms):
            out.append(PublishPorts(self.node_id, inc, facts.ports, facts.probes))
        return out

    def data_plane(self, facts: LocalFacts, mine: Member, state: ClusterState, inc: int, now_ms: int) -> list[Command]:
        out: list[Command] = []
        if isinstance(facts.measure, MeasureFailed):
            if mine.measure == facts.measure:
                self._failure_committed = True
            elif self._failure_committed:  # cluster.py forgot it: the model was set again
                facts.measure, self._failure_committed = None, False
        if facts.measure is not None and mine.measure != facts.measure and self._due("measure", now_ms):
            out.append(PublishMeasure(self.node_id, inc, facts.measure))
        epoch = state.placement_epoch
        staged = any(s.node_id == self.node_id for s in state.placement)
        if epoch in facts.fetched and staged and self.node_id not in state.fetched and self._due("fetched", now_ms, epoch):
            out.append(StageFetched(self.node_id, inc, epoch))
        if epoch in facts.loaded and staged and self.node_id not in state.ready and self._due("ready", now_ms, epoch):
            out.append(WorkerReady(self.node_id, inc, epoch))
        for broken in sorted(facts.crashed):
            if broken in (state.active_epoch, state.placement_epoch) and state.failed_epoch < broken:
                if self._due("failed", now_ms, broken):
                    out.append(WorkerFailed(self.node_id, inc, broken, facts.faults.get(broken)))
        return out
