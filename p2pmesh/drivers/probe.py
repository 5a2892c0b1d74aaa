"""The link probe driver: small, bounded active measurements of one link (RTT and rough
throughput) between two agents, so the cluster can place work.

It owns the probe listener (``serve_probes``), the probe client (``probe``) and their tiny
protocol, all over mutually authenticated TLS 1.3 from tls.py, so only cluster members can
probe or be probed and the prober knows which node answered. The protocol, after the
handshake (all integers big-endian):

    client -> server  header: magic b"P2PP", version (1 byte), pings (2), bulk bytes (4),
                      then (version 2) echo bytes (4)
    pings times:      client sends an 8-byte sequence number, server echoes it
    pings times (v2): client sends echo-bytes bytes, server echoes them: the round trip of
                      a message the size of one activation, which is what a pipeline hop
                      and each step of a tensor group's all-reduce pay (an 8-byte ping
                      shows the wire's latency, not that)
    client -> server  bulk bytes of payload; server reads and discards them
    server -> client  ack: the 8-byte count of bulk bytes received

Every session is bounded: pings, bulk size, concurrent sessions, handshake time and total
time. A probe costs at most ~8 MiB and a few seconds, whoever sends it.
"""
from __future__ import annotations

import logging
import socket
import ssl
import statistics
import struct
from dataclasses import dataclass

import trio

from p2pmesh.core.errors import MeshError, RemoteProtocolError
from p2pmesh.drivers.streams import recv_exactly, remote_name
from p2pmesh.drivers.tls import dial_member, peer_node_id
from p2pmesh.drivers.transport import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("p2pmesh.probe")

MAGIC = b"P2PP"
VERSION = 2
VERSIONS = (1, 2)
"""Version 1 (no echo phase) is still answered: an agent of the previous release probes."""
PINGS_MAX = 32
BULK_BYTES_MAX = 8 << 20
ECHO_BYTES_MAX = 256 << 10
ECHO_BYTES_DEFAULT = 16 << 10
"""The hidden state of one token of a 70B model in bf16 (8192 x 2 bytes)."""
SESSIONS_MAX = 4
"""Probes are occasional; a handful at once is plenty, and a flood of connections beyond it
is closed at once instead of queueing work."""
SESSION_DEADLINE_S = 10.0
"""Covers handshake, pings and bulk: a slow or stalled client cannot hold a slot longer."""
_CHUNK = 64 << 10
_HEADER = struct.Struct(">4sBHI")
_ECHO = struct.Struct(">I")
_PING = struct.Struct(">Q")
_ACK = struct.Struct(">Q")
_ZEROS = bytes(_CHUNK)  # TLS 1.3 has no compression, so zeros measure the link like any bytes


@dataclass(frozen=True, slots=True)
class ProbeResult:
    rtt_ms: float
    """Median ping round trip. The median, not the mean: one ping delayed by a scheduler
    hiccup or a retransmit would skew a mean, and placement wants the typical latency."""
    gbps: float
    """bulk_bytes * 8 / seconds / 1e9, timed from the first bulk byte to the ack (so it
    includes one round trip and TLS encryption cost). 1 MiB lasts ~0.2 ms at 40 Gb/s, so the
    figure only roughly separates 10 Gb/s from 40 Gb/s links; it is informational."""
    pings: int
    bulk_bytes: int
    echo_rtt_ms: float = 0.0
    """Median round trip of ``echo_bytes`` each way (0.0: not measured)."""
    echo_bytes: int = 0


class ProbeError(MeshError):
    """A probe failed; ``reason`` says whose fault: "refused" (the peer or its TLS refused
    us: no listener, cluster key mismatch, too busy), "timeout", "wrong_node" (the
    certificate proves another node id), "protocol" (the peer violated the protocol)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


# ----------------------------------------------------------------------------------
# Server


async def _listen_socket(host: str, port: int) -> trio.socket.SocketType:
    """A listening socket on exactly `host` (a numeric address, link-local %scope allowed):
    binding is never widened to the wildcard unless the caller passes one."""
    # AI_NUMERICHOST: no name lookup (so this never blocks), and "" or a name is an error.
    family, type_, proto, _, addr = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE
    )[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        await sock.bind(addr)
        sock.listen(SESSIONS_MAX * 4)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_probes(
    host: str, port: int, server_ctx: ssl.SSLContext, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer probes on host:port for ever; reports the bound port through task_status.
    Raises OSError at once if host is not a numeric address or cannot be bound."""
    sock = await _listen_socket(host, port)
    server = _Server(server_ctx, trio.CapacityLimiter(SESSIONS_MAX))
    task_status.started(sock.getsockname()[1])
    await trio.serve_listeners(server.session, [trio.SocketListener(sock)])


@dataclass(eq=False)
class _Server:
    server_ctx: ssl.SSLContext
    slots: trio.CapacityLimiter
    last_warning: float = -1e9
    """Refusals log a warning at most once a second (the rest at debug), so a flood of bad
    connections cannot flood the log."""

    async def session(self, stream: trio.SocketStream) -> None:
        remote = remote_name(stream)
        try:
            self.slots.acquire_nowait()  # the borrower is this handler's own task
        except trio.WouldBlock:
            log.debug("probe from %s refused: %d sessions already running", remote, SESSIONS_MAX)
            await trio.aclose_forcefully(stream)
            return
        tls = trio.SSLStream(stream, self.server_ctx, server_side=True)
        try:
            with trio.fail_after(SESSION_DEADLINE_S):
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    await tls.do_handshake()
                peer = peer_node_id(tls.getpeercert(binary_form=True))
                await _answer(tls)
                log.debug("answered a probe from %s at %s", peer, remote)
        except (trio.BrokenResourceError, trio.TooSlowError, OSError, RemoteProtocolError, ValueError) as exc:
            # Every failure is the client's (or the network's): close and keep serving.
            now = trio.current_time()
            level = logging.WARNING if now - self.last_warning >= 1.0 else logging.DEBUG
            self.last_warning = now if level == logging.WARNING else self.last_warning
            log.log(level, "probe session from %s closed: %r", remote, exc)
        finally:
            self.slots.release()
            await trio.aclose_forcefully(tls)


