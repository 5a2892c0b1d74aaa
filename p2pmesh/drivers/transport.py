"""The transport driver: authenticated TLS 1.3 connections between agents, carrying
length-prefixed frames (4-byte big-endian length, then a wire.py body).

- One connection per peer pair. Both sides may dial; when two connections to the same peer
  exist, both ends keep the one dialed by the lower node id and close the other.
- Each peer has a bounded send queue; a full queue drops the frame (Raft retransmits) and
  counts it. Frames above wire.FRAME_BYTES_MAX close the connection.
- Dialing retries with exponential backoff and jitter, bounded in count per address.
- A connection whose path died ends within seconds (TCP user timeout DEAD_PATH_S, and
  keepalives), so the next send redials over the peer's other addresses: a pulled
  Thunderbolt cable must not silence two Macs the LAN still joins (TCP alone retries for
  minutes).
- Handshakes have a timeout and a concurrency limit, so a flood of connections cannot
  exhaust memory or starve the cluster. Admission failures are logged once per remote
  address per minute.
Received frames become FrameReceived inputs in the agent's inbox, tagged with the node id
the TLS handshake proved.
"""
from __future__ import annotations

import logging
import random
import socket
import ssl
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import FrameReceived, Input, PeerDiscovered
from p2pmesh.core.wire import FRAME_BYTES_MAX
from p2pmesh.drivers.streams import remote_name
from p2pmesh.drivers.tls import peer_node_id

log = logging.getLogger("p2pmesh.transport")

HANDSHAKE_TIMEOUT_S = 5.0
HANDSHAKES_CONCURRENT_MAX = 16
HANDSHAKES_PER_ADDRESS_MAX = 4
"""One remote address may hold only a few handshakes at once: a flood from one host cannot
occupy the slots real peers need."""
SEND_QUEUE_LEN_MAX = 512
DIAL_BACKOFF_MIN_S = 0.05
DIAL_BACKOFF_MAX_S = 2.0
DIAL_ATTEMPTS_MAX = 100_000
CONNECTIONS_MAX = 256
DEAD_PATH_S = 1
"""Data unacknowledged for this long ends a connection (TCP user timeout; acknowledgements
come from the peer's kernel, so a busy peer or one stopped for seconds does not trip it;
a stopped one whose receive buffer fills up eventually does, and is redialed), and so do
keepalives unanswered for about 3 s on an idle one. Found by scripts/chaos.py: with a ring
cable pulled, the connection between its two ends stalled for as long as the cable was out,
so the leader marked the other end down and it rejoined with a fresh incarnation, though
the LAN joined them all along. It must stay well under standalone_after_ms (3 s)."""
KEEPALIVE_PROBES = 2
_DARWIN_TCP_RXT_CONNDROPTIME = 0x80
"""macOS's counterpart of Linux's TCP_USER_TIMEOUT (netinet/tcp.h), in seconds."""
REFUSAL_LOG_HOSTS_MAX = 1024
"""Remote hosts whose last refusal time is remembered (for the once-a-minute warning)."""
_LEN = struct.Struct(">I")


@dataclass(eq=False)
class _Conn:
    peer: NodeId
    stream: trio.SSLStream[trio.SocketStream]
    dialer: NodeId
    queue_send: trio.MemorySendChannel[bytes]
    queue_recv: trio.MemoryReceiveChannel[bytes]
    closed: trio.Event = field(default_factory=trio.Event)


def _split_hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"address must look like HOST:PORT, got {address!r}")
    return host, int(port)


