"""The data-plane lifecycle in the core: a model set through any member, measurements,
a pending placement whose workers load while nothing (or the old epoch) serves, activation
once every stage is ready, requests routed to the head, and a new epoch when a stage's
Mac goes down (core/dataplane.py, core/serving.py inside the node machine)."""
from __future__ import annotations

from p2pmesh.core.machine import (
    GenerateRequested,
    Machine,
    ModelMeasured,
    PeerDiscovered,
    ProposalRequested,
    WorkerLoaded,
    WorkerOutput,
)
from p2pmesh.core.messages import Measure, ModelInfo, SetModel
from p2pmesh.core.serving import GenerateParams
from tests.core.test_machine import Driver, formed, leader_of

LAYERS = 8
MODEL = ModelInfo("tiny", LAYERS, 1000, 10, 100, 64, 500)
NEEDS_TWO = 500 + 5 * (1000 + 10 * 100)
"""Memory for embeddings plus five layers with their KV cache: two Macs are needed."""


def _state(m: Machine):  # type: ignore[no-untyped-def]
    assert m.raft is not None
    return m.raft.state


def _serve(d: Driver, ids: list, memory: int = NEEDS_TWO):  # type: ignore[no-untyped-def, type-arg]
    follower = next(n for n in ids if n != leader_of(d).node_id)
    d.handle(follower, ProposalRequested(SetModel(MODEL)))  # forwarded to the leader
    d.run(500)
    for n in ids:
        d.handle(n, ModelMeasured(Measure("tiny", memory, 0.5)))
    assert d.run_until(lambda: _state(leader_of(d)).placement_epoch > 0, 5_000)
    return _state(leader_of(d))


def test_a_placement_waits_for_every_stage_then_activates() -> None:
    d, ids = formed(3)
    state = _serve(d, ids)
    stages = state.placement
    assert len(stages) == 2 and stages[0].start == 0 and stages[-1].end == LAYERS and stages[0].end == stages[1].start
    assert state.active == () and state.active_epoch < state.placement_epoch  # pending: nothing serves yet
    d.handle(stages[0].node_id, WorkerLoaded(state.placement_epoch))
    d.run(500)
    assert _state(leader_of(d)).active == ()  # one stage is not enough
    d.handle(stages[1].node_id, WorkerLoaded(state.placement_epoch))
    assert d.run_until(lambda: _state(leader_of(d)).active == stages, 5_000)
    assert d.run_until(lambda: {_state(m).active_epoch for m in d.machines.values()} == {state.placement_epoch}, 2_000)


def test_a_request_goes_to_the_head_and_its_tokens_come_back() -> None:
    d, ids = formed(3)
    state = _serve(d, ids)
    for s in state.placement:
        d.handle(s.node_id, WorkerLoaded(state.placement_epoch))
    assert d.run_until(lambda: bool(_state(leader_of(d)).active), 5_000)
    head = state.placement[0].node_id
    origin = next(n for n in ids if n != head)
    d.handle(origin, GenerateRequested("r1", GenerateParams("hi", (), 2, 0.0, 1.0, 0)))
    d.run(100)
    submits = [s for fx in d.effects[head] for s in fx.submits]
    assert [s.req for s in submits] == ["r1"]
    epoch = submits[0].epoch
    attempt = submits[0].attempt
    d.handle(head, WorkerOutput(epoch, "r1", (7,), "a", False, "", (1, 2), attempt))
    d.handle(head, WorkerOutput(epoch, "r1", (8,), "b", True, "length", (), attempt))
    d.run(100)
    events = [e for fx in d.effects[origin] for e in fx.client]
    assert [e.tokens for e in events] == [(7,), (8,)] and events[-1].done and events[-1].finish == "length"


