"""The model-file driver: Macs copy model files from each other over mutually authenticated
TLS 1.3 (tls.py), so a model on one Mac's disk reaches the others over Thunderbolt instead
of each one downloading it from the internet (or the user copying it by hand).

It owns the file listener (``serve_files``), the client calls (``list_files``,
``fetch_file``) and their small protocol. After the handshake (integers big-endian):

    client -> server  magic b"P2PF", version (1 byte), request length (2), then a msgpack
                      request: ["list", model] or ["get", model, file]
    server -> client  status (1 byte): 0 ok, 1 no such model or file here, 2 busy
      list, ok:       length (4), then msgpack [[file, size, sha256 hex or ""], ...]
      get, ok:        size (8), exactly that many bytes of the file, then the SHA-256 (32)
                      of the bytes the server read from its disk for this answer

Digests travel with the files (version 2). The server lists a file's digest when it knows
one: the digest a copy was verified against (the copy directory's manifest, MANIFEST, that
``fetch_file``'s caller keeps), the SHA-256 Hugging Face published for a weight file of its
cache (the blob's name), or the one it computed the first time it sent the file (same
path, size and modification time). The client hashes what it receives and keeps the file
only if that matches both the server's trailer and the listed digest. So a file that rotted
on a holder's disk since it was verified (or since it was first sent) is refused by the
next Mac, which takes it from another holder, instead of being passed around the cluster.

Only cluster members can connect, and the server proves its node id. What it serves is
bounded: only the model the cluster has committed, from the directory this Mac resolves for
it (its own, its copy, or its Hugging Face cache; never a path the client names), and only
if that directory has a config.json; only files with the names a model's files have
(config, tokenizer, safetensors: SERVED_PATTERNS), regular files only; at most SESSIONS_MAX sessions; a session idle for IDLE_S ends. The client writes to
``<file>.partial``, checks the size, fsyncs and renames, so a file is either whole or absent.
"""
from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import ssl
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import trio

from p2pmesh.core.errors import MeshError, RemoteProtocolError
from p2pmesh.drivers.streams import recv_exactly
from p2pmesh.drivers.tls import dial_member, peer_node_id
from p2pmesh.drivers.transport import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("p2pmesh.files")

MAGIC = b"P2PF"
VERSION = 2
SESSIONS_MAX = 4
REQUEST_BYTES_MAX = 4096
LISTING_FILES_MAX = 4096
LISTING_BYTES_MAX = 1 << 20
FILE_BYTES_MAX = 1 << 40
"""A safetensors shard is tens of GB at most; a size beyond 1 TiB is a lie."""
IDLE_S = 30.0
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
OK, MISSING, BUSY = 0, 1, 2
_HEADER = struct.Struct(">4sBH")
_STATUS = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

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
            verified = manifest.get(entry.name)
            digest = verified[1] if verified and verified[0] == size else hub_digest(entry) or digests.get(entry)
            out.append((entry.name, size, digest))
        if len(out) >= LISTING_FILES_MAX:
            break
    return out


# ----------------------------------------------------------------------------------
# Server


