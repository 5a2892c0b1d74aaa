"""core/stage_fetch.py: the fetch task's decisions, on explicit time (no downloads). The
agent's fetch task (agent/tasks/fetch.py) and the simulator (sim/dataplane.py) both carry
them out."""
from __future__ import annotations

import dataclasses
import math

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, ModelInfo, Stage
from p2pmesh.core.node_io import StageFilesFetched, WorkerCrashed
from p2pmesh.core.stage_fetch import (BACKOFF_S, FETCH_ATTEMPTS_MAX, PRUNE_AFTER_S, FetchJob, FetchPlanner, FetchPolicy,
                                      hub_downloaders, hub_files_to_download)

ME, PEER = NodeId("me"), NodeId("peer")


def _state(epoch: int = 3, model: str = "m") -> ClusterState:
    return ClusterState(ClusterId("c1"), (), 1, (ME, PEER), (), placement_epoch=epoch, active_epoch=2,
                        model=ModelInfo(model, 2, 1, 1, 1, 1, 1), placement=(Stage(ME, 0, 1), Stage(PEER, 1, 2)))


def test_each_pending_stage_is_fetched_once_per_cluster_and_one_at_a_time() -> None:
    p = FetchPlanner(ME, 0.0)
    assert p.next_job(None, "c1", 0.0) is None  # outside a cluster
    job = p.next_job(_state(), "c1", 0.0)
    assert job == FetchJob("c1", 3, "m", 0, 1, ((ME, 0, 1), (PEER, 1, 2)))  # and who needs which layers
    assert p.next_job(_state(4), "c1", 0.0) is None  # one at a time
    assert p.fetched(job) == StageFilesFetched(3)
    assert p.next_job(_state(), "c1", 1.0) is None  # reported already
    assert p.next_job(_state(), "c2", 1.0) == FetchJob("c2", 3, "m", 0, 1, job.needs)  # epochs restart in another cluster


def test_nothing_to_fetch_once_fetched_or_without_a_pending_placement() -> None:
    p = FetchPlanner(ME, 0.0)
    assert p.next_job(dataclasses.replace(_state(), fetched=(ME,)), "c1", 0.0) is None
    assert p.next_job(_state(epoch=2), "c1", 0.0) is None  # placement_epoch == active_epoch


def test_a_failing_fetch_backs_off_then_reports_the_epoch_broken() -> None:
    p = FetchPlanner(ME, 0.0)
    now, waits = 0.0, []
    for _ in range(FETCH_ATTEMPTS_MAX - 1):
        job = p.next_job(_state(), "c1", now)
        assert job is not None
        failure = p.failed(job, now)
        assert failure.report is None and failure.retry_in_s is not None
        waits.append(failure.retry_in_s)
        assert p.next_job(_state(), "c1", now + failure.retry_in_s - 0.01) is None  # still backing off
        assert p.wake_in(now) == failure.retry_in_s
        now += failure.retry_in_s
    assert waits == [min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** i) for i in range(FETCH_ATTEMPTS_MAX - 1)]
    job = p.next_job(_state(), "c1", now)
    assert job is not None
    last = p.failed(job, now)
    assert last.report == WorkerCrashed(3) and last.retry_in_s is None and last.tries == FETCH_ATTEMPTS_MAX
    assert p.next_job(_state(), "c1", now + 1000) is None  # given up on this epoch
    assert p.next_job(_state(4), "c1", now + 1000) is not None  # the next epoch is tried afresh


def test_copies_of_other_models_are_pruned_once_the_model_has_stayed() -> None:
    p = FetchPlanner(ME, 0.0, FetchPolicy(prune_after_s=PRUNE_AFTER_S))
    assert p.wake_in(0.0) == math.inf  # no model yet: nothing due
    assert p.prune_due("a", 10.0) is None
    assert p.wake_in(10.0) == PRUNE_AFTER_S
    assert p.prune_due("a", 10.0 + PRUNE_AFTER_S - 1) is None
    assert p.prune_due("a", 10.0 + PRUNE_AFTER_S) == "a"
    assert p.prune_due("a", 1000.0) is None and p.wake_in(1000.0) == math.inf  # once per model
    assert p.prune_due("b", 1000.0) is None  # a new model starts its own wait
    assert p.prune_due("b", 1000.0 + PRUNE_AFTER_S) == "b"


def test_each_file_several_macs_need_from_the_hub_has_one_downloader_among_them() -> None:
    """core/stage_fetch.hub_downloaders: one Mac per file, always one that needs it, spread
    over the Macs (fewest files so far, ties to the earlier rank), the same on every Mac."""
    a, b, c = NodeId("a"), NodeId("b"), NodeId("c")
    needs = [(a, ["w1", "w2"]), (b, ["w2", "w3"]), (c, ["w3", "w4", "w1"])]
    plan = hub_downloaders(needs)
    assert set(plan) == {"w1", "w2", "w3", "w4"}
    assert all(f in dict(needs)[n] for f, n in plan.items())  # a downloader needs its file
    assert plan == {"w1": a, "w2": b, "w3": c, "w4": c}
    assert hub_downloaders(list(needs)) == plan  # deterministic
    # A tensor group: two ranks need the same files; the downloads are split between them.
    assert sorted(hub_downloaders([(a, ["x", "y"]), (b, ["x", "y"])]).values()) == [a, b]
    # A Mac listed twice counts once; nobody needing anything: no downloads.
    assert hub_downloaders([(a, ["x"]), (a, ["y"])]) == {"x": a, "y": a}
    assert hub_downloaders([]) == {} and hub_downloaders([(a, [])]) == {}


def test_a_file_another_mac_is_downloading_already_is_waited_for_not_downloaded_again() -> None:
    """A placement that changes while a Mac downloads a file (a later measurement, a probe)
    makes another Mac its downloader; that Mac waits for the first one's download instead,
    unless it has waited too long for the others (then it downloads everything it misses)."""
    a, b = NodeId("a"), NodeId("b")
    plan = {"w1": a, "w2": a, "w3": b}
    assert hub_files_to_download(["w1", "w2", "w3"], plan, a, late=False, elsewhere={}) == ["w1", "w2"]
    assert hub_files_to_download(["w1", "w2", "w3"], plan, a, late=False, elsewhere={"w2": b}) == ["w1"]
    assert hub_files_to_download(["w4"], plan, a, late=False, elsewhere=set()) == ["w4"]  # nobody's: here
    assert hub_files_to_download(["w2", "w3"], plan, a, late=True, elsewhere={"w2": b}) == ["w2", "w3"]