def test_a_stage_going_down_moves_the_cluster_to_a_new_epoch_and_the_request_resumes() -> None:
    d, ids = formed(3)
    state = _serve(d, ids)
    for s in state.placement:
        d.handle(s.node_id, WorkerLoaded(state.placement_epoch))
    assert d.run_until(lambda: bool(_state(leader_of(d)).active), 5_000)
    first = _state(leader_of(d))
    spare = next(n for n in ids if n not in {s.node_id for s in first.active})
    victim = next(s.node_id for s in first.active if s.node_id != leader_of(d).node_id)
    d.handle(spare, GenerateRequested("r1", GenerateParams("hi", (), 5, 0.0, 1.0, 0)))
    d.run(50)
    head = first.active[0].node_id
    if head != victim:
        d.handle(head, WorkerOutput(first.active_epoch, "r1", (7,), "a", False, "", (1, 2), 1))
    d.cut.add(victim)  # the Mac goes silent: marked down, leaves the ring and the placement
    assert d.run_until(lambda: _state(leader_of(d)).placement_epoch > first.active_epoch
                       and victim not in {s.node_id for s in _state(leader_of(d)).placement}, 10_000)
    new = _state(leader_of(d))
    for s in new.placement:
        d.handle(s.node_id, WorkerLoaded(new.placement_epoch))
    assert d.run_until(lambda: _state(leader_of(d)).active_epoch == new.placement_epoch, 5_000)
    new_head = new.placement[0].node_id
    d.run(200)
    resubmitted = [s for fx in d.effects[new_head] for s in fx.submits if s.epoch == new.placement_epoch]
    assert len(resubmitted) == 1
    if head != victim:  # the one token already generated is kept: only the rest is asked for
        assert resubmitted[0].params.prompt_tokens == (1, 2, 7) and resubmitted[0].params.max_tokens == 4


def test_a_model_that_fits_nowhere_is_not_placed() -> None:
    d, ids = formed(2)
    follower = next(n for n in ids if n != leader_of(d).node_id)
    d.handle(follower, ProposalRequested(SetModel(MODEL)))
    d.run(300)
    for n in ids:
        d.handle(n, ModelMeasured(Measure("tiny", 2000, 0.5)))  # room for one layer each
    d.run(2_000)
    assert _state(leader_of(d)).active == () and _state(leader_of(d)).placement == ()


def test_a_worker_dying_on_a_live_mac_restarts_the_same_stages_as_a_new_epoch() -> None:
    from p2pmesh.core.dataplane import RESTARTS_MAX
    from p2pmesh.core.machine import WorkerCrashed

    d, ids = formed(3)
    state = _serve(d, ids)
    for s in state.placement:
        d.handle(s.node_id, WorkerLoaded(state.placement_epoch))
    assert d.run_until(lambda: bool(_state(leader_of(d)).active), 5_000)
    for round_ in range(RESTARTS_MAX + 1):
        current = _state(leader_of(d))
        broken = max(current.active_epoch, current.placement_epoch)
        d.handle(current.placement[0].node_id, WorkerCrashed(broken))
        d.run(1_000)
        after = _state(leader_of(d))
        if round_ < RESTARTS_MAX:
            assert after.placement_epoch == broken + 1 and after.placement == current.placement
        else:  # a group that keeps failing is not restarted forever
            assert after.placement_epoch == broken


def test_a_mac_leaving_gracefully_drains_first_make_before_break() -> None:
    from p2pmesh.core.machine import LeaveRequested

    d, ids = formed(3)
    state = _serve(d, ids, memory=NEEDS_TWO * 2)  # any Mac can hold the whole model
    for s in state.placement:
        d.handle(s.node_id, WorkerLoaded(state.placement_epoch))
    assert d.run_until(lambda: bool(_state(leader_of(d)).active), 5_000)
    first = _state(leader_of(d))
    leaving = first.active[0].node_id
    d.handle(leaving, LeaveRequested())
    # The cluster plans without it while it still serves; it is still a member meanwhile.
    assert d.run_until(lambda: _state(leader_of(d)).placement_epoch > first.active_epoch, 5_000)
    pending = _state(leader_of(d))
    assert leaving in pending.draining and leaving not in {s.node_id for s in pending.placement}
    assert any(m.node_id == leaving for m in pending.members) and pending.active == first.active
    d.run(1_000)
    assert any(m.node_id == leaving for m in _state(leader_of(d)).members)  # waits for the switch
    for s in pending.placement:
        d.handle(s.node_id, WorkerLoaded(pending.placement_epoch))
    assert d.run_until(lambda: all(m.node_id != leaving for m in _state(leader_of(d)).members), 10_000)
    assert _state(leader_of(d)).active_epoch == pending.placement_epoch


