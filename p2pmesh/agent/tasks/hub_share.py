"""One download from Hugging Face per file (agent side, trio).

Of a model's files several Macs need and no Mac has, each is downloaded by one Mac only:
core/stage_fetch.hub_downloaders picks it, the same on every Mac, from who needs what (the
placement's stages, or for a measurement every member, each needing the measured layer's
file). That Mac downloads it; the others copy it from that Mac (peer_copy.py) once it is
whole there. "As it arrives" is per file here: a Mac's copy directory shows a downloaded
file (a link into the Hugging Face cache) only once huggingface_hub has finished and
checked it, and from then on the Mac lists and serves it; a file still downloading is not
served in part. A stage of several files therefore flows file by file.

A Mac waiting for another's download asks the members again as soon as a member's hub
downloads change (their transfer reports), else after a short wait (POLL_S, doubling), for
at most WAIT_S; a downloader that is down, or takes longer than that, is replaced by
downloading here (the rule is computed again each round over the members that are up).
The rule follows the placement, which may change while a Mac downloads (a later
measurement, a probe, a Mac leaving): a file another Mac is downloading already, as its
transfer reports say (core/transfers.hub_downloads: fresh for 3 s after its last), is
waited for and copied, not downloaded a second time. The model's metadata (config, index,
tokenizer: kilobytes) is copied from a Mac that has it where one does (the Mac that
described the model), else downloaded.

A model with one weight file and no index is fetched as before (the one file, whoever
needs it): no rule needed to split it, and every Mac needs it anyway.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent import models
from p2pmesh.agent.tasks.peer_copy import PeerCopy
from p2pmesh.core import stage_fetch
from p2pmesh.core.ids import NodeId
from p2pmesh.drivers import model_files
from p2pmesh.drivers.files import CopyProgress

log = logging.getLogger("p2pmesh.hub_share")

WAIT_S = 1800.0
"""How long a Mac waits for another Mac's download of a file before downloading it itself."""
POLL_S = (0.5, 5.0)
"""First and largest wait between two looks at the members for a file another Mac downloads."""
SIZE_TIMEOUT_S = 120.0
"""The hub's answers about the sizes of the files to download (HEAD requests)."""
METADATA_WAIT_S = 10.0
"""How long a Mac looks for another that has the model's metadata before fetching it itself."""
ROUNDS_MAX = 2000
"""Bounds the loop (each round copies, downloads or waits at least POLL_S[0])."""
Needs = Sequence[tuple[NodeId, "tuple[int, int] | None"]]
"""Who needs which layers' files, in rank order (None: the measured layer)."""


def _plan(copier: PeerCopy, config: dict[str, Any], wm: dict[str, str], needs: Needs | None) -> dict[str, NodeId]:
    """The downloader of each file, among the members that are up now (``config`` and
    ``wm``: the model's config.json and weight map, read once)."""
    snapshot = copier.view.current
    state = snapshot.state
    up = {m.node_id for m in state.members if m.up} if state is not None else {snapshot.node_id}
    if needs is None:  # a measurement: every member needs the measured layer
        needs = [(n, None) for n in sorted(up)]
    files = []
    for node, layers in needs:
        if node in up:
            start, end = layers if layers is not None else model_files.measured_layers(config)
            files.append((node, model_files.files_for_layers(config, wm, start, end)))
    return stage_fetch.hub_downloaders(files)


