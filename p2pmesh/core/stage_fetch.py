"""The fetch task's decisions, without the downloads: which stage's files this node fetches
now, how long it waits after a failure, when it gives up and reports the epoch broken, and
when copies of models the cluster no longer serves are due to be removed.

The agent's fetch task (agent/tasks/fetch.py) carries them out with real copies and
downloads; the simulator (sim/dataplane.py) with a seeded delay on virtual time. Sans I/O:
no clock reads (``now`` is an argument, in seconds on the caller's clock). One fetch at a
time, as the task runs them: the planner hands out a job, and hands out none until it hears
how that one ended.

The rules:
- the stage to fetch is core/dataplane.fetch_wanted of the committed state: this node's
  stage of a pending placement it has not reported fetched; each (cluster, epoch) is
  reported once (``StageFilesFetched``): epochs restart in another cluster;
- a failed fetch is tried again after a backoff (doubling from BACKOFF_S[0] up to
  BACKOFF_S[1]), at most FETCH_ATTEMPTS_MAX times per epoch; then the epoch is reported
  broken (``WorkerCrashed``, like a worker that cannot start) and the leader restarts or
  re-plans it, a bounded number of times (dataplane.RESTARTS_MAX);
- copies of other models are removed once the cluster has kept its model PRUNE_AFTER_S;
- of a model's files several Macs need from Hugging Face, each is downloaded by one of them
  (``hub_downloaders``); the others copy it from that Mac once it is there. A cluster
  downloads each file once, spread over the Macs that need files.
"""
from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import ClusterState
from p2pmesh.core.node_io import StageFilesFetched, WorkerCrashed

PRUNE_AFTER_S = 60.0
"""Copies of other models are removed once the cluster has kept its model this long."""
FETCH_ATTEMPTS_MAX = 8
BACKOFF_S = (2.0, 60.0)
"""First and largest wait between two tries of the same epoch's fetch."""


@dataclass(frozen=True, slots=True)
class FetchJob:
    """Fetch the files of layers [start, end) of ``model`` for ``epoch`` of ``cluster``."""

    cluster: str
    epoch: int
    model: str
    start: int
    end: int
    needs: tuple[tuple[NodeId, int, int], ...] = ()
    """Every stage of the placement, in rank order: (member, start, end), who needs which
    layers' files (for ``hub_downloaders``)."""

    @property
    def key(self) -> tuple[str, int]:
        return self.cluster, self.epoch


@dataclass(frozen=True, slots=True)
class FetchFailed:
    """What follows a failed try: another after ``retry_in_s``, or (None) the epoch's
    ``report`` as broken."""

    tries: int
    retry_in_s: float | None
    report: WorkerCrashed | None


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    attempts_max: int = FETCH_ATTEMPTS_MAX
    backoff_s: tuple[float, float] = BACKOFF_S
    prune_after_s: float = PRUNE_AFTER_S


class FetchPlanner:
    """The fetches of one agent process."""

    def __init__(self, me: NodeId, now: float, policy: FetchPolicy = FetchPolicy()) -> None:
        self.me = me
        self.policy = policy
        self.reported: set[tuple[str, int]] = set()
        """(cluster, epoch) fetched and reported."""
        self.failures: dict[tuple[str, int], int] = {}
        self.in_flight: FetchJob | None = None
        self.retry_at = -math.inf
        """No fetch starts before this (the backoff after a failed try)."""
        self.model_since: tuple[str | None, float] = (None, now)
        """The committed model, and since when it has been the cluster's."""
        self.pruned_for: str | None = None

    def next_job(self, state: ClusterState | None, cluster: str, now: float) -> FetchJob | None:
        """The fetch to start now, given the committed state while a member (None outside a
        cluster); None when there is none, or while one runs or a backoff lasts."""
        if self.in_flight is not None or now < self.retry_at or state is None:
            return None
        want = dataplane.fetch_wanted(state, self.me)
        if want is None:
            return None
        job = FetchJob(cluster, *want, tuple((s.node_id, s.start, s.end) for s in state.placement))
        if job.key in self.reported or self.failures.get(job.key, 0) >= self.policy.attempts_max:
            return None
        self.in_flight = job
        return job

    def fetched(self, job: FetchJob) -> StageFilesFetched:
        """The job's files are on disk: what to report (remembering only recent epochs)."""
        self.in_flight = None
        cluster, epoch = job.key
        self.reported = {k for k in self.reported if k[0] == cluster and k[1] >= epoch - 2} | {job.key}
        self.failures = {k: n for k, n in self.failures.items() if k[0] == cluster and k[1] >= epoch - 2}
        return StageFilesFetched(job.epoch)

    def failed(self, job: FetchJob, now: float) -> FetchFailed:
        """The job failed: try again after a backoff, or give up and report the epoch broken."""
        self.in_flight = None
        tries = self.failures[job.key] = self.failures.get(job.key, 0) + 1
        first, largest = self.policy.backoff_s
        wait = min(largest, first * 2 ** (tries - 1))
        if tries < self.policy.attempts_max:
            self.retry_at = now + wait
            return FetchFailed(tries, wait, None)
        return FetchFailed(tries, None, WorkerCrashed(job.epoch))

    def prune_due(self, model: str | None, now: float) -> str | None:
        """The committed model is ``model``: the model whose copies of *other* models are
        to be removed now (once per model), if it is time."""
        if model != self.model_since[0]:
            self.model_since = (model, now)
        elif model is not None and model != self.pruned_for and now - self.model_since[1] >= self.policy.prune_after_s:
            self.pruned_for = model
            return model
        return None

    def wake_in(self, now: float) -> float:
        """Seconds until a deadline of this planner passes (a prune or the end of a
        backoff); infinite when nothing but a new committed state can give it work."""
        due = math.inf
        model, since = self.model_since
        if model is not None and model != self.pruned_for:
            due = since + self.policy.prune_after_s
        if self.retry_at > now:
            due = min(due, self.retry_at)
        return max(0.0, due - now)


def hub_files_to_download(missing: Sequence[str], downloaders: Mapping[str, NodeId], me: NodeId, *,
                          late: bool, elsewhere: Container[str]) -> list[str]:
    """Of the files this Mac still misses, those it downloads from the hub now: those
    ``hub_downloaders`` gives it, unless another Mac is downloading that file already
    (``elsewhere``: a placement changed while that Mac downloads it, which it finishes; this
    Mac then copies it from there). Once ``late`` (waited too long for the others), all."""
    return [f for f in missing if late or (downloaders.get(f, me) == me and f not in elsewhere)]


def hub_downloaders(needs: Sequence[tuple[NodeId, Sequence[str]]]) -> dict[str, NodeId]:
    """For each file some Mac needs from Hugging Face, the one Mac that downloads it; the
    others wait until a Mac holds it and copy it from there. ``needs``: (Mac, the files it
    needs), in a order every Mac computes alike (the placement's ranks); a Mac may appear
    more than once. Each file, in name order, goes to the Mac needing it that was given the
    fewest files so far (ties: the earliest in ``needs``), so the downloads are spread over
    the Macs and each Mac mostly downloads files it needs itself."""
    first: dict[NodeId, int] = {}
    wanted: dict[NodeId, set[str]] = {}
    for i, (node, files) in enumerate(needs):
        first.setdefault(node, i)
        wanted.setdefault(node, set()).update(files)
    given = dict.fromkeys(first, 0)
    out: dict[str, NodeId] = {}
    for f in sorted(set().union(*wanted.values())) if wanted else []:
        pick = min((n for n in first if f in wanted[n]), key=lambda n: (given[n], first[n]))
        out[f] = pick
        given[pick] += 1
    return out