def test_a_mac_leaving_while_a_placement_fetches_stays_until_the_files_are_there() -> None:
    # The Macs taking layers may be copying files from it, or waiting for its download from
    # the hub: make before break for the files as well (within its drain time).
    from p2pmesh.core.machine import LeaveRequested, StageFilesFetched

    d, ids = formed(3)
    state = _serve(d, ids)
    leaving = next(n for n in ids if n not in {s.node_id for s in state.placement})
    assert d.run_until(lambda: _state(d.machines[leaving]).placement_epoch == state.placement_epoch, 2_000)
    d.handle(leaving, LeaveRequested())
    d.run(2_000)
    assert any(m.node_id == leaving for m in _state(leader_of(d)).members)  # still there
    epoch = _state(leader_of(d)).placement_epoch
    for s in _state(leader_of(d)).placement:
        d.handle(s.node_id, StageFilesFetched(epoch))
    assert d.run_until(lambda: all(m.node_id != leaving for m in _state(leader_of(d)).members), 10_000)


def test_of_two_macs_the_survivor_keeps_the_model_and_the_merge_keeps_it_too() -> None:
    """Two Macs are the smallest cluster and the commonest: when one dies the other has no
    quorum and continues as a standalone cluster. It used to start that cluster empty, so
    the model had to be set again; the standalone cluster now carries the model over, serves
    it if it fits, and the restarted Mac merges into it with the model still set."""
    d, ids = formed(2)
    enough = 2 * 500 + LAYERS * (1000 + 10 * 100)  # one Mac holds the whole model (embeddings and head)
    _serve(d, ids, memory=enough)
    dead = ids[0]
    survivor = d.machines[ids[1]]
    old_cluster = survivor.cluster
    d.crash(dead)
    assert d.run_until(lambda: survivor.cluster != old_cluster and survivor.status().role == "standalone", 20_000)
    assert _state(survivor).model == MODEL
    d.handle(survivor.node_id, ModelMeasured(Measure("tiny", enough, 0.5)))  # the agent measures again
    assert d.run_until(lambda: _state(survivor).placement_epoch > 0, 5_000)
    assert [s.node_id for s in _state(survivor).placement] == [survivor.node_id]

    d.boot(dead, 1)
    d.handle(dead, PeerDiscovered(survivor.node_id, ("10.0.0.2",)))
    d.handle(survivor.node_id, PeerDiscovered(dead, ("10.0.0.1",)))
    assert d.run_until(d.converged, 20_000), "the restarted Mac did not merge back"
    assert {m.cluster for m in d.machines.values()} == {survivor.cluster}
    assert all(_state(m).model == MODEL for m in d.machines.values())


def test_workers_of_a_pending_placement_start_only_once_every_stage_has_its_files() -> None:
    """MLX's ring connect gives up after about 30 s, so no rank may start forming its group
    while another Mac still downloads its layers: each stage's member reports its files
    (StageFilesFetched -> StageFetched) and workers are wanted only once all have."""
    from p2pmesh.core import dataplane
    from p2pmesh.core.machine import StageFilesFetched

    d, ids = formed(3)
    state = _serve(d, ids)
    first, second = (s.node_id for s in state.placement)
    epoch = state.placement_epoch
    assert dataplane.fetch_wanted(state, first) == (epoch, MODEL.name, 0, state.placement[0].end)
    assert all(dataplane.wanted_workers(state, n) == [] for n in ids)
    d.handle(first, StageFilesFetched(epoch))
    assert d.run_until(lambda: first in _state(leader_of(d)).fetched, 2_000)
    assert dataplane.wanted_workers(_state(leader_of(d)), first) == []  # the other stage is still fetching
    assert dataplane.fetch_wanted(_state(leader_of(d)), first) is None
    d.handle(second, StageFilesFetched(epoch))
    assert d.run_until(lambda: dataplane.all_fetched(_state(d.machines[first])), 2_000)
    wanted = dataplane.wanted_workers(_state(d.machines[first]), first)
    assert [(w.epoch, w.rank) for w in wanted] == [(epoch, 0)]
    d.handle(first, StageFilesFetched(epoch - 5))  # a stale report changes nothing
    d.run(200)
    assert set(_state(leader_of(d)).fetched) == {first, second}