async def fetch_from_hub(copier: PeerCopy, repo_id: str, name: str, layers: tuple[int, int] | None,
                         needs: Needs | None = None) -> Path:
    """This Mac's copy directory with what layers [start, end) of hub model ``repo_id`` need
    (None: the measured layer), each file downloaded here only if the rule gives it to this
    Mac, else copied from the Mac that downloads it."""
    dest = models.copy_dir(copier.places.state_dir, name)
    await _metadata(copier, repo_id, name, dest, layers)
    try:
        weights = await trio.to_thread.run_sync(models.weights_for, dest, layers)
    except (model_files.ModelFilesError, OSError, ValueError) as exc:
        raise models.ModelError(f"the metadata of {name} is unusable: {exc}") from None
    if weights is None:  # one weight file, no index
        what = f"layers {layers} of {name}" if layers else f"the measured layer of {name}"
        snapshot = await models.fetch_in_thread(lambda: model_files.fetch_layers(repo_id, layers), what)
        await trio.to_thread.run_sync(models.link_snapshot, snapshot, dest)
        return dest
    me = copier.view.current.node_id
    try:
        config = await trio.to_thread.run_sync(model_files.read_config, dest)
        wm = await trio.to_thread.run_sync(model_files.weight_map, dest) or {}
    except (model_files.ModelFilesError, OSError, ValueError) as exc:
        raise models.ModelError(f"the metadata of {name} is unusable: {exc}") from None
    deadline = trio.current_time() + WAIT_S
    wait = POLL_S[0]
    waiting_on: set[str] = set()  # files another Mac was downloading at the last look
    for _ in range(ROUNDS_MAX):
        missing = [f for f in weights if not (dest / f).is_file()]
        if not missing:
            return dest
        plan = _plan(copier, config, wm, needs)
        prefix = f"{name}: "
        elsewhere = {k[len(prefix):]: n for k, n in copier.hub_downloads.now().items() if k.startswith(prefix)}
        ended = (waiting_on - elsewhere.keys()) & set(missing)
        waiting_on = set(missing) & elsewhere.keys()
        if ended:  # a download waited for has ended there: copy it (if it failed, it is ours next round)
            if await copier.copy_layers(name, layers) is not None:
                return dest
            continue
        mine = stage_fetch.hub_files_to_download(missing, plan, me, late=trio.current_time() >= deadline,
                                                 elsewhere=elsewhere)
        if mine:
            await _download(copier, repo_id, name, dest, mine)
            continue
        log.debug("waiting for %s of %s from %s", ", ".join(missing), name,
                  ", ".join(sorted({elsewhere.get(f) or plan.get(f, me) for f in missing})))
        if await copier.copy_layers(name, layers) is not None:
            return dest
        await copier.hub_downloads.changed(timeout_s=wait)  # a download there started or ended
        wait = min(wait * 2, POLL_S[1])
    raise models.ModelError(f"gave up fetching layers {layers} of {name} after {ROUNDS_MAX} rounds")


async def _metadata(copier: PeerCopy, repo_id: str, name: str, dest: Path, layers: tuple[int, int] | None) -> None:
    """The model's metadata in ``dest``: from this Mac's cache (the Mac that described the
    model fetched it), else from a Mac that has it (the describing Mac, once its view shows the
    model committed: for up to METADATA_WAIT_S), else from the hub."""
    if (dest / "config.json").is_file():
        return
    cached = await trio.to_thread.run_sync(model_files.cached_metadata, repo_id)
    if cached is not None:
        await trio.to_thread.run_sync(models.link_snapshot, cached, dest)
        return
    wait = POLL_S[0]
    with trio.move_on_after(METADATA_WAIT_S):
        while not (dest / "config.json").is_file():  # bounded by METADATA_WAIT_S
            if await copier.copy_layers(name, layers) is not None:
                return
            if (dest / "config.json").is_file():
                return
            await trio.sleep(wait)
            wait = min(wait * 2, POLL_S[1])
    if not (dest / "config.json").is_file():
        snapshot = await models.fetch_in_thread(lambda: model_files.fetch_metadata(repo_id), f"the metadata of {name}")
        await trio.to_thread.run_sync(models.link_snapshot, snapshot, dest)


async def _download(copier: PeerCopy, repo_id: str, name: str, dest: Path, files: list[str]) -> None:
    """Download these files from the hub one by one, each shown in ``dest`` (and so served to
    the others) as soon as it is whole; their bytes count in this Mac's progress ("hub")."""
    meter = copier.meter
    sizes = {}
    with trio.fail_after(SIZE_TIMEOUT_S):
        for f in files:
            try:
                sizes[f] = await trio.to_thread.run_sync(model_files.hub_file_size, repo_id, f, abandon_on_cancel=True)
            except model_files.ModelFilesError as exc:
                raise models.ModelError(str(exc)) from None
    meter.plan("hub", {f"{name}: {f}": n for f, n in sizes.items()})
    for f in files:
        key = f"{name}: {f}"
        progress = meter.start(key, sizes[f], hub=True)

        def count(n: int, progress: CopyProgress = progress) -> None:
            progress.done += n

        ok = False
        try:
            started = trio.current_time()
            snapshot = await models.fetch_in_thread(lambda f=f, count=count: model_files.fetch_hub_file(repo_id, f, count),
                                                    f"{f} of {name}")
            await trio.to_thread.run_sync(models.link_snapshot, snapshot, dest)
            ok = True
            took = max(trio.current_time() - started, 1e-6)
            log.info("downloaded %s of %s from the hub: %d bytes in %.1f s (%.0f MB/s)", f, name, sizes[f], took,
                     sizes[f] / took / 1e6)
        finally:
            meter.end(key, ok)

