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
timers are the backoff between tries and the prune deadline.

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
import math
from pathlib import Path

import trio

from p2pmesh.agent import models
from p2pmesh.agent.ports import ClusterView, Inbox
from p2pmesh.agent.tasks.peer_copy import PeerCopy
from p2pmesh.core import dataplane
from p2pmesh.core.node_io import StageFilesFetched, WorkerCrashed
from p2pmesh.drivers import model_files

log = logging.getLogger("p2pmesh.fetch")

PRUNE_AFTER_S = 60.0
"""Copies of other models are removed once the cluster has kept its model this long."""
FETCH_ATTEMPTS_MAX = 8
BACKOFF_S = (2.0, 60.0)
"""First and largest wait between two tries of the same epoch's fetch."""


async def ensure_layers(copier: PeerCopy, model: str, layers: tuple[int, int] | None) -> Path:
    """The local directory holding what layers [start, end) of the model need (None: the
    layer a measurement times): this Mac's own directory when it has one; else a copy from
    the other Macs (peer_copy.py, over Thunderbolt first); else, for a Hugging Face id, a
    download of just those files, linked into the same copy directory."""
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
    if layers is None:
        snapshot = await models.fetch_in_thread(lambda: model_files.fetch_for_measure(local), f"the measured layer of {model}")
    else:
        snapshot = await models.fetch_in_thread(lambda: model_files.fetch_layers(local, layers), f"layers {layers} of {model}")
    dest = models.copy_dir(copier.places.state_dir, model)
    await trio.to_thread.run_sync(models.link_snapshot, snapshot, dest)
    return dest


async def fetch_loop(view: ClusterView, inbox: Inbox, copier: PeerCopy) -> None:
    """For the agent's lifetime: fetch the stage of each pending placement, then report it."""
    reported: set[tuple[str, int]] = set()
    """(cluster, epoch) fetched and reported: epochs restart in another cluster."""
    failures: dict[tuple[str, int], int] = {}
    model_since: tuple[str | None, float] = (None, trio.current_time())
    pruned_for: str | None = None
    seen = -1
    while True:  # for the agent's lifetime; cancelled with its nursery
        snapshot = view.current
        seen = snapshot.version
        committed = snapshot.state.model if snapshot.state is not None else None
        name = committed.name if committed is not None else None
        if name != model_since[0]:
            model_since = (name, trio.current_time())
        elif name is not None and name != pruned_for and trio.current_time() - model_since[1] >= PRUNE_AFTER_S:
            pruned_for = name
            for d in await trio.to_thread.run_sync(models.prune_copies, copier.places.state_dir, name):
                log.info("removed this Mac's copy of another model: %s", d)
        state = snapshot.member_state
        want = dataplane.fetch_wanted(state, snapshot.node_id) if state is not None else None
        key = (str(snapshot.cluster), want[0]) if want is not None else None
        if want is not None and key is not None and key not in reported and failures.get(key, 0) < FETCH_ATTEMPTS_MAX:
            epoch, model, start, end = want
            started = trio.current_time()
            try:
                await ensure_layers(copier, model, (start, end))
            except models.ModelError as exc:
                tries = failures[key] = failures.get(key, 0) + 1
                wait = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (tries - 1))
                if tries < FETCH_ATTEMPTS_MAX:
                    log.warning("epoch %d: cannot fetch layers %d-%d of %s (try %d of %d, again in %.0f s): %s",
                                epoch, start, end, model, tries, FETCH_ATTEMPTS_MAX, wait, exc)
                    await trio.sleep(wait)
                else:
                    # Like a worker that cannot start: the epoch is reported broken, and the
                    # leader restarts or re-plans it (bounded by dataplane.RESTARTS_MAX).
                    log.error("epoch %d: giving up fetching layers %d-%d of %s after %d tries: %s",
                              epoch, start, end, model, tries, exc)
                    await inbox.put(WorkerCrashed(epoch))
                continue  # look again at what is current now
            took = trio.current_time() - started
            if took >= 1.0:
                log.info("epoch %d: fetched layers %d-%d of %s in %.1f s", epoch, start, end, model, took)
            reported = {k for k in reported if k[0] == key[0] and k[1] >= epoch - 2} | {key}
            failures = {k: n for k, n in failures.items() if k[0] == key[0] and k[1] >= epoch - 2}
            await inbox.put(StageFilesFetched(epoch))
            continue
        # Nothing to do until the committed state changes, or until copies of other models
        # are due to be pruned (the one deadline this task keeps).
        prune_in = math.inf
        if name is not None and name != pruned_for:
            prune_in = max(0.0, model_since[1] + PRUNE_AFTER_S - trio.current_time())
        await view.changed(seen, timeout_s=prune_in)
