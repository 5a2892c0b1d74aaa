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
"""
from __future__ import annotations

import hashlib
import logging
import re
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pmesh import model_files
from p2pmesh.core.ids import NodeId
from p2pmesh.drivers.files import FileCopyError, fetch_file, list_files, read_manifest, write_manifest

if TYPE_CHECKING:
    from p2pmesh.agent import Agent

log = logging.getLogger("p2pmesh.peer_copy")

FILES_PORT_OFFSET = 2
"""The model-file listener is the agent's port + 2 (probes use + 1)."""
PEERS_TRIED_MAX = 16
COPIES_CONCURRENT = 3
"""Files copied at once (a member serves at most 4 sessions: drivers/files.SESSIONS_MAX)."""
BUSY_ROUNDS_MAX = 12
BUSY_WAIT_S = 0.2
"""A member busy sending to other Macs is asked again after 0.2 s, doubling up to 5 s: up to
about a minute in all before this file counts as unavailable."""
COPY_DIR = "models"
Listing = dict[str, tuple[int, str | None]]
"""A holder's files: name -> (size, SHA-256 hex if it knows it)."""


def copy_dir(state_dir: Path, name: str) -> Path:
    """Where this Mac keeps the model files it copied from others: a readable tail of the
    name plus a hash, so two names never share a directory."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip("/"))[-48:].strip("-.") or "model"
    return state_dir / COPY_DIR / f"{tail}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def prune_copies(state_dir: Path, keep: str) -> list[Path]:
    """Delete this Mac's copies of every model but ``keep`` (blocking); returns what went.
    They are p2pmesh's own files, and a model's can be hundreds of GB; a model chosen again
    is copied again, over Thunderbolt."""
    import shutil

    wanted = copy_dir(state_dir, keep)
    gone = []
    for d in sorted((state_dir / COPY_DIR).glob("*")) if (state_dir / COPY_DIR).is_dir() else []:
        if d != wanted and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def model_dir(name: str, root: Path | None, state_dir: Path) -> str:
    """What a worker of this Mac loads the model from: its own directory, else its copy
    (from the other Macs, or linked from the Hugging Face cache), else the name itself."""
    from p2pmesh import models

    local = models.located(name, root)
    if Path(local).expanduser().is_dir():
        return local
    mine = copy_dir(state_dir, name)
    return str(mine) if (mine / "config.json").is_file() else local


def _weights_for(directory: Path, layers: tuple[int, int] | None) -> list[str] | None:
    """The weight files layers [start, end) load (None: the measured layer), from the
    directory's config and index; None without an index (the one weight file, whatever its name)."""
    config = model_files.read_config(directory)
    wm = model_files.weight_map(directory)
    if wm is None:
        return None
    return model_files.files_for_layers(config, wm, *(layers or model_files.measured_layers(config)))


def has_layers(directory: Path, layers: tuple[int, int] | None) -> bool:
    """The directory holds config.json and every weight file those layers load."""
    try:
        needed = _weights_for(directory, layers)
    except (model_files.ModelFilesError, OSError, ValueError):
        return False
    if needed is None:
        return any(directory.glob("*.safetensors"))
    return all((directory / f).is_file() for f in needed)


def link_snapshot(snapshot: Path, dest: Path) -> None:
    """Make ``dest`` show a Hugging Face snapshot's files (symlinks; blocking), so this Mac
    loads, and serves to the others, one directory whatever each file came from."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in snapshot.iterdir():
        target = dest / f.name
        if f.is_file() and not target.exists():
            target.unlink(missing_ok=True)  # a dangling link from an evicted cache entry
            try:
                target.symlink_to(f.resolve())
            except FileExistsError:  # linked meanwhile by another fetch of the same model
                pass


def _peers(agent: Agent) -> list[tuple[NodeId, list[tuple[str, int]]]]:
    """Other members with the (host, file port) pairs to try, neighbours in the ring first."""
    m = agent.machine
    if m is None or m.raft is None:
        return []
    state = m.raft.state
    me = agent.identity.node_id
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


async def copy_layers(agent: Agent, name: str, layers: tuple[int, int] | None) -> Path | None:
    """This Mac's copy of what layers [start, end) of the model need (None: the layer a
    measurement times), from the other Macs; None when they have not got it all (the
    caller then tries Hugging Face)."""
    lock = agent.copy_locks.setdefault(name, trio.Lock())
    async with lock:
        return await _copy_layers(agent, name, layers)


async def _copy_layers(agent: Agent, name: str, layers: tuple[int, int] | None) -> Path | None:
    dest = copy_dir(agent.config.state_dir, name)
    if await trio.to_thread.run_sync(has_layers, dest, layers):
        return dest
    peers = _peers(agent)
    if not peers:
        return None
    _, client_ctx = agent.credentials.contexts()
    listings: list[tuple[NodeId, tuple[str, int], Listing]] = []
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
    if not await _copy(dest, name, metadata, listings, client_ctx):
        return None
    try:
        weights = _weights_for(dest, layers)
        if weights is None:
            weights = sorted({f for _, _, files in listings for f in files if f.endswith(".safetensors")})
    except (model_files.ModelFilesError, OSError, ValueError) as exc:
        log.warning("the copied metadata of %s is unusable: %s", name, exc)
        return None
    if not weights or not await _copy(dest, name, weights, listings, client_ctx):
        return None
    return dest


async def _copy(dest: Path, name: str, files: list[str], listings: list[tuple[NodeId, tuple[str, int], Listing]],
                client_ctx: ssl.SSLContext) -> bool:
    """Copy each file that is not here yet, COPIES_CONCURRENT at a time, each from the members
    that list it (the i-th file asks the i-th holder first, so several Macs share the work;
    one TLS stream is bounded by one core). Each file is checked against the digest its
    holder lists (drivers/files.py), and the verified digests go into this copy's manifest,
    which this Mac lists in turn. True when every file is here."""
    failed: list[str] = []
    slots = trio.Semaphore(COPIES_CONCURRENT)
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
        holders = [(node, target, listed[f][0], listed[f][1]) for node, target, listed in listings if f in listed]
        if holders and (dest / f).is_file() and (dest / f).stat().st_size == holders[0][2]:
            return
        holders = holders[i % len(holders):] + holders[: i % len(holders)] if holders else []
        async with slots:
            for round_ in range(BUSY_ROUNDS_MAX):
                busy = False
                for node, target, size, digest in holders:
                    started = trio.current_time()
                    try:
                        _, got = await fetch_file(target[0], target[1], client_ctx, node, name, f, dest,
                                                  size_expected=size, digest_expected=digest)
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


def lookup(agent: Agent, name: str) -> Path | None:
    """What this Mac serves for a model name (blocking; never downloads): nothing unless it
    is the model the cluster committed, then its own directory, its copy from others, or its
    Hugging Face cache, whichever has a config.json."""
    from p2pmesh import models

    m = agent.machine
    committed = m.raft.state.model if m is not None and m.raft is not None else None
    if committed is None or committed.name != name:
        return None
    candidates = [Path(models.located(name, agent.config.model_root)).expanduser(), copy_dir(agent.config.state_dir, name)]
    if model_files.is_hub_id(name):
        try:
            from huggingface_hub import snapshot_download

            candidates.append(Path(snapshot_download(name, local_files_only=True)))
        except Exception:  # noqa: BLE001 - not cached here (or a bad id)
            pass
    return next((c for c in candidates if (c / "config.json").is_file()), None)
