"""Local facts and their publication (core/publishing.py): one rule, propose where the
committed record differs and again only after hello_ms; worker reports stay bounded."""
from __future__ import annotations

from p2pmesh.core.cluster import find_member
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Measure, PublishPorts, StageFetched, UpdateMember, WorkerFailed, WorkerFault
from p2pmesh.core.publishing import EPOCHS_KEPT, LocalFacts, Publisher
from tests.core.test_machine import a_follower, formed


def test_worker_reports_keep_the_last_epochs_only() -> None:
    d, _ = formed(1)
    facts = LocalFacts((), next(iter(d.machines.values())).facts.caps)
    for epoch in range(1, 10):
        fault = WorkerFault("ring_peer_unreachable", NodeId("n1"), "10.0.0.1", 47001, NodeId("n0"), epoch, "refused")
        facts.worker_event("crashed", epoch, fault)
        facts.worker_event("loaded", epoch)
    assert facts.crashed == facts.loaded == set(range(10 - EPOCHS_KEPT, 10))
    assert set(facts.faults) == facts.crashed


def test_a_difference_is_proposed_once_per_hello_period() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    assert f.raft is not None
    mine = find_member(f.raft.state, f.node_id)
    assert mine is not None
    pub = Publisher(f.node_id, hello_ms=500)
    facts = LocalFacts(("10.9.9.9:7741",), mine.caps)
    first = pub.membership(facts, mine, f.inc, 1_000)
    assert [type(c) for c in first] == [UpdateMember]
    assert pub.membership(facts, mine, f.inc, 1_499) == []  # still in flight
    assert [type(c) for c in pub.membership(facts, mine, f.inc, 1_500)] == [UpdateMember]  # lost? again
    same = LocalFacts(mine.addresses, mine.caps, mine.ports, mine.probes)
    assert Publisher(f.node_id, 500).membership(same, mine, f.inc, 0) == []  # nothing differs: nothing proposed
    assert all(not isinstance(c, PublishPorts) for c in pub.membership(facts, mine, f.inc, 2_000))  # ports as committed


def test_worker_reports_follow_the_placement_epoch() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    assert f.raft is not None
    state = f.raft.state
    mine = find_member(state, f.node_id)
    assert mine is not None
    pub = Publisher(f.node_id, hello_ms=500)
    facts = LocalFacts(mine.addresses, mine.caps, mine.ports, mine.probes)
    facts.worker_event("fetched", state.placement_epoch)
    # Not staged in this placement (none yet): nothing to report.
    assert all(not isinstance(c, StageFetched) for c in pub.data_plane(facts, mine, state, f.inc, 0))
    facts.worker_event("crashed", state.active_epoch + 1)
    assert all(not isinstance(c, WorkerFailed) for c in pub.data_plane(facts, mine, state, f.inc, 0))
    facts.measure = Measure("m", 1 << 30, 1.0)
    assert [type(c).__name__ for c in pub.data_plane(facts, mine, state, f.inc, 0)] == ["PublishMeasure"]
    assert pub.data_plane(facts, mine, state, f.inc, 100) == []