class Transport:
    def __init__(
        self,
        *,
        me: NodeId,
        server_ctx: ssl.SSLContext,
        client_ctx: ssl.SSLContext,
        inbox: trio.MemorySendChannel[Input],
        rng: random.Random,
    ) -> None:
        self.me = me
        self.server_ctx = server_ctx
        self.client_ctx = client_ctx
        self.inbox = inbox
        self.rng = rng
        self.conns: dict[NodeId, _Conn] = {}
        self.addresses: dict[NodeId, tuple[str, ...]] = {}
        self.dialing: set[NodeId] = set()
        self.handshakes = trio.CapacityLimiter(HANDSHAKES_CONCURRENT_MAX)
        self.pending: dict[str, int] = {}
        """Handshakes in progress per remote address."""
        self.dropped_frames = 0
        self.refused = 0
        self._last_refusal_log: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------------------
    # Lifecycle

    async def run(self, listeners: list[trio.SocketListener], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener)
            task_status.started()

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        async with listener:
            while True:
                stream = await listener.accept()
                ip = remote_name(stream).rsplit(":", 1)[0]
                if len(self.conns) >= CONNECTIONS_MAX or self.pending.get(ip, 0) >= HANDSHAKES_PER_ADDRESS_MAX:
                    await trio.aclose_forcefully(stream)
                    continue
                assert self._nursery is not None
                self._nursery.start_soon(self._handshake, stream, None, False, None)

    # ------------------------------------------------------------------------------
    # Outbound

    def learn(self, node_id: NodeId, addresses: tuple[str, ...]) -> None:
        """Remember where a peer can be dialed (discovery, static peers, cluster state)."""
        if node_id != self.me and addresses:
            self.addresses[node_id] = addresses

    def send(self, node_id: NodeId, data: bytes) -> None:
        """Queue a frame for a peer without blocking; dial it if needed."""
        conn = self.conns.get(node_id)
        if conn is None:
            self._ensure_dialing(node_id)
            self.dropped_frames += 1  # no connection yet: Raft and Hello retransmit
            return
        try:
            conn.queue_send.send_nowait(data)
        except trio.WouldBlock:
            self.dropped_frames += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.dropped_frames += 1

    def close(self, node_id: NodeId) -> None:
        """Drop the connection to a peer (it sent something no correct peer sends)."""
        conn = self.conns.get(node_id)
        if conn is not None:
            conn.queue_send.close()  # the writer ends, which ends the whole connection

    def _ensure_dialing(self, node_id: NodeId) -> None:
        if node_id in self.dialing or node_id not in self.addresses or self._nursery is None:
            return
        self.dialing.add(node_id)
        self._nursery.start_soon(self._dial_known, node_id)

    async def _dial_known(self, node_id: NodeId) -> None:
        try:
            delay = DIAL_BACKOFF_MIN_S
            for _ in range(20):
                if node_id in self.conns:
                    return
                for address in self.addresses.get(node_id, ()):
                    if await self._dial(address, expect=node_id):
                        return
                await trio.sleep(delay * (0.5 + self.rng.random()))
                delay = min(DIAL_BACKOFF_MAX_S, delay * 2)
        finally:
            self.dialing.discard(node_id)

    async def dial_static(self, address: str) -> None:
        """Keep a static peer (HOST:PORT, node id unknown) connected, for ever."""
        delay = DIAL_BACKOFF_MIN_S
        for _ in range(DIAL_ATTEMPTS_MAX):
            conn_peer = await self._dial(address, expect=None)
            if conn_peer is not None:
                conn = self.conns.get(conn_peer)
                if conn is not None:
                    await conn.closed.wait()
                delay = DIAL_BACKOFF_MIN_S
            await trio.sleep(delay * (0.5 + self.rng.random()))
            delay = min(DIAL_BACKOFF_MAX_S, delay * 2)

    async def _dial(self, address: str, *, expect: NodeId | None) -> NodeId | None:
        try:
            host, port = _split_hostport(address)
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError, ValueError) as exc:
            log.debug("dialing %s failed: %r", address, exc)
            return None
        return await self._handshake(stream, expect, True, address)

    # ------------------------------------------------------------------------------
    # Handshake and connection

    async def _handshake(
        self, stream: trio.SocketStream, expect: NodeId | None, dialed: bool, address: str | None
    ) -> NodeId | None:
        _end_on_dead_path(stream.socket)
        ctx = self.client_ctx if dialed else self.server_ctx
        tls = trio.SSLStream(stream, ctx, server_side=not dialed, server_hostname=None if not dialed else "p2pmesh")
        remote = remote_name(stream)
        ip = remote.rsplit(":", 1)[0]
        self.pending[ip] = self.pending.get(ip, 0) + 1
        try:
            async with self.handshakes:
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    await tls.do_handshake()
            peer = peer_node_id(tls.getpeercert(binary_form=True))
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError, RemoteProtocolError, ValueError) as exc:
            self.refused += 1
            self._log_refusal(remote, exc)
            await trio.aclose_forcefully(tls)
            return None
        finally:
            left = self.pending.get(ip, 1) - 1
            if left > 0:
                self.pending[ip] = left
            else:
                self.pending.pop(ip, None)
        if peer == self.me or (expect is not None and peer != expect):
            self._log_refusal(remote, RemoteProtocolError(f"expected {expect}, got {peer}"))
            await trio.aclose_forcefully(tls)
            return None
        queue_send, queue_recv = trio.open_memory_channel[bytes](SEND_QUEUE_LEN_MAX)
        conn = _Conn(peer, tls, self.me if dialed else peer, queue_send, queue_recv)
        if not self._register(conn):
            await trio.aclose_forcefully(tls)
            return peer
        if address is not None and peer not in self.addresses:
            self.learn(peer, (address,))
        assert self._nursery is not None
        self._nursery.start_soon(self._run_conn, conn)
        if expect is None or not dialed:
            await self.inbox.send(PeerDiscovered(peer, self.addresses.get(peer, ())))
        return peer

    def _register(self, conn: _Conn) -> bool:
        """Keep one connection per pair: the one dialed by the lower node id wins."""
        existing = self.conns.get(conn.peer)
        if existing is not None and not existing.closed.is_set():
            preferred = min(self.me, conn.peer)
            if existing.dialer == preferred or conn.dialer != preferred:
                return False
            existing.queue_send.close()
        self.conns[conn.peer] = conn
        return True

    async def _run_conn(self, conn: _Conn) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._guarded, self._writer, conn, nursery.cancel_scope)
                await self._guarded(self._reader, conn, nursery.cancel_scope)
        finally:
            conn.closed.set()
            if self.conns.get(conn.peer) is conn:
                del self.conns[conn.peer]
            await trio.aclose_forcefully(conn.stream)

    async def _guarded(self, fn: Any, conn: _Conn, scope: trio.CancelScope) -> None:
        """Run the reader or writer; any way it ends (peer gone, garbage, tie-break lost)
        ends the whole connection, and never the transport."""
        try:
            await fn(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
            log.debug("connection to %s closed: %r", conn.peer, exc)
        except RemoteProtocolError as exc:
            log.warning("closing connection to %s: %s", conn.peer, exc)
        finally:
            scope.cancel()

    async def _writer(self, conn: _Conn) -> None:
        async for data in conn.queue_recv:
            await conn.stream.send_all(_LEN.pack(len(data)) + data)

    async def _reader(self, conn: _Conn) -> None:
        buf = bytearray()
        while True:
            chunk = await conn.stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 4:
                (length,) = _LEN.unpack_from(buf)
                if length > FRAME_BYTES_MAX:
                    raise RemoteProtocolError(f"frame of {length} bytes from {conn.peer}")
                if len(buf) < 4 + length:
                    break
                data = bytes(buf[4 : 4 + length])
                del buf[: 4 + length]
                await self.inbox.send(FrameReceived(conn.peer, data))

    def _log_refusal(self, remote: str, exc: BaseException) -> None:
        # Once a minute per remote host: its port is ephemeral, so a peer with the wrong
        # key retrying every second is one host, one line. The table is bounded too.
        host = remote.rpartition(":")[0] or remote
        now = trio.current_time()
        if now - self._last_refusal_log.get(host, -1e9) >= 60.0:
            if len(self._last_refusal_log) >= REFUSAL_LOG_HOSTS_MAX:
                self._last_refusal_log.clear()
            self._last_refusal_log[host] = now
            log.warning("refused connection from %s: %s (cluster key or identity mismatch?)", remote, exc)


def _end_on_dead_path(sock: Any) -> None:
    """Ask the kernel to end this connection when its path dies (DEAD_PATH_S)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPALIVE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name) and not (name == "TCP_KEEPALIVE" and sys.platform != "darwin"):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PATH_S * 1000))
    elif sys.platform == "darwin":
        options.append((socket.IPPROTO_TCP, _DARWIN_TCP_RXT_CONNDROPTIME, DEAD_PATH_S))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:  # an option this kernel lacks: the others still help
            pass



