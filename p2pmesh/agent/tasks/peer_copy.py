"""Copying a model's files from the other Macs (agent side, trio; drivers/files.py moves
the bytes).

A Mac that has not got a model (a local directory only one Mac holds, or a Hugging Face
id another Mac already fetched) asks the cluster's members for it before anything else:
over Thunderbolt a shard arrives in seconds, and the internet is not needed at all for a
model that is on one Mac's disk. Only what this Mac needs is copied: the metadata
(config, index, tokenizer) and the weight files holding the layers it loads
(model_files.files_for_layers). Copies go to ``<state dir>/models/<name>``, which is where
this Mac then loads the model from, and which it serves to the others in turn.

Members are asked in ring order starting from this Mac's neighbours (the Macs it is
cabled to), each at its committed addresses, at port + FILES_PORT_OFFSET. A member that
has not got a file, is busy or cannot be reached is skipped; if no member has everything
needed, the caller falls back to Hugging Face (or reports the model missing).

Who the members are, and which model the cluster committed (the only one this Mac serves),
come from the ClusterView (agent/ports.py): committed and durable state only.
"""
from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from p2pmesh.agent.models import weights_for, copy_dir, has_layers, located
from p2pmesh.agent.ports import ClusterView, HubDownloads
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import ClusterState
from p2pmesh.drivers import model_files
from p2pmesh.drivers.files import (
    CopyProgress,
    FileCopyError,
    Source,
    fetch_file,
    list_files,
    read_manifest,
    write_manifest,
)

log = logging.getLogger("p2pmesh.peer_copy")

FILES_PORT_OFFSET = 2
"""The model-file listener is the agent's port + 2 (probes use + 1)."""
PEERS_TRIED_MAX = 16
COPIES_CONCURRENT = 3
"""Files copied at once (a member serves at most 4 sessions: drivers/files.SESSIONS_MAX)."""
STRIPES_MAX = 4
"""Sessions one file is striped over: its holders, each at each of its addresses (cables).
A source that is busy or fails drops out; the others take its pieces."""
BUSY_ROUNDS_MAX = 12
BUSY_WAIT_S = 0.2
"""A member busy sending to other Macs is asked again after 0.2 s, doubling up to 5 s: up to
about a minute in all before this file counts as unavailable."""
Listing = dict[str, tuple[int, str | None]]
"""A holder's files: name -> (size, SHA-256 hex if it knows it)."""


@dataclass(frozen=True, slots=True)
class ModelPlaces:
    """Where this Mac's models are: its own directories (relative names under
    ``model_root``), and its copies under ``<state_dir>/models/``."""

    state_dir: Path
    model_root: Path | None = None


def _peers(state: ClusterState, me: NodeId) -> list[tuple[NodeId, list[tuple[str, int]]]]:
    """Other members with the (host, file port) pairs to try, neighbours in the ring first."""
    ring = list(state.ring)
    order: list[NodeId] = []
    if me in ring:
        i = ring.index(me)
        for step in range(1, len(ring)):
            for j in (i + step, i - step):
                n = ring[j % len(ring)]
                if n != me and n not in order:
                    order.append(n)
    order += sorted(mem.node_id for mem in state.members if mem.node_id != me and mem.node_id not in order)
    by_id = {mem.node_id: mem for mem in state.members}
    out = []
    for n in order[:PEERS_TRIED_MAX]:
        mem = by_id.get(n)
        if mem is None or not mem.up:
            continue
        targets = []
        for address in mem.addresses:
            host, _, port = address.rpartition(":")
            if port.isdigit():
                targets.append((host.strip("[]"), int(port) + FILES_PORT_OFFSET))
        if targets:
            out.append((n, targets))
    return out