def test_a_workers_fault_is_committed_with_its_failure_and_cleared_once_an_epoch_serves() -> None:
    """Why a group could not form (the peer, address and port the worker names) reaches
    every member's state, so status anywhere says it; serving again clears it."""
    from p2pmesh.core.machine import WorkerCrashed
    from p2pmesh.core.messages import WorkerFault

    d, ids = formed(3)
    state = _serve(d, ids)
    epoch = state.placement_epoch
    reporter, peer = state.placement[0].node_id, state.placement[-1].node_id
    fault = WorkerFault("ring_peer_unreachable", peer, "127.0.0.3", 47151, reporter, epoch, "[ring] Couldn't connect (error: 111)")
    d.handle(reporter, WorkerCrashed(epoch, fault))
    assert d.run_until(lambda: all(_state(m).fault == fault for m in d.machines.values()), 3_000)
    restarted = _state(leader_of(d))
    assert restarted.placement_epoch == epoch + 1 and restarted.restarts == 1  # the same stages again
    for s in restarted.placement:
        d.handle(s.node_id, WorkerLoaded(restarted.placement_epoch))
    assert d.run_until(lambda: all(bool(_state(m).active) and _state(m).fault is None for m in d.machines.values()), 5_000)


def test_a_fault_for_someone_else_or_another_epoch_is_refused() -> None:
    from p2pmesh.core.ids import NodeId
    from p2pmesh.core.messages import WorkerFailed, WorkerFault
    from p2pmesh.core.validate import forwarded_problem

    a, b = NodeId("a" * 32), NodeId("b" * 32)
    ok = WorkerFault("ring_port_in_use", a, "10.0.0.1", 47001, a, 4, "[ring] Couldn't bind socket (error: 98)")
    assert forwarded_problem(WorkerFailed(a, 1, 4, ok), a) is None
    from dataclasses import replace

    for bad in (replace(ok, reporter=b), replace(ok, epoch=5), replace(ok, port=70000), replace(ok, message="x" * 5000)):
        assert forwarded_problem(WorkerFailed(a, 1, 4, bad), a) is not None


def _two_of_three_measured():  # type: ignore[no-untyped-def]
    """Three Macs, the model set, two of them measured: (driver, ids, the grace in ms)."""
    d, ids = formed(3)
    follower = next(n for n in ids if n != leader_of(d).node_id)
    d.handle(follower, ProposalRequested(SetModel(MODEL)))
    d.run(500)
    for n in ids[:2]:
        d.handle(n, ModelMeasured(Measure("tiny", NEEDS_TWO, 0.5)))
    return d, ids, leader_of(d).settings.measure_grace_ms


def test_a_first_placement_waits_a_while_for_every_macs_measurement() -> None:
    # Planned on the first measurement alone, a placement would be replaced moments later,
    # its workers started and its files fetched (hub downloads too) for nothing.
    d, ids, grace_ms = _two_of_three_measured()
    d.run(grace_ms // 2)
    assert _state(leader_of(d)).placement_epoch == 0  # the third Mac has not answered yet
    d.handle(ids[2], ModelMeasured(Measure("tiny", NEEDS_TWO, 0.2)))  # the fastest
    assert d.run_until(lambda: _state(leader_of(d)).placement_epoch > 0, 2_000)
    state = _state(leader_of(d))
    assert state.placement_epoch == 1 and ids[2] in {s.node_id for s in state.placement}


def test_a_mac_that_never_measures_delays_the_first_placement_by_the_grace_only() -> None:
    d, ids, grace_ms = _two_of_three_measured()
    start = d.now
    assert d.run_until(lambda: _state(leader_of(d)).placement_epoch > 0, grace_ms + 2_000)
    assert grace_ms <= d.now - start <= grace_ms + 1_000
    assert {s.node_id for s in _state(leader_of(d)).placement} == set(ids[:2])