async def _answer(tls: trio.SSLStream[trio.SocketStream]) -> None:
    magic, version, pings, bulk = _HEADER.unpack(await recv_exactly(tls, _HEADER.size))
    if magic != MAGIC or version not in VERSIONS:
        raise RemoteProtocolError(f"bad probe header (magic {magic!r}, version {version})")
    echo = _ECHO.unpack(await recv_exactly(tls, _ECHO.size))[0] if version >= 2 else 0
    if pings > PINGS_MAX or bulk > BULK_BYTES_MAX or echo > ECHO_BYTES_MAX:
        raise RemoteProtocolError(f"probe asks for {pings} pings, {bulk} bytes and {echo}-byte echoes, over the limits")
    for _ in range(pings):
        await tls.send_all(await recv_exactly(tls, _PING.size))
    for _ in range(pings if echo else 0):
        await tls.send_all(await recv_exactly(tls, echo))
    left = bulk
    while left > 0:
        chunk = await tls.receive_some(min(left, _CHUNK))  # at most `left`: never read past the bulk
        if not chunk:
            raise RemoteProtocolError(f"connection closed with {left} bulk bytes missing")
        left -= len(chunk)
    await tls.send_all(_ACK.pack(bulk))


# ----------------------------------------------------------------------------------
# Client


async def probe(
    host: str,
    port: int,
    client_ctx: ssl.SSLContext,
    expected_node_id: str,
    *,
    pings: int = 5,
    bulk_bytes: int = 1 << 20,
    echo_bytes: int = ECHO_BYTES_DEFAULT,
    timeout_s: float = 5.0,
) -> ProbeResult:
    """Probe the agent at host:port (IPv4, or IPv6 including link-local "fe80::1%en5"), which
    must prove it is `expected_node_id`. Takes at most timeout_s; raises ProbeError on any
    failure and ValueError on arguments outside the server's limits."""
    if (not 1 <= pings <= PINGS_MAX or not 1 <= bulk_bytes <= BULK_BYTES_MAX or not 0 <= echo_bytes <= ECHO_BYTES_MAX
            or timeout_s <= 0):
        raise ValueError(f"need 1..{PINGS_MAX} pings, 1..{BULK_BYTES_MAX} bulk bytes, 0..{ECHO_BYTES_MAX} echo bytes, "
                         "a positive timeout")
    try:
        with trio.fail_after(timeout_s):
            tls, peer = await dial_member(host, port, client_ctx)
            try:
                if peer != expected_node_id:
                    raise ProbeError("wrong_node", f"{host} port {port} is {peer}, expected {expected_node_id}")
                return await _measure(tls, pings, bulk_bytes, echo_bytes)
            finally:
                await trio.aclose_forcefully(tls)
    except trio.TooSlowError:
        raise ProbeError("timeout", f"probe of {host} port {port} took over {timeout_s} s") from None
    except (RemoteProtocolError, ValueError) as exc:
        raise ProbeError("protocol", f"{host} port {port}: {exc}") from exc
    except (trio.BrokenResourceError, OSError) as exc:
        # In TLS 1.3 a server's rejection of our certificate surfaces on the first read, so
        # a refused handshake and a peer that closed on us look alike from here.
        raise ProbeError("refused", f"{host} port {port} refused or closed the probe: {exc!r}") from exc


async def _measure(tls: trio.SSLStream[trio.SocketStream], pings: int, bulk_bytes: int, echo_bytes: int) -> ProbeResult:
    await tls.send_all(_HEADER.pack(MAGIC, VERSION, pings, bulk_bytes) + _ECHO.pack(echo_bytes))
    rtts = [await _round_trip(tls, _PING.pack(seq)) for seq in range(pings)]
    echoes = [await _round_trip(tls, _PING.pack(seq) * (echo_bytes // _PING.size) + bytes(echo_bytes % _PING.size))
              for seq in range(pings if echo_bytes else 0)]
    start = trio.current_time()
    left = bulk_bytes
    while left > 0:
        n = min(left, _CHUNK)
        await tls.send_all(_ZEROS[:n])
        left -= n
    (acked,) = _ACK.unpack(await recv_exactly(tls, _ACK.size))
    seconds = max(trio.current_time() - start, 1e-9)
    if acked != bulk_bytes:
        raise RemoteProtocolError(f"peer acknowledged {acked} of {bulk_bytes} bulk bytes")
    return ProbeResult(
        rtt_ms=statistics.median(rtts) * 1e3, gbps=bulk_bytes * 8 / seconds / 1e9, pings=pings, bulk_bytes=bulk_bytes,
        echo_rtt_ms=statistics.median(echoes) * 1e3 if echoes else 0.0, echo_bytes=echo_bytes,
    )


async def _round_trip(tls: trio.SSLStream[trio.SocketStream], message: bytes) -> float:
    """Seconds for ``message`` to go to the peer and come back, checked byte for byte."""
    start = trio.current_time()
    await tls.send_all(message)
    if await recv_exactly(tls, len(message)) != message:
        raise RemoteProtocolError(f"a {len(message)}-byte message echoed wrong")
    return trio.current_time() - start