async def serve_files(listeners: list[trio.SocketListener], server_ctx: ssl.SSLContext, lookup: Lookup, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve model files on these listeners for ever."""
    server = _Server(server_ctx, lookup, trio.CapacityLimiter(SESSIONS_MAX), _Digests())
    task_status.started()
    await trio.serve_listeners(server.session, listeners)


class _Server:
    def __init__(self, server_ctx: ssl.SSLContext, lookup: Lookup, slots: trio.CapacityLimiter, digests: _Digests) -> None:
        self.server_ctx, self.lookup, self.slots, self.digests = server_ctx, lookup, slots, digests

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
            request = await _read_request(tls)
            if busy:
                await tls.send_all(_STATUS.pack(BUSY))
                return
            await self._answer(tls, request, peer)
        except (trio.BrokenResourceError, trio.TooSlowError, OSError, RemoteProtocolError, ValueError) as exc:
            log.debug("file session closed: %r", exc)  # the client's (or the network's) doing
        finally:
            if not busy:
                self.slots.release()
            await trio.aclose_forcefully(tls)

    async def _answer(self, tls: trio.SSLStream[trio.SocketStream], request: list[str], peer: str) -> None:
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
        if f is None:
            await tls.send_all(_STATUS.pack(MISSING))
            return
        with f:
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
        log.info("sent %s of %s (%d bytes) to %s", name, request[1], size, peer)


async def _read_request(tls: trio.SSLStream[trio.SocketStream]) -> list[str]:
    magic, version, length = _HEADER.unpack(await recv_exactly(tls, _HEADER.size, idle_s=IDLE_S))
    if magic != MAGIC or version != VERSION or length > REQUEST_BYTES_MAX:
        raise RemoteProtocolError(f"bad file request header (magic {magic!r}, version {version}, length {length})")
    try:
        request = msgpack.unpackb(await recv_exactly(tls, length, idle_s=IDLE_S), raw=False, max_str_len=REQUEST_BYTES_MAX)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types on garbage
        raise RemoteProtocolError(f"file request is not msgpack: {exc.__class__.__name__}") from None
    ok = isinstance(request, list) and all(isinstance(x, str) for x in request) and (
        (len(request) == 2 and request[0] == "list") or (len(request) == 3 and request[0] == "get"))
    if not ok:
        raise RemoteProtocolError(f"unknown file request {str(request)[:100]}")
    return request


# ----------------------------------------------------------------------------------
# Client


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
    (status,) = _STATUS.unpack(await recv_exactly(tls, 1, idle_s=IDLE_S))
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
    if isinstance(exc, trio.TooSlowError):
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


async def fetch_file(host: str, port: int, client_ctx: ssl.SSLContext, expected: str, model: str, name: str,
                     dest_dir: Path, *, size_expected: int | None = None, digest_expected: str | None = None) -> tuple[int, str]:
    """Copy one file of the model from that peer into dest_dir (whole and as listed, or not
    at all); returns its size and SHA-256 hex. FileCopyError "corrupt" when the bytes are not
    the ones the server read or not the listed digest."""
    if not servable(name):
        raise ValueError(f"{name!r} is not a model file name")
    partial = dest_dir / f"{name}.partial"
    try:
        tls = await _session(host, port, client_ctx, expected, ["get", model, name])
        try:
            (size,) = _U64.unpack(await recv_exactly(tls, 8, idle_s=IDLE_S))
            if size > FILE_BYTES_MAX or (size_expected is not None and size != size_expected):
                raise RemoteProtocolError(f"{name} of {size} bytes (listed as {size_expected})")
            await trio.to_thread.run_sync(lambda: dest_dir.mkdir(parents=True, exist_ok=True))
            h = hashlib.sha256()

            def write(data: bytes) -> None:
                h.update(data)
                out.write(data)

            with open(partial, "wb") as out:
                left = size
                pending = bytearray()
                while left > 0:
                    with trio.fail_after(IDLE_S):
                        chunk = await tls.receive_some(min(CHUNK, left))
                    if not chunk:
                        raise RemoteProtocolError(f"{name}: connection closed with {left} of {size} bytes missing")
                    pending += chunk
                    left -= len(chunk)
                    if len(pending) >= WRITE_BYTES or left == 0:
                        # TLS hands over ~16 KiB records: write in large batches, one thread hop each.
                        await trio.to_thread.run_sync(write, bytes(pending))
                        pending.clear()
                trailer = await recv_exactly(tls, DIGEST_BYTES, idle_s=IDLE_S)
                got = h.hexdigest()
                if trailer.hex() != got:
                    raise FileCopyError("corrupt", f"{name} from {expected}: the bytes that arrived are not the ones it read")
                if digest_expected is not None and got != digest_expected:
                    raise FileCopyError("corrupt", f"{name} on {expected} is not the file it was verified as "
                                                   f"(SHA-256 {got[:16]}..., listed {digest_expected[:16]}...): its copy is damaged")
                await trio.to_thread.run_sync(out.flush)
                await trio.to_thread.run_sync(os.fsync, out.fileno())
            os.replace(partial, dest_dir / name)
            return size, got
        finally:
            await trio.aclose_forcefully(tls)
    except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise _translate(host, port, exc) from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