class Meter:
    """This Mac's fetch of its stage's files, as its progress report counts it: bytes
    arrived and in all of the files it had to copy ("peer") or download ("hub"). Written by
    the copies (receive threads included) and read by the fetch task's reporter; plain ints
    and a dict replaced whole, so a read never sees a half-made update."""

    def __init__(self) -> None:
        self.source = "peer"
        self.planned: dict[str, int] = {}
        """The files this fetch has to bring ("model: file" -> bytes; added as each list of
        files is known, once per file whatever brings it)."""
        self.finished = 0
        """Bytes of the files that arrived whole."""
        self.flying: dict[str, CopyProgress] = {}
        """The files arriving now ("model: file" -> bytes done and in all)."""
        self.from_hub: frozenset[str] = frozenset()
        """Those of them downloading from Hugging Face (the others come from Macs)."""

    def reset(self) -> None:
        self.source, self.planned, self.finished, self.flying, self.from_hub = "peer", {}, 0, {}, frozenset()

    def plan(self, source: str, files: dict[str, int]) -> None:
        """These files ("model: file" -> bytes) are to come from ``source`` (the latest
        source names the fetch)."""
        if files:
            self.source = source
            self.planned = {**self.planned, **files}

    def start(self, key: str, size: int, *, hub: bool = False) -> CopyProgress:
        progress = CopyProgress(total=size)
        self.flying = {**self.flying, key: progress}
        if hub:
            self.from_hub = self.from_hub | {key}
        return progress

    def end(self, key: str, ok: bool) -> None:
        progress = self.flying.get(key)
        self.flying = {k: v for k, v in self.flying.items() if k != key}
        self.from_hub = self.from_hub - {key}
        if ok and progress is not None:
            self.finished += progress.total

    def progress(self) -> tuple[int, int]:
        """Bytes done and in all."""
        done = self.finished + sum(c.done for c in self.flying.values())
        total = sum(self.planned.values())
        return min(done, total), total


class PeerCopy:
    """This Mac's copies of models from the other Macs, one copy of a model at a time
    (measure and fetch could otherwise write the same file)."""

    def __init__(self, view: ClusterView, places: ModelPlaces, client_ctx: ssl.SSLContext, *,
                 over_tls: bool = False, hub_downloads: HubDownloads | None = None) -> None:
        self.view = view
        self.hub_downloads = hub_downloads or HubDownloads()
        """What the other Macs are downloading from the hub (hub_share.py waits for those)."""
        self.places = places
        self.client_ctx = client_ctx
        self.over_tls = over_tls
        """The bytes travel inside TLS (--copy-over-tls) instead of a plain TCP data connection."""
        self.meter = Meter()
        """This Mac's fetch, copies from the others and downloads from the hub (agent/tasks/hub_share.py)."""
        self._locks: dict[str, trio.Lock] = {}

    def progress(self) -> tuple[int, int]:
        """Bytes done and in all of this Mac's fetch."""
        return self.meter.progress()

    async def copy_layers(self, name: str, layers: tuple[int, int] | None) -> Path | None:
        """This Mac's copy of what layers [start, end) of the model need (None: the layer a
        measurement times), from the other Macs; None when they have not got it all (the
        caller then tries Hugging Face)."""
        async with self._locks.setdefault(name, trio.Lock()):
            return await self._copy_layers(name, layers)

    async def _copy_layers(self, name: str, layers: tuple[int, int] | None) -> Path | None:
        dest = copy_dir(self.places.state_dir, name)
        if await trio.to_thread.run_sync(has_layers, dest, layers):
            return dest
        snapshot = self.view.current
        peers = _peers(snapshot.state, snapshot.node_id) if snapshot.state is not None else []
        if not peers:
            return None
        client_ctx = self.client_ctx
        listings: list[tuple[NodeId, tuple[str, int], Listing]] = []
        addresses = dict(peers)
        for node, targets in peers:
            for target in targets:
                try:
                    files = await list_files(target[0], target[1], client_ctx, node, name)
                except FileCopyError as exc:
                    log.debug("no listing of %s from %s at %s: %s", name, node, target, exc)
                    if exc.reason == "missing":
                        break  # it answered: it has not got the model
                    continue
                listings.append((node, target, files))
                break
        if not any("config.json" in files for _, _, files in listings):
            return None
        metadata = sorted({f for _, _, files in listings for f in files if not f.endswith(".safetensors")})
        if not await _copy(dest, name, metadata, listings, self._fetcher(addresses), self.meter):
            return None
        try:
            weights = weights_for(dest, layers)
            if weights is None:
                weights = sorted({f for _, _, files in listings for f in files if f.endswith(".safetensors")})
        except (model_files.ModelFilesError, OSError, ValueError) as exc:
            log.warning("the copied metadata of %s is unusable: %s", name, exc)
            return None
        if not weights or not await _copy(dest, name, weights, listings, self._fetcher(addresses), self.meter):
            return None
        return dest

    def _fetcher(self, addresses: dict[NodeId, list[tuple[str, int]]]) -> Fetch:
        """Copy one file from a first holder, striped over the others that list it the same
        (and over every address of each: all the cables), STRIPES_MAX sources at most."""
        async def fetch(name: str, f: str, dest: Path, first: Holder, holders: list[Holder]) -> tuple[int, str]:
            node, target, size, digest = first
            also = [Source(h, p, n) for n, _, s, d in holders if s == size and d == digest
                    for h, p in addresses.get(n, [])]
            key = f"{name}: {f}"
            progress = self.meter.start(key, size)
            ok = False
            try:
                got = await fetch_file(target[0], target[1], self.client_ctx, node, name, f, dest, size_expected=size,
                                       digest_expected=digest, over_tls=self.over_tls,
                                       also=[s for s in also if s != Source(target[0], target[1], node)][: STRIPES_MAX - 1],
                                       progress=progress)
                ok = True
                return got
            finally:
                self.meter.end(key, ok)

        return fetch


