"""The model-file driver: Macs copy model files from each other over mutually authenticated
TLS 1.3 (tls.py), so a model on one Mac's disk reaches the others over Thunderbolt instead
of each one downloading it from the internet (or the user copying it by hand).

It owns the file listener (``serve_files``), the client calls (``list_files``,
``fetch_file``) and their small protocol. After the handshake (integers big-endian):

    client -> server  magic b"P2PF", version (1 byte), request length (2), then a msgpack
                      request: ["list", model] or ["get", model, file]
    server -> client  status (1 byte): 0 ok, 1 no such model or file here, 2 busy
      list, ok:       length (4), then msgpack [[file, size], ...]
      get, ok:        size (8), then exactly that many bytes of the file

Only cluster members can connect, and the server proves its node id. What it serves is
bounded: only the model the cluster has committed, from the directory this Mac resolves for
it (its own, its copy, or its Hugging Face cache; never a path the client names), and only
if that directory has a config.json; only files with the names a model's files have
(config, tokenizer, safetensors: SERVED_PATTERNS), regular files only; at most SESSIONS_MAX sessions; a session idle for IDLE_S ends. The client writes to
``<file>.partial``, checks the size, fsyncs and renames, so a file is either whole or absent.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import ssl
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import trio

from p2pmesh.core.errors import MeshError, RemoteProtocolError
from p2pmesh.drivers.tls import dial_member, peer_node_id
from p2pmesh.drivers.transport import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("p2pmesh.files")

MAGIC = b"P2PF"
VERSION = 1
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
OK, MISSING, BUSY = 0, 1, 2
_HEADER = struct.Struct(">4sBH")
_STATUS = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

Lookup = Callable[[str], Path | None]
"""model name -> this Mac's directory of that model, or None (never downloads)."""


class FileCopyError(MeshError):
    """A copy from a peer failed; ``reason``: "missing" (the peer has not got it), "busy",
    "refused", "timeout", "wrong_node", "protocol" (the peer broke the protocol)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def servable(name: str) -> bool:
    """A plain file name of a kind a model directory holds (no path, no hidden file)."""
    return (
        0 < len(name) <= 255 and "/" not in name and "\\" not in name and not name.startswith(".")
        and any(fnmatch.fnmatch(name, p) for p in SERVED_PATTERNS)
    )


def _listing(directory: Path) -> list[tuple[str, int]]:
    out = []
    for entry in sorted(directory.iterdir()):
        if servable(entry.name) and entry.is_file():  # follows the hub cache's symlinks to blobs
            out.append((entry.name, entry.stat().st_size))
        if len(out) >= LISTING_FILES_MAX:
            break
    return out


async def _recv_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        with trio.fail_after(IDLE_S):
            chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise RemoteProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


# ----------------------------------------------------------------------------------
# Server


async def serve_files(listeners: list[trio.SocketListener], server_ctx: ssl.SSLContext, lookup: Lookup, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve model files on these listeners for ever."""
    server = _Server(server_ctx, lookup, trio.CapacityLimiter(SESSIONS_MAX))
    task_status.started()
    await trio.serve_listeners(server.session, listeners)


class _Server:
    def __init__(self, server_ctx: ssl.SSLContext, lookup: Lookup, slots: trio.CapacityLimiter) -> None:
        self.server_ctx, self.lookup, self.slots = server_ctx, lookup, slots

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
            files = await trio.to_thread.run_sync(_listing, directory) if directory is not None else None
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
            size = os.fstat(f.fileno()).st_size
            await tls.send_all(_STATUS.pack(OK) + _U64.pack(size))
            left = size
            while left > 0:
                chunk = await trio.to_thread.run_sync(f.read, min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{path} shrank while being sent")
                with trio.fail_after(IDLE_S):
                    await tls.send_all(chunk)
                left -= len(chunk)
        log.info("sent %s of %s (%d bytes) to %s", name, request[1], size, peer)


async def _read_request(tls: trio.SSLStream[trio.SocketStream]) -> list[str]:
    magic, version, length = _HEADER.unpack(await _recv_exactly(tls, _HEADER.size))
    if magic != MAGIC or version != VERSION or length > REQUEST_BYTES_MAX:
        raise RemoteProtocolError(f"bad file request header (magic {magic!r}, version {version}, length {length})")
    try:
        request = msgpack.unpackb(await _recv_exactly(tls, length), raw=False, max_str_len=REQUEST_BYTES_MAX)
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
    (status,) = _STATUS.unpack(await _recv_exactly(tls, 1))
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


async def list_files(host: str, port: int, client_ctx: ssl.SSLContext, expected: str, model: str) -> dict[str, int]:
    """The model's files on that peer: name -> size."""
    try:
        tls = await _session(host, port, client_ctx, expected, ["list", model])
        try:
            (length,) = _U32.unpack(await _recv_exactly(tls, 4))
            if length > LISTING_BYTES_MAX:
                raise RemoteProtocolError(f"a listing of {length} bytes")
            raw = msgpack.unpackb(await _recv_exactly(tls, length), raw=False)
        finally:
            await trio.aclose_forcefully(tls)
    except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError, ValueError) as exc:
        raise _translate(host, port, exc) from None
    except Exception as exc:  # noqa: BLE001 - msgpack garbage
        raise FileCopyError("protocol", f"{host} port {port}: listing is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(raw, list) or len(raw) > LISTING_FILES_MAX:
        raise FileCopyError("protocol", f"{host} port {port}: a listing that is not a list of files")
    out: dict[str, int] = {}
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and servable(item[0])
                and type(item[1]) is int and 0 <= item[1] <= FILE_BYTES_MAX):
            raise FileCopyError("protocol", f"{host} port {port}: a listing entry {str(item)[:80]}")
        out[item[0]] = item[1]
    return out


async def fetch_file(host: str, port: int, client_ctx: ssl.SSLContext, expected: str, model: str, name: str,
                     dest_dir: Path, *, size_expected: int | None = None) -> int:
    """Copy one file of the model from that peer into dest_dir (whole or not at all);
    returns its size."""
    if not servable(name):
        raise ValueError(f"{name!r} is not a model file name")
    partial = dest_dir / f"{name}.partial"
    try:
        tls = await _session(host, port, client_ctx, expected, ["get", model, name])
        try:
            (size,) = _U64.unpack(await _recv_exactly(tls, 8))
            if size > FILE_BYTES_MAX or (size_expected is not None and size != size_expected):
                raise RemoteProtocolError(f"{name} of {size} bytes (listed as {size_expected})")
            await trio.to_thread.run_sync(lambda: dest_dir.mkdir(parents=True, exist_ok=True))
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
                        await trio.to_thread.run_sync(out.write, bytes(pending))
                        pending.clear()
                await trio.to_thread.run_sync(out.flush)
                await trio.to_thread.run_sync(os.fsync, out.fileno())
            os.replace(partial, dest_dir / name)
            return size
        finally:
            await trio.aclose_forcefully(tls)
    except (FileCopyError, trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise _translate(host, port, exc) from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
