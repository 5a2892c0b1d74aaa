"""Fetching this Mac's stage files before its worker starts (agent side, trio).

The leader's placement gives this Mac a stage. Its worker may start only once every
stage's member has its files on disk (core/dataplane.all_fetched): MLX's ring connect gives
up after about 30 s, so a group must not start forming while one Mac is still downloading
its layers. This task fetches the files of this Mac's stage of the pending placement
(model_files.fetch_layers: only the weight files holding its layers, and the embeddings or
head where it needs them), then reports ``StageFilesFetched(epoch)``; the core proposes
``StageFetched`` and, once everyone has, the workers start.

Copies of models the cluster no longer serves are removed once its model has stayed the same
for PRUNE_AFTER_S (they are p2pmesh's own files under the state directory, and large).

The task reads the ClusterView (committed, durable state) and wakes when it changes; the only
timers are the backoff between tries and the prune deadline. Which stage to fetch, when to
try again, when to give up and when to prune are decided by core/stage_fetch.py's planner
(sans I/O, also driven by the simulator); this module does the copies and downloads.

A local model directory has its files already: it is reported at once, after a check that
the directory is there. Otherwise the files are copied from the other Macs that have them
(peer_copy.py), and a Hugging Face id none of them has is fetched in a thread
(huggingface_hub resumes a partial download), bounded by models.FETCH_TIMEOUT_S. A failed fetch is tried again with
backoff, at most FETCH_ATTEMPTS_MAX times per epoch; then this Mac reports the epoch broken
(as a worker that cannot start), and the leader restarts or re-plans it, a bounded number of
times; the active epoch keeps serving meanwhile.
"""
from __future__ import annotations

import logging
from pathlib import Path

import trio

from p2pmesh.agent import models
from p2pmesh.agent.ports import ClusterView, Inbox
from p2pmesh.agent.tasks import hub_share
from p2pmesh.agent.tasks.peer_copy import Meter, PeerCopy
from p2pmesh.core import stage_fetch
from p2pmesh.core.node_io import FetchProgressed
from p2pmesh.drivers import model_files

log = logging.getLogger("p2pmesh.fetch")

PRUNE_AFTER_S = stage_fetch.PRUNE_AFTER_S
FETCH_ATTEMPTS_MAX = stage_fetch.FETCH_ATTEMPTS_MAX
BACKOFF_S = stage_fetch.BACKOFF_S
"""The planner's policy (core/stage_fetch.py says what each means), named here so a test may
shorten it for this task."""
REPORT_S = 0.5
"""How often the fetch tells the core its progress (the core sends it on to every member)."""


async def ensure_layers(copier: PeerCopy, model: str, layers: tuple[int, int] | None,
                        needs: hub_share.Needs | None = None) -> Path:
    """The local directory holding what layers [start, end) of the model need (None: the
    layer a measurement times): this Mac's own directory when it has one; else a copy from
    the other Macs (peer_copy.py, over Thunderbolt first); else, for a Hugging Face id, just
    those files, each downloaded by one Mac of those that need it (``needs``: the
    placement's stages; hub_share.py) and copied from it by the others, all linked into the
    same copy directory."""
    local = models.located(model, copier.places.model_root)
    path = Path(local).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise models.ModelError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    copied = await copier.copy_layers(model, layers)
    if copied is not None:
        return copied
    if not model_files.is_hub_id(local):
        raise models.ModelError(f"no model directory at {local!r} on this Mac, no other Mac has it, "
                                "and it is not a Hugging Face id")
    return await hub_share.fetch_from_hub(copier, local, model, layers, needs)


async def _run_job(copier: PeerCopy, inbox: Inbox, job: stage_fetch.FetchJob) -> models.ModelError | None:
    """Fetch a job's files while reporting their progress; the error that ended it, if any."""
    meter = copier.meter
    meter.reset()
    error: models.ModelError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_report_progress, meter, inbox)
        try:
            await ensure_layers(copier, job.model, (job.start, job.end), [(n, (a, b)) for n, a, b in job.needs])
        except models.ModelError as exc:
            error = exc
        nursery.cancel_scope.cancel()
    _, total = meter.progress()
    if error is None and total:
        await inbox.put(FetchProgressed(meter.source, total, total))  # the end: every member sees it done (no hub files)
    return error


async def _report_progress(meter: Meter, inbox: Inbox) -> None:
    """Tell the core this Mac's bytes done and in all every REPORT_S while there are bytes to
    fetch (also when they do not move: a report not renewed goes stale, core/transfers.py).
    Cancelled at the job's end."""
    while True:  # for one job: cancelled when it ends
        await trio.sleep(REPORT_S)
        done, total = meter.progress()
        if total:
            await inbox.put(FetchProgressed(meter.source, done, total, tuple(sorted(meter.from_hub))))


async def fetch_loop(view: ClusterView, inbox: Inbox, copier: PeerCopy) -> None:
    """For the agent's lifetime: fetch the stage of each pending placement, then report it.
    What to fetch, when to try again and when to prune is the planner's (core/stage_fetch.py)."""
    policy = stage_fetch.FetchPolicy(FETCH_ATTEMPTS_MAX, BACKOFF_S, PRUNE_AFTER_S)
    planner = stage_fetch.FetchPlanner(view.current.node_id, trio.current_time(), policy)
    while True:  # for the agent's lifetime; cancelled with its nursery
        snapshot = view.current
        committed = snapshot.state.model if snapshot.state is not None else None
        prune = planner.prune_due(committed.name if committed is not None else None, trio.current_time())
        if prune is not None:
            for d in await trio.to_thread.run_sync(models.prune_copies, copier.places.state_dir, prune):
                log.info("removed this Mac's copy of another model: %s", d)
        job = planner.next_job(snapshot.member_state, str(snapshot.cluster), trio.current_time())
        if job is None:
            # Nothing to do until the committed state changes, or until a deadline of the
            # planner's passes (copies of other models to prune, the end of a backoff).
            await view.changed(snapshot.version, timeout_s=planner.wake_in(trio.current_time()))
            continue
        started = trio.current_time()
        exc = await _run_job(copier, inbox, job)
        if exc is not None:
            failure = planner.failed(job, trio.current_time())
            if failure.report is None:
                log.warning("epoch %d: cannot fetch layers %d-%d of %s (try %d of %d, again in %.0f s): %s",
                            job.epoch, job.start, job.end, job.model, failure.tries, policy.attempts_max,
                            failure.retry_in_s, exc)
            else:
                # Like a worker that cannot start: the epoch is reported broken, and the
                # leader restarts or re-plans it (bounded by dataplane.RESTARTS_MAX).
                log.error("epoch %d: giving up fetching layers %d-%d of %s after %d tries: %s",
                          job.epoch, job.start, job.end, job.model, failure.tries, exc)
                await inbox.put(failure.report)
            continue  # look again at what is current now
        took = trio.current_time() - started
        if took >= 1.0:
            log.info("epoch %d: fetched layers %d-%d of %s in %.1f s", job.epoch, job.start, job.end, job.model, took)
        await inbox.put(planner.fetched(job))
