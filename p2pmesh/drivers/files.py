"""The model-file driver: Macs copy model files from each other, so a model on one Mac's
disk reaches the others over Thunderbolt instead of each one downloading it from the
internet (or the user copying it by hand).

It owns the file listener (``serve_files``), the client calls (``list_files``,
``fetch_file``) and their small protocol. A session is mutually authenticated TLS 1.3
(tls.py); after the handshake (integers big-endian):

    client -> server  magic b"P2PF", version (1 byte), request length (2), then a msgpack
                      request: ["list", model] or ["get", model, file, mode]
                      (mode "tcp", the default, or "tls"; version 2's get has no mode)
    server -> client  status (1 byte): 0 ok, 1 no such model or file here, 2 busy,
                      3 unknown version (then the highest version it speaks, 1 byte)
      list, ok:       length (4), then msgpack [[file, size, sha256 hex or ""], ...]
      get, ok:        size (8), the file's SHA-256 (32), the mode it sends in (1: 0 TLS,
                      1 TCP), and for TCP a one-time token (32) for the data connection
      then, per range the client wants: offset (8), length (8) over TLS; the server sends
                      those bytes of the file, on the data connection (TCP) or in the TLS
                      session; a length of 0 ends the session.

Version 3 moves the bytes over plain TCP with zero copy (file_data.py): the data
connection is tied to the session by its token, the server sends with sendfile, and the
client checks the whole file against the SHA-256 the TLS session gave before it keeps it.
Weights are usually public: their integrity is what matters, and it stays end to end. A
Mac that must keep its files confidential serves and asks over TLS (``tls_only`` /
``over_tls``: the agent's --copy-over-tls). A version 2 client (the whole file in the TLS
session, then the SHA-256 of what the server read) is still served.

A copy may be striped: its missing ranges, in pieces of PIECE_BYTES, are shared among
several sessions (holders, or one holder's several addresses: several cables), each
taking the next piece when done. It resumes: what arrived before a failure, a
cancellation or a SIGKILL is kept in ``<file>.partial`` with a sidecar saying which ranges
(file_sink.py), and the next copy of the same version asks only for the rest.

Digests. The server names a file's digest when it knows one: the digest a copy was
verified against (the copy directory's manifest, MANIFEST, that ``fetch_file``'s caller
keeps), the SHA-256 Hugging Face published for a weight file of its cache (the blob's
name), or the one it computed the first time it sent the file (same path, size and
modification time); a get of a file it knows no digest for hashes it first. The client
keeps a file only if its SHA-256 matches the session's and the listed digest. So a file
that rotted on a holder's disk since it was verified (or first sent) is refused by the
next Mac, which takes it from another holder, instead of being passed around the cluster.

Only cluster members can open a session, and the server proves its node id. What it
serves is bounded: only the model the cluster has committed, from the directory this Mac
resolves for it (its own, its copy, or its Hugging Face cache; never a path the client
names), and only if that directory has a config.json; only files with the names a model's
files have (config, tokenizer, safetensors: SERVED_PATTERNS), regular files only; at most
SESSIONS_MAX sessions (so at most as many data connections); a session idle for IDLE_S
ends. The client writes to ``<file>.partial``, checks the digest, fsyncs and renames, so
a file is either whole or absent under its name.
"""
from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import BinaryIO
from dataclasses import dataclass
from pathlib import Path

import msgpack
import trio

from p2pmesh.core.errors import MeshError, RemoteProtocolError
from p2pmesh.drivers import file_data
from p2pmesh.drivers.file_sink import CHECKPOINT_BYTES, Sink, missing
from p2pmesh.drivers.streams import recv_exactly
from p2pmesh.drivers.tls import dial_member, peer_node_id
from p2pmesh.drivers.transport import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("p2pmesh.files")

