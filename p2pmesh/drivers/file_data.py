"""The data connections of model-file copies (drivers/files.py): plain TCP, zero copy.

The TLS session of a copy decides who may ask and for what (which file, its size and
SHA-256); the file's bytes then travel over a plain TCP connection to the same port, tied
to that session by a one-time token of TOKEN_BYTES random bytes the server handed out over
TLS. The client opens the connection and sends ``b"P2PD"`` and the token; the server
accepts it only for a token it issued, not yet used, younger than TOKEN_TTL_S, from the
address of the session's peer. Then the server sends each range the session asks for with
``socket.sendfile`` (the kernel moves the pages: no read into Python, no encryption), and
the client receives with large ``recv_into`` buffers written at their offsets (file_sink.py).
Integrity does not rest on this connection: the client checks the whole file against the
SHA-256 the TLS session listed before keeping it.

Bounds: at most TOKENS_MAX tokens pending (one per session: files.SESSIONS_MAX), at most
DATA_PENDING_MAX connections still saying which token they bring, each for at most
HANDSHAKE_TIMEOUT_S; a send or receive that stalls for IDLE_S fails. The blocking
sendfile and recv_into run in threads on a duplicate of the socket; a cancelled copy shuts
the socket down, which ends the thread's call at once.
"""
from __future__ import annotations

import os
import secrets
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO, TypeVar

import trio

from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.drivers.file_sink import Sink
from p2pmesh.drivers.streams import recv_exactly
from p2pmesh.drivers.transport import HANDSHAKE_TIMEOUT_S

DATA_MAGIC = b"P2PD"
TOKEN_BYTES = 32
TOKEN_TTL_S = 10.0
TOKENS_MAX = 16
DATA_PENDING_MAX = 8
IDLE_S = 30.0
RECV_BYTES = 8 << 20
"""The client fills a buffer this large before it writes (one pwrite, one hash update)."""

T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    """A token's promise: the data connection it brings, once it arrives."""

    host: str
    arrived: trio.Event = field(default_factory=trio.Event)
    released: trio.Event = field(default_factory=trio.Event)
    stream: trio.SocketStream | None = None


class Tickets:
    """The server's pending tokens (bounded) and the data connections that redeem them."""

    def __init__(self) -> None:
        self.pending: dict[bytes, Ticket] = {}
        self.slots = trio.CapacityLimiter(DATA_PENDING_MAX)

    def issue(self, host: str) -> tuple[bytes, Ticket] | None:
        """A fresh token for a session whose peer is at ``host``; None when TOKENS_MAX wait."""
        if len(self.pending) >= TOKENS_MAX:
            return None
        token = secrets.token_bytes(TOKEN_BYTES)
        ticket = self.pending[token] = Ticket(host)
        return token, ticket

    async def await_data(self, token: bytes, ticket: Ticket) -> trio.SocketStream | None:
        """The data connection for this token, or None when none came within TOKEN_TTL_S
        (the token is void either way)."""
        with trio.move_on_after(TOKEN_TTL_S):
            await ticket.arrived.wait()
        self.pending.pop(token, None)
        return ticket.stream

    async def redeem(self, stream: trio.SocketStream) -> None:
        """Serve a connection that opened with DATA_MAGIC: hand it to the session whose token
        it brings and hold it until that session is done; anything else is closed."""
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            return  # the caller closes it: too many connections that have not said who they are
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                hello = await recv_exactly(stream, len(DATA_MAGIC) + TOKEN_BYTES)
        except (trio.TooSlowError, trio.BrokenResourceError, OSError, RemoteProtocolError):
            return
        finally:
            self.slots.release()
        if hello[: len(DATA_MAGIC)] != DATA_MAGIC:
            return
        ticket = self.pending.pop(hello[len(DATA_MAGIC):], None)
        if ticket is None or peer_host(stream) != ticket.host:
            return
        ticket.stream = stream
        ticket.arrived.set()
        await ticket.released.wait()  # the session closes it when it ends (bounded by its idle time)


def peer_host(stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> str:
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    return str(inner.socket.getpeername()[0])


async def _blocking(stream: trio.SocketStream, work: Callable[[socket.socket], T]) -> T:
    """``work`` on a blocking duplicate of the stream's socket, in a thread; cancelled, the
    socket is shut down so that the thread's call returns (a thread cannot be interrupted)."""
    finished = False

    def run() -> T:
        sock = socket.socket(fileno=os.dup(stream.socket.fileno()))
        try:
            sock.settimeout(IDLE_S)
            return work(sock)
        finally:
            sock.close()  # the duplicate only

    async def shut_on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            if not finished:
                try:
                    stream.socket.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    error: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shut_on_cancel)
        try:
            result = await trio.to_thread.run_sync(run)
        except Exception as exc:  # noqa: BLE001 - raised below, as itself and not in a group
            error = exc
        finally:
            finished = True
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def send_range(stream: trio.SocketStream, f: BinaryIO, offset: int, count: int) -> None:
    """Send bytes [offset, offset + count) of ``f`` with zero copy."""
    def work(sock: socket.socket) -> None:
        sent = sock.sendfile(f, offset, count)
        if sent != count:
            raise OSError(f"sent {sent} of {count} bytes: the file shrank")

    await _blocking(stream, work)


async def open_data(host: str, port: int, token: bytes) -> trio.SocketStream:
    """The data connection for a session's token (the caller bounds the time)."""
    stream = await trio.open_tcp_stream(host.strip("[]"), port)
    try:
        await stream.send_all(DATA_MAGIC + token)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


async def receive_range(stream: trio.SocketStream, sink: Sink, offset: int, count: int) -> None:
    """Receive bytes [offset, offset + count) of the file into the sink. ConnectionError
    when the connection ends early, TimeoutError when it stalls for IDLE_S. Two buffers:
    one fills from the socket while the other is written and hashed in a second thread
    (hashlib and pwrite release the GIL), so the hash costs no time on two cores."""
    def work(sock: socket.socket) -> None:
        size = min(RECV_BYTES, count)
        buffers = [memoryview(bytearray(size)), memoryview(bytearray(size))]
        pending: list[Future[None]] = [Future(), Future()]
        for f in pending:
            f.set_result(None)
        pos, end, turn = offset, offset + count, 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2pmesh-copy") as writer:
            try:
                while pos < end:
                    pending[turn].result()  # this buffer's last write is done (or raises)
                    buf, want, filled = buffers[turn], min(size, end - pos), 0
                    try:
                        while filled < want:
                            n = sock.recv_into(buf[filled:want])
                            if n == 0:
                                raise ConnectionError(f"the data connection closed with {end - pos - filled} bytes to come")
                            filled += n
                    finally:
                        if filled:  # also on a failure: kept for a later resume
                            pending[turn] = writer.submit(sink.write, pos, buf[:filled])
                    pos += filled
                    turn = 1 - turn
            finally:
                for f in pending:
                    f.result()

    await _blocking(stream, work)
