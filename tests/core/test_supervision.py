"""core/supervision.py: the worker supervisor's decisions, on explicit time (no processes).
The agent's Supervisor (agent/tasks/workers.py) and the simulator (sim/dataplane.py) both
carry these out, so what is pinned here is what both do."""
from __future__ import annotations

import dataclasses

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, ModelInfo, Stage, WorkerFault
from p2pmesh.core.node_io import WorkerCrashed, WorkerLoad, WorkerLoaded, WorkerOutput
from p2pmesh.core.protocol import ErrorCode
from p2pmesh.core.supervision import HEARTBEAT_TIMEOUT_S, PROGRESS_TIMEOUT_S, WorkerBook, group_hops

ME, PEER = NodeId("me"), NodeId("peer")


def _state(active_epoch: int = 2, placement_epoch: int = 2, fetched: tuple[NodeId, ...] = ()) -> ClusterState:
    """ME is rank 0 of the active epoch; a pending placement (if any) puts ME at rank 1."""
    return ClusterState(ClusterId("c1"), (), 1, (ME, PEER), (), model=ModelInfo("m", 2, 1, 1, 1, 1, 1),
                        placement_epoch=placement_epoch, placement=(Stage(PEER, 0, 1), Stage(ME, 1, 2)),
                        active_epoch=active_epoch, active=(Stage(ME, 0, 1), Stage(PEER, 1, 2)), fetched=fetched)


def test_the_wanted_workers_start_once_and_the_unwanted_stop_quietly() -> None:
    book = WorkerBook(ME)
    moves = book.reconcile(_state(), 0.0)
    assert [(w.epoch, w.rank) for w in moves.start] == [(2, 0)] and not moves.stop and not moves.crashed
    watch = book.started(moves.start[0], 0.0)
    assert watch.order == (ME, PEER)
    assert not book.reconcile(_state(), 1.0).start  # running: not started again
    # A pending epoch starts only once every stage has its files.
    assert not book.reconcile(_state(placement_epoch=3), 2.0).start
    moves = book.reconcile(_state(placement_epoch=3, fetched=(ME, PEER)), 3.0)
    assert [(w.epoch, w.rank) for w in moves.start] == [(3, 1)]
    book.started(moves.start[0], 3.0)
    # Epoch 3 becomes the active one: epoch 2's worker is stopped, and nothing is reported.
    new = dataclasses.replace(_state(3, 3), active=(Stage(PEER, 0, 1), Stage(ME, 1, 2)))
    moves = book.reconcile(new, 4.0)
    assert [w.epoch for w in moves.stop] == [2] and not moves.hung and not moves.crashed and not moves.start
    assert book.exited(watch) is None  # its exit, after the stop, is no crash either
    assert 2 not in book.failed


def test_a_silent_worker_is_hung_reported_once_and_never_restarted() -> None:
    book = WorkerBook(ME)
    watch = book.started(book.reconcile(_state(), 0.0).start[0], 0.0)
    book.heard(watch, {"event": "heartbeat"}, 5.0)
    assert not book.reconcile(_state(), 5.0 + HEARTBEAT_TIMEOUT_S).hung  # exactly the timeout: still alive
    moves = book.reconcile(_state(), 5.0 + HEARTBEAT_TIMEOUT_S + 0.1)
    assert moves.hung == (watch,) and moves.crashed == (WorkerCrashed(2),) and not moves.start
    assert book.exited(watch) is None  # its exit after the kill: already reported
    assert not book.reconcile(_state(), 100.0).start  # the group cannot re-form: no restart here


def test_a_head_with_requests_and_no_progress_is_hung_though_it_heartbeats() -> None:
    book = WorkerBook(ME)
    watch = book.started(book.reconcile(_state(), 0.0).start[0], 0.0)
    assert book.submit(2, "r1@0", 10.0) is watch and watch.pending == {"r1@0"} and watch.progress == 10.0
    book.heard(watch, {"event": "token", "id": "r1@0", "token": 7, "text": "a"}, 20.0)
    for t in range(21, 141, 5):  # heartbeats, and no output for the request
        book.heard(watch, {"event": "heartbeat"}, float(t))
    assert not book.reconcile(_state(), 20.0 + PROGRESS_TIMEOUT_S).hung
    assert book.reconcile(_state(), 20.0 + PROGRESS_TIMEOUT_S + 1).hung == (watch,)


def test_an_idle_head_is_not_hung_and_a_finished_request_stops_counting() -> None:
    book = WorkerBook(ME)
    watch = book.started(book.reconcile(_state(), 0.0).start[0], 0.0)
    book.submit(2, "r1@0", 1.0)
    book.heard(watch, {"event": "done", "id": "r1@0", "finish": "stop"}, 2.0)
    assert watch.pending == set()
    book.heard(watch, {"event": "heartbeat"}, 500.0)
    assert not book.reconcile(_state(), 500.0).hung