MAGIC = b"P2PF"
VERSION = 3
VERSIONS = (2, 3)
"""The versions a server answers (2: the whole file inside the TLS session)."""
SESSIONS_MAX = 4
REQUEST_BYTES_MAX = 4096
LISTING_FILES_MAX = 4096
LISTING_BYTES_MAX = 1 << 20
FILE_BYTES_MAX = 1 << 40
"""A safetensors shard is tens of GB at most; a size beyond 1 TiB is a lie."""
IDLE_S = file_data.IDLE_S
"""No byte moved for this long ends a session, on both sides."""
CHUNK = 1 << 20
WRITE_BYTES = 8 << 20
"""The client writes to disk in batches this large (one thread hop each)."""
SERVED_PATTERNS = [
    "config.json", "generation_config.json", "model.safetensors.index.json", "*.safetensors",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "chat_template.*", "*.jinja", "*.tiktoken", "tiktoken.model",
]
"""The files a Hugging Face model directory holds that loading it needs: never whatever else
lies beside them (a member may name any directory, so the names are what bound it)."""
MANIFEST = ".p2pmesh-sha256.json"
"""In a copy directory: {file: [size, sha256 hex]} for every file verified on its way in
(hidden, so never served itself)."""
MANIFEST_BYTES_MAX = 1 << 20
DIGEST_BYTES = 32
PIECE_BYTES = 64 << 20
"""A striped copy hands out the missing bytes in pieces this large."""
SOURCES_MAX = 8
"""Sessions one copy uses at once (holders and their addresses)."""
HASH_BYTES_S_MIN = 100_000_000
"""A server hashing a file before it sends it (no digest known) is given this long per byte."""
OK, MISSING, BUSY, UNKNOWN_VERSION = 0, 1, 2, 3
MODE_TLS, MODE_TCP = 0, 1
_HEADER = struct.Struct(">4sBH")
_STATUS = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_RANGE = struct.Struct(">QQ")

Lookup = Callable[[str], Path | None]
"""model name -> this Mac's directory of that model, or None (never downloads)."""


class FileCopyError(MeshError):
    """A copy from a peer failed; ``reason``: "missing" (the peer has not got it), "busy",
    "refused", "timeout", "wrong_node", "protocol" (the peer broke the protocol), "corrupt"
    (what arrived is not what was listed: the holder's file is damaged)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def servable(name: str) -> bool:
    """A plain file name of a kind a model directory holds (no path, no hidden file)."""
    return (
        0 < len(name) <= 255 and "/" not in name and "\\" not in name and not name.startswith(".")
        and any(fnmatch.fnmatch(name, p) for p in SERVED_PATTERNS)
    )


def read_manifest(directory: Path) -> dict[str, tuple[int, str]]:
    """A copy directory's verified digests (empty when there is none or it is unreadable:
    the files are then listed without digests, never refused)."""
    import json

    try:
        path = directory / MANIFEST
        if path.stat().st_size > MANIFEST_BYTES_MAX:
            return {}
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, tuple[int, str]] = {}
    if isinstance(raw, dict):
        for name, entry in raw.items():
            if (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and _is_digest(entry[1])
                    and servable(name)):
                out[name] = (entry[0], entry[1])
    return out


def write_manifest(directory: Path, digests: dict[str, tuple[int, str]]) -> None:
    """Replace the manifest atomically (blocking)."""
    import json

    from p2pmesh.drivers.storage import write_atomically

    write_atomically(directory / MANIFEST, json.dumps({k: list(v) for k, v in sorted(digests.items())}).encode())


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * DIGEST_BYTES and all(c in "0123456789abcdef" for c in value)


class _Digests:
    """The digests this server computed while sending, by (real path, size, mtime in ns): a
    file replaced by the user gets a new key, one that rotted keeps the old digest."""

    ENTRIES_MAX = 4096

    def __init__(self) -> None:
        self.known: dict[tuple[str, int, int], str] = {}

    @staticmethod
    def key(path: Path) -> tuple[str, int, int]:
        st = path.stat()
        return (str(path.resolve()), st.st_size, st.st_mtime_ns)

    def get(self, path: Path) -> str:
        try:
            return self.known.get(self.key(path), "")
        except OSError:
            return ""

    def learn(self, key: tuple[str, int, int], digest: str) -> None:
        if key in self.known:
            return  # the first digest is the reference: a later, different one is damage
        if len(self.known) >= self.ENTRIES_MAX:
            del self.known[next(iter(self.known))]
        self.known[key] = digest


def hub_digest(path: Path) -> str:
    """The SHA-256 Hugging Face published for a file of its cache, or "": the hub cache keeps
    a large (LFS) file as ``blobs/<its SHA-256>``, which the snapshot links to. Small files
    are named by their git hash instead (40 characters) and give nothing."""
    try:
        blob = path.resolve()
    except OSError:
        return ""
    return blob.name if blob != path.absolute() and blob.parent.name == "blobs" and _is_digest(blob.name) else ""


def _listing(directory: Path, digests: _Digests) -> list[tuple[str, int, str]]:
    """The servable files with their sizes and best-known digests: a copy's verified one
    (its manifest), the hub's, or the one this server computed when it first sent the file."""
    manifest = read_manifest(directory)
    out = []
    for entry in sorted(directory.iterdir()):
        if servable(entry.name) and entry.is_file():  # follows the hub cache's symlinks to blobs
            size = entry.stat().st_size
            out.append((entry.name, size, _known_digest(entry, size, manifest, digests)))
        if len(out) >= LISTING_FILES_MAX:
            break
    return out