Holder = tuple[NodeId, tuple[str, int], int, "str | None"]
"""A member listing a file: its node id, the address it answered at, the file's size and digest."""
Fetch = Callable[[str, str, Path, Holder, list[Holder]], Awaitable[tuple[int, str]]]
"""(model, file, destination, the holder to ask first, all holders) -> the copy's size and digest."""


async def _copy(dest: Path, name: str, files: list[str], listings: list[tuple[NodeId, tuple[str, int], Listing]],
                fetch: Fetch, meter: Meter) -> bool:
    """Copy each file that is not here yet, COPIES_CONCURRENT at a time, each from the members
    that list it (the i-th file asks the i-th holder first, so several Macs share the work,
    and stripes it over the others; a failed copy resumes from what arrived with the next). Each file is checked against the digest its
    holder lists (drivers/files.py), and the verified digests go into this copy's manifest,
    which this Mac lists in turn. True when every file is here."""
    failed: list[str] = []
    slots = trio.Semaphore(COPIES_CONCURRENT)
    sizes = {f: listed[f][0] for _, _, listed in reversed(listings) for f in files if f in listed}
    meter.plan("peer", {f"{name}: {f}": n for f, n in sizes.items()
                        if not ((dest / f).is_file() and (dest / f).stat().st_size == n)})
    verified = await trio.to_thread.run_sync(read_manifest, dest)
    manifest_lock = trio.Lock()

    async def record(f: str, size: int, digest: str) -> None:
        async with manifest_lock:
            verified[f] = (size, digest)
            try:
                await trio.to_thread.run_sync(write_manifest, dest, dict(verified))
            except OSError as exc:  # the copy is good; only its digest is not kept for others
                log.warning("cannot record the digests of %s: %s", dest, exc)

    async def one(i: int, f: str) -> None:
        holders: list[Holder] = [(node, target, listed[f][0], listed[f][1]) for node, target, listed in listings if f in listed]
        if holders and (dest / f).is_file() and (dest / f).stat().st_size == holders[0][2]:
            return
        holders = holders[i % len(holders):] + holders[: i % len(holders)] if holders else []
        async with slots:
            for round_ in range(BUSY_ROUNDS_MAX):
                busy = False
                for holder in holders:
                    node, _, size, _ = holder
                    started = trio.current_time()
                    try:
                        _, got = await fetch(name, f, dest, holder, holders)
                        await record(f, size, got)
                    except FileCopyError as exc:
                        busy = busy or exc.reason == "busy"
                        log.log(logging.DEBUG if exc.reason == "busy" else logging.INFO,
                                "copying %s of %s from %s failed: %s", f, name, node, exc)
                        continue
                    took = max(trio.current_time() - started, 1e-6)
                    log.info("copied %s of %s from %s: %d bytes in %.2f s (%.0f MB/s)", f, name, node, size, took,
                             size / took / 1e6)
                    return
                if not busy:
                    break  # every holder failed for good: no use waiting
                await trio.sleep(min(BUSY_WAIT_S * 2 ** round_, 5.0))  # holders sending to other Macs: wait a turn
        failed.append(f)

    async with trio.open_nursery() as nursery:
        for i, f in enumerate(files):
            nursery.start_soon(one, i, f)
    if failed:
        log.info("no member could give %s of %s", ", ".join(sorted(failed)), name)
    return not failed


def lookup(view: ClusterView, places: ModelPlaces, name: str) -> Path | None:
    """What this Mac serves for a model name (blocking; never downloads): nothing unless it
    is the model the cluster committed, then its own directory, its copy from others, or its
    Hugging Face cache, whichever has a config.json."""
    state = view.current.state
    committed = state.model if state is not None else None
    if committed is None or committed.name != name:
        return None
    candidates = [Path(located(name, places.model_root)).expanduser(), copy_dir(places.state_dir, name)]
    if model_files.is_hub_id(name):
        try:
            from huggingface_hub import snapshot_download

            candidates.append(Path(snapshot_download(name, local_files_only=True)))
        except Exception:  # noqa: BLE001 - not cached here (or a bad id)
            pass
    return next((c for c in candidates if (c / "config.json").is_file()), None)