def test_only_a_local_head_takes_requests() -> None:
    book = WorkerBook(ME)
    assert book.submit(2, "r1@0", 0.0) is None  # no worker here
    state = _state(placement_epoch=3, fetched=(ME, PEER))
    for want in book.reconcile(state, 0.0).start:
        book.started(want, 0.0)
    assert book.submit(3, "r1@0", 0.0) is None  # rank 1 of epoch 3: not a head
    assert book.submit(2, "r1@0", 0.0) is not None


def test_events_become_core_inputs() -> None:
    book = WorkerBook(ME)
    watch = book.started(book.reconcile(_state(), 0.0).start[0], 0.0)
    assert book.heard(watch, {"event": "heartbeat"}, 1.0) is None and watch.last_heartbeat == 1.0
    assert book.heard(watch, {"event": "ready", "rank": 0}, 2.0) == WorkerLoaded(2) and watch.ready
    token = {"event": "token", "id": "r@1@3", "token": 9, "text": "x", "prompt_tokens": [4, 5]}
    assert book.heard(watch, token, 3.0) == WorkerOutput(2, "r@1", (9,), "x", False, "", (4, 5), 3)
    done = {"event": "done", "id": "r@1@3", "finish": "length"}
    assert book.heard(watch, done, 4.0) == WorkerOutput(2, "r@1", (), "", True, "length", (), 3)
    busy = {"event": "error", "id": "q@0", "code": "busy", "message": "full"}
    assert book.heard(watch, busy, 5.0) == WorkerOutput(2, "q", (), "full", True, "error", (), 0, False, ErrorCode.BUSY)
    lost = {"event": "error", "id": "q@1", "code": "pipeline_broken", "message": "peer lost"}
    out = book.heard(watch, lost, 6.0)
    assert isinstance(out, WorkerOutput) and out.broken


def test_a_fault_before_ready_names_the_peer_and_rides_on_the_crash() -> None:
    book = WorkerBook(ME)
    watch = book.started(book.reconcile(_state(), 0.0).start[0], 0.0)
    event = {"event": "error", "code": "unusable", "message": "connect refused",
             "fault": {"code": "peer_unreachable", "rank": 1, "address": "10.0.0.2", "port": 5000}}
    assert book.heard(watch, event, 1.0) is None
    assert watch.fault == WorkerFault("peer_unreachable", PEER, "10.0.0.2", 5000, ME, 2, "connect refused")
    assert book.exited(watch) == WorkerCrashed(2, watch.fault)
    assert 2 in book.failed and book.exited(watch) is None  # reported once
    # A malformed fault (a rank outside the group) is no fault.
    other = WorkerBook(ME)
    w2 = other.started(other.reconcile(_state(), 0.0).start[0], 0.0)
    bad = dict(event, fault={"code": "x", "rank": 5, "address": "a", "port": 1})
    assert other.heard(w2, bad, 1.0) is None and w2.fault is None


def test_a_worker_that_cannot_start_is_reported_and_not_retried() -> None:
    book = WorkerBook(ME)
    want = book.reconcile(_state(), 0.0).start[0]
    assert book.could_not_start(want.epoch) == WorkerCrashed(2)
    assert not book.reconcile(_state(), 1.0).start


def test_group_hops_follow_the_epoch() -> None:
    state = _state(placement_epoch=3)
    assert group_hops(state, 3) is state.placement_hops and group_hops(state, 2) is state.active_hops


def test_a_heads_heartbeat_tells_the_core_its_batch_when_it_changes_and_every_second() -> None:
    book = WorkerBook(ME)
    moves = book.reconcile(_state(placement_epoch=3, fetched=(ME, PEER)), 0.0)
    head, other = (book.started(w, 0.0) for w in sorted(moves.start, key=lambda w: w.rank))
    assert (head.rank, other.rank) == (0, 1)

    def beat(w, t, **load):  # type: ignore[no-untyped-def]
        return book.heard(w, {"event": "heartbeat", "rank": w.rank, "t": t, **load}, t)

    assert beat(head, 0.5, running=2, queued=1, tokens=40) == WorkerLoad(2, 2, 1, 40)
    assert beat(head, 1.0, running=2, queued=1, tokens=40) is None  # unchanged, told 0.5 s ago
    assert beat(head, 1.5, running=2, queued=1, tokens=40) == WorkerLoad(2, 2, 1, 40)  # a second: again
    assert beat(head, 1.6, running=3, queued=0, tokens=41) == WorkerLoad(2, 3, 0, 41)  # changed: at once
    assert beat(head, 3.0) is None  # an older worker's heartbeat carries no load
    assert beat(head, 3.0, running=-1, queued=0, tokens=1) is None and beat(head, 3.0, running=True, queued=0, tokens=1) is None
    assert beat(other, 3.0, running=1, queued=0, tokens=1) is None  # only a head has a batch
    assert not head.hung(3.0)  # any event proves it alive