def _known_digest(path: Path, size: int, manifest: dict[str, tuple[int, str]], digests: _Digests) -> str:
    verified = manifest.get(path.name)
    return verified[1] if verified and verified[0] == size else hub_digest(path) or digests.get(path)


def _digest_for_sending(directory: Path, path: Path, f: BinaryIO, digests: _Digests) -> str:
    """The digest a get answers with (blocking): the best known, else the file hashed now
    (and remembered, as the reference a later rotten copy is measured against)."""
    size = os.fstat(f.fileno()).st_size
    known = _known_digest(path, size, read_manifest(directory), digests)
    if known:
        return known
    key = digests.key(path)
    h = hashlib.sha256()
    left = size
    while left > 0:
        chunk = os.pread(f.fileno(), min(WRITE_BYTES, left), size - left)
        if not chunk:
            raise OSError(f"{path} shrank while being hashed")
        h.update(chunk)
        left -= len(chunk)
    digests.learn(key, h.hexdigest())
    return digests.known.get(key, h.hexdigest())


# ----------------------------------------------------------------------------------
# Server


async def serve_files(listeners: list[trio.SocketListener], server_ctx: ssl.SSLContext, lookup: Lookup, *,
                      tls_only: bool = False, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve model files on these listeners for ever; ``tls_only``: never send file bytes
    outside the TLS session (a Mac whose files must stay confidential)."""
    server = _Server(server_ctx, lookup, trio.CapacityLimiter(SESSIONS_MAX), _Digests(), tls_only)
    task_status.started()
    await trio.serve_listeners(server.connection, listeners)


class _Server:
    def __init__(self, server_ctx: ssl.SSLContext, lookup: Lookup, slots: trio.CapacityLimiter, digests: _Digests,
                 tls_only: bool) -> None:
        self.server_ctx, self.lookup, self.slots, self.digests = server_ctx, lookup, slots, digests
        self.tls_only = tls_only
        self.tickets = file_data.Tickets()

    async def connection(self, stream: trio.SocketStream) -> None:
        """A TLS session, or a data connection bringing a session's token (its first byte says)."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                first = await stream.socket.recv(1, socket.MSG_PEEK)
        except (trio.TooSlowError, OSError):
            first = b""
        if first != file_data.DATA_MAGIC[:1]:
            await self.session(stream)  # a TLS ClientHello (anything else fails the handshake)
            return
        try:
            await self.tickets.redeem(stream)
        finally:
            await trio.aclose_forcefully(stream)

    async def session(self, stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, self.server_ctx, server_side=True)
        busy = False
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            busy = True
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                await tls.do_handshake()
            peer = peer_node_id(tls.getpeercert(binary_form=True))
            version, request = await _read_request(tls)
            if version not in VERSIONS:
                await tls.send_all(_STATUS.pack(UNKNOWN_VERSION) + _STATUS.pack(VERSION))
                return
            if busy:
                await tls.send_all(_STATUS.pack(BUSY))
                return
            await self._answer(tls, version, request, peer)
        except (trio.BrokenResourceError, trio.TooSlowError, OSError, RemoteProtocolError, ValueError) as exc:
            log.debug("file session closed: %r", exc)  # the client's (or the network's) doing
        finally:
            if not busy:
                self.slots.release()
            await trio.aclose_forcefully(tls)

    async def _answer(self, tls: trio.SSLStream[trio.SocketStream], version: int, request: list[str], peer: str) -> None:
        directory = await trio.to_thread.run_sync(self.lookup, request[1])
        if request[0] == "list":
            files = await trio.to_thread.run_sync(_listing, directory, self.digests) if directory is not None else None
            if files is None:
                await tls.send_all(_STATUS.pack(MISSING))
                return
            body = msgpack.packb([list(f) for f in files])
            await tls.send_all(_STATUS.pack(OK) + _U32.pack(len(body)) + body)
            return
        name = request[2]
        path = directory / name if directory is not None and servable(name) else None
        try:
            f = open(path, "rb") if path is not None and path.is_file() else None  # noqa: SIM115 - closed below
        except OSError:
            f = None
        if f is None or directory is None or path is None:
            await tls.send_all(_STATUS.pack(MISSING))
            return
        with f:
            if version == 2:
                await self._send_whole(tls, f, path, request, peer)
            else:
                await self._send_ranges(tls, f, directory, path, request, peer)

    async def _send_ranges(self, tls: trio.SSLStream[trio.SocketStream], f: BinaryIO, directory: Path, path: Path,
                           request: list[str], peer: str) -> None:
        """Version 3: size and digest over TLS, then the ranges the client asks for, on the
        data connection its token opens (or inside the session for TLS)."""
        size = os.fstat(f.fileno()).st_size
        issued = None
        if request[3:] != ["tls"] and not self.tls_only:
            issued = self.tickets.issue(file_data.peer_host(tls))
            if issued is None:
                await tls.send_all(_STATUS.pack(BUSY))
                return
        data: trio.SocketStream | None = None
        try:
            await tls.send_all(_STATUS.pack(OK) + _U64.pack(size))
            digest = await trio.to_thread.run_sync(_digest_for_sending, directory, path, f, self.digests)
            if issued is None:
                await tls.send_all(bytes.fromhex(digest) + _STATUS.pack(MODE_TLS))
            else:
                await tls.send_all(bytes.fromhex(digest) + _STATUS.pack(MODE_TCP) + issued[0])
                data = await self.tickets.await_data(*issued)
                if data is None:
                    raise RemoteProtocolError("no data connection came for the token")
            sent = 0
            for _ in range(FILE_BYTES_MAX // PIECE_BYTES + 1):  # pieces of a file: bounded
                offset, length = _RANGE.unpack(await recv_exactly(tls, _RANGE.size, idle_s=IDLE_S))
                if length == 0:
                    break
                if offset + length > size:
                    raise RemoteProtocolError(f"a range [{offset}, {offset + length}) of a file of {size} bytes")
                if data is not None:
                    await file_data.send_range(data, f, offset, length)
                else:
                    await _send_in_session(tls, f, offset, length)
                sent += length
            log.info("sent %d bytes of %s of %s (%s) to %s", sent, request[2], request[1],
                     "TLS" if data is None else "TCP", peer)
        finally:
            if issued is not None:
                self.tickets.pending.pop(issued[0], None)
                issued[1].released.set()  # the data connection's task closes it

    async def _send_whole(self, tls: trio.SSLStream[trio.SocketStream], f: BinaryIO, path: Path,
                          request: list[str], peer: str) -> None:
        """Version 2: the whole file in the session, then the SHA-256 of what was read."""
        key = await trio.to_thread.run_sync(self.digests.key, path)
        size = os.fstat(f.fileno()).st_size
        await tls.send_all(_STATUS.pack(OK) + _U64.pack(size))
        left = size
        h = hashlib.sha256()

        def read(n: int) -> bytes:
            chunk = f.read(n)
            h.update(chunk)  # in the same thread hop: hashlib releases the GIL
            return chunk

        while left > 0:
            chunk = await trio.to_thread.run_sync(read, min(CHUNK, left))
            if not chunk:
                raise OSError(f"{path} shrank while being sent")
            with trio.fail_after(IDLE_S):
                await tls.send_all(chunk)
            left -= len(chunk)
        digest = h.digest()
        await tls.send_all(digest)
        self.digests.learn(key, digest.hex())
        log.info("sent %s of %s (%d bytes, version 2) to %s", request[2], request[1], size, peer)


async def _send_in_session(tls: trio.SSLStream[trio.SocketStream], f: BinaryIO, offset: int, length: int) -> None:
    left = length
    while left > 0:
        chunk = await trio.to_thread.run_sync(os.pread, f.fileno(), min(WRITE_BYTES, left), offset + length - left)
        if not chunk:
            raise OSError("the file shrank while being sent")
        with trio.fail_after(IDLE_S):
            await tls.send_all(chunk)
        left -= len(chunk)


async def _read_request(tls: trio.SSLStream[trio.SocketStream]) -> tuple[int, list[str]]:
    magic, version, length = _HEADER.unpack(await recv_exactly(tls, _HEADER.size, idle_s=IDLE_S))
    if magic != MAGIC or length > REQUEST_BYTES_MAX:
        raise RemoteProtocolError(f"bad file request header (magic {magic!r}, version {version}, length {length})")
    if version not in VERSIONS:
        return version, []  # answered with the versions this server speaks, body unread
    try:
        request = msgpack.unpackb(await recv_exactly(tls, length, idle_s=IDLE_S), raw=False, max_str_len=REQUEST_BYTES_MAX)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types on garbage
        raise RemoteProtocolError(f"file request is not msgpack: {exc.__class__.__name__}") from None
    modes = ([], ["tcp"], ["tls"]) if version >= 3 else ([],)  # version 3: the mode may be left out (TCP)
    ok = isinstance(request, list) and all(isinstance(x, str) for x in request) and (
        (len(request) == 2 and request[0] == "list")
        or (len(request) in (3, 4) and request[0] == "get" and request[3:] in modes))
    if not ok:
        raise RemoteProtocolError(f"unknown file request {str(request)[:100]}")
    return version, request


# ----------------------------------------------------------------------------------
# Client


@dataclass(frozen=True, slots=True)
class Source:
    """A holder of a file at one of its addresses: host, file port and the node id it must prove."""

    host: str
    port: int
    node: str


@dataclass(eq=False)
class CopyProgress:
    """Bytes of a file copy done and in all (updated from the receive threads; read anywhere),
    and of those done, how many a previous copy had left (resumed)."""

    done: int = 0
    total: int = 0
    kept: int = 0


async def _session(host: str, port: int, client_ctx: ssl.SSLContext, expected: str,
                   request: list[str]) -> trio.SSLStream[trio.SocketStream]:
    body = msgpack.packb(request)
    with trio.fail_after(HANDSHAKE_TIMEOUT_S):
        tls, peer = await dial_member(host, port, client_ctx)
        try:
            if peer != expected:
                raise FileCopyError("wrong_node", f"{host} port {port} is {peer}, expected {expected}")
            await tls.send_all(_HEADER.pack(MAGIC, VERSION, len(body)) + body)
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
    try:
        (status,) = _STATUS.unpack(await recv_exactly(tls, 1, idle_s=IDLE_S))
        if status == UNKNOWN_VERSION:
            (theirs,) = _STATUS.unpack(await recv_exactly(tls, 1, idle_s=IDLE_S))
            raise FileCopyError("version", f"{expected} speaks file protocol version {theirs} at most, not {VERSION}")
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    if status != OK:
        await trio.aclose_forcefully(tls)
        what = request[2] if len(request) > 2 else "its files"
        if status == BUSY:
            raise FileCopyError("busy", f"{expected} is sending to others")
        raise FileCopyError("missing", f"{expected} has not got {what} of {request[1]}")
    return tls


def _translate(host: str, port: int, exc: BaseException) -> FileCopyError:
    if isinstance(exc, FileCopyError):
        return exc
    if isinstance(exc, (trio.TooSlowError, TimeoutError)):
        return FileCopyError("timeout", f"{host} port {port} went silent for {IDLE_S:.0f} s")
    if isinstance(exc, (RemoteProtocolError, ValueError)):
        return FileCopyError("protocol", f"{host} port {port}: {exc}")
    return FileCopyError("refused", f"{host} port {port}: {exc!r}")


async def list_files(host: str, port: int, client_ctx: ssl.SSLContext, expected: str,
                     model: str) -> dict[str, tuple[int, str | None]]:
    """The model's files on that peer: name -> (size, SHA-256 hex if the peer knows it)."""
    try:
        tls = await _session(host, port, client_ctx, expected, ["list", model])
        try:
            (length,) = _U32.unpack(await recv_exactly(tls, 4, idle_s=IDLE_S))
            if length > LISTING_BYTES_MAX:
                raise RemoteProtocolError(f"a listing of {length} bytes")
            raw = msgpack.unpackb(await recv_exactly(tls, length, idle_s=IDLE_S), raw=False)
        finally:
            await trio.aclose_forcefully(tls)
    except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError, ValueError) as exc:
        raise _translate(host, port, exc) from None
    except Exception as exc:  # noqa: BLE001 - msgpack garbage
        raise FileCopyError("protocol", f"{host} port {port}: listing is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(raw, list) or len(raw) > LISTING_FILES_MAX:
        raise FileCopyError("protocol", f"{host} port {port}: a listing that is not a list of files")
    out: dict[str, tuple[int, str | None]] = {}
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and servable(item[0])
                and type(item[1]) is int and 0 <= item[1] <= FILE_BYTES_MAX and (item[2] == "" or _is_digest(item[2]))):
            raise FileCopyError("protocol", f"{host} port {port}: a listing entry {str(item)[:80]}")
        out[item[0]] = (item[1], item[2] or None)
    return out


@dataclass(eq=False)
class _Get:
    """An open get session: its TLS control stream, the data connection (None: bytes come in
    the TLS session), and the size and digest the holder gave."""

    source: Source
    tls: trio.SSLStream[trio.SocketStream]
    data: trio.SocketStream | None
    size: int
    digest: str

    async def close(self) -> None:
        try:
            with trio.move_on_after(1):
                await self.tls.send_all(_RANGE.pack(0, 0))  # done: the server ends the session now
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        if self.data is not None:
            await trio.aclose_forcefully(self.data)
        await trio.aclose_forcefully(self.tls)

    async def fetch(self, sink: Sink, offset: int, length: int) -> None:
        """Bytes [offset, offset + length) into the sink."""
        await self.tls.send_all(_RANGE.pack(offset, length))
        if self.data is not None:
            await file_data.receive_range(self.data, sink, offset, length)
            return
        pos, end = offset, offset + length
        pending = bytearray()
        while pos + len(pending) < end:
            with trio.fail_after(IDLE_S):
                chunk = await self.tls.receive_some(min(CHUNK, end - pos - len(pending)))
            if not chunk:
                raise RemoteProtocolError(f"the session closed with {end - pos - len(pending)} bytes to come")
            pending += chunk
            if len(pending) >= WRITE_BYTES or pos + len(pending) == end:
                # TLS hands over ~16 KiB records: write in large batches, one thread hop each.
                await trio.to_thread.run_sync(sink.write, pos, memoryview(bytes(pending)))
                pos += len(pending)
                pending.clear()


async def _open_get(source: Source, client_ctx: ssl.SSLContext, model: str, name: str, over_tls: bool,
                    size_expected: int | None) -> _Get:
    tls = await _session(source.host, source.port, client_ctx, source.node,
                         ["get", model, name, "tls" if over_tls else "tcp"])
    try:
        (size,) = _U64.unpack(await recv_exactly(tls, 8, idle_s=IDLE_S))
        if size > FILE_BYTES_MAX or (size_expected is not None and size != size_expected):
            raise RemoteProtocolError(f"{name} of {size} bytes (listed as {size_expected})")
        # A holder that knows no digest hashes the file before it answers: give it the time.
        with trio.fail_after(IDLE_S + size / HASH_BYTES_S_MIN):
            digest, mode = await recv_exactly(tls, DIGEST_BYTES), await recv_exactly(tls, 1)
        data = None
        if mode[0] == MODE_TCP and not over_tls:
            token = await recv_exactly(tls, file_data.TOKEN_BYTES, idle_s=IDLE_S)
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                data = await file_data.open_data(source.host, source.port, token)
        elif mode[0] != MODE_TLS:
            raise RemoteProtocolError(f"sending mode {mode[0]} (asked for {'TLS' if over_tls else 'TCP'})")
        return _Get(source, tls, data, size, digest.hex())
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise


class _Pieces:
    """What is left of a file, handed out in pieces to the sessions of a striped copy; a
    session that fails gives back the part of its piece that did not arrive."""

    def __init__(self, todo: list[tuple[int, int]], piece_bytes: int) -> None:
        self.queue: deque[tuple[int, int]] = deque(
            (a, min(a + piece_bytes, end)) for start, end in todo for a in range(start, end, piece_bytes))
        self.out = 0
        self.changed = trio.Event()

    async def take(self) -> tuple[int, int] | None:
        """The next piece, or None when all are taken and none can come back."""
        while not self.queue:
            if self.out == 0:
                return None
            await self.changed.wait()
        self.out += 1
        return self.queue.popleft()

    def settle(self, back: list[tuple[int, int]]) -> None:
        self.out -= 1
        self.queue.extendleft(reversed(back))  # first again: the hash reads in file order
        self.changed.set()
        self.changed = trio.Event()


async def fetch_file(host: str, port: int, client_ctx: ssl.SSLContext, expected: str, model: str, name: str,
                     dest_dir: Path, *, size_expected: int | None = None, digest_expected: str | None = None,
                     over_tls: bool = False, also: Sequence[Source] = (), progress: CopyProgress | None = None,
                     piece_bytes: int = PIECE_BYTES, checkpoint_bytes: int = CHECKPOINT_BYTES) -> tuple[int, str]:
    """Copy one file of the model from that peer into dest_dir (whole and as listed, or not
    at all under its name); returns its size and SHA-256 hex. ``also``: more sources of the
    same file (other holders, other addresses) to stripe it over. What arrived before a
    failure or a cancellation is kept for the next copy (file_sink.py), except when the
    file proves corrupt: FileCopyError "corrupt" when its SHA-256 is not the one the session
    gave or the listed one. ``over_tls``: the bytes travel inside the TLS session."""
    if not servable(name):
        raise ValueError(f"{name!r} is not a model file name")
    first = Source(host, port, expected)
    try:
        get = await _open_get(first, client_ctx, model, name, over_tls, size_expected)
    except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError, ValueError) as exc:
        raise _translate(host, port, exc) from None
    try:
        if digest_expected is not None and get.digest != digest_expected:
            raise FileCopyError("corrupt", f"{name} on {expected} is not the file it was verified as "
                                           f"(SHA-256 {get.digest[:16]}..., listed {digest_expected[:16]}...): its copy is damaged")
        return await _receive(get, [s for s in also if s != first][: SOURCES_MAX - 1], client_ctx, model, name,
                              dest_dir, over_tls, progress, piece_bytes, checkpoint_bytes)
    finally:
        await get.close()


async def _receive(get: _Get, others: list[Source], client_ctx: ssl.SSLContext, model: str, name: str, dest_dir: Path,
                   over_tls: bool, progress: CopyProgress | None, piece_bytes: int, checkpoint_bytes: int) -> tuple[int, str]:
    size, digest = get.size, get.digest
    if progress is not None:
        progress.total, progress.done = size, 0

    def count(n: int) -> None:
        if progress is not None:
            progress.done += n

    sink = Sink(dest_dir / f"{name}.partial", size, digest, checkpoint_bytes=checkpoint_bytes, on_bytes=count)
    kept = await trio.to_thread.run_sync(sink.open)
    count(kept)
    if progress is not None:
        progress.kept = kept
    keep = True
    try:
        if kept:
            log.info("resuming %s of %s: %d of %d bytes kept", name, model, kept, size)
        pieces = _Pieces(sink.todo(), max(piece_bytes, 1 << 20))
        errors: list[FileCopyError] = []

        async def work(source: Source, opened: _Get | None) -> None:
            g = opened
            try:
                if g is None:
                    g = await _open_get(source, client_ctx, model, name, over_tls, size)
                if g.digest != digest:
                    raise FileCopyError("corrupt", f"{source.node} lists {name} with another SHA-256 than {get.source.node}")
                while (piece := await pieces.take()) is not None:
                    try:
                        await g.fetch(sink, piece[0], piece[1] - piece[0])
                    finally:
                        pieces.settle([r for r in missing(sink.ranges, size) if r[0] < piece[1] and r[1] > piece[0]]
                                      if piece[1] > piece[0] else [])
            except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError,
                    ValueError) as exc:
                errors.append(_translate(source.host, source.port, exc))
                log.info("copying %s of %s from %s stopped: %s", name, model, source.node, errors[-1])
            finally:
                if g is not None and g is not opened:
                    await g.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work, get.source, get)
            for source in others:
                nursery.start_soon(work, source, None)
        if sink.todo():
            raise next((e for e in errors if e.reason != "busy"), errors[0] if errors else
                       FileCopyError("protocol", f"{name}: bytes missing and nobody failed"))
        got = await trio.to_thread.run_sync(sink.finish)
        if got != digest:
            keep = False
            raise FileCopyError("corrupt", f"{name} from {get.source.node} is not the file it listed (SHA-256 "
                                           f"{got[:16]}..., listed {digest[:16]}...): its copy is damaged, or the "
                                           "bytes were altered on their way")
        await trio.to_thread.run_sync(sink.commit, dest_dir / name)
        return size, got
    finally:
        sink.close(keep=keep)
