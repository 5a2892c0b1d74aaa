"""The link probe over real TLS on loopback: plausible numbers, node-id binding, refusal of
outsiders, a silent server, hostile clients and the session limit. Every wait is bounded."""
from __future__ import annotations

import logging
import os
import socket
import ssl
import struct

import pytest
import trio

from p2pmesh.core.identity import Identity
from p2pmesh.drivers.probe import (
    BULK_BYTES_MAX,
    ECHO_BYTES_MAX,
    MAGIC,
    PINGS_MAX,
    SESSIONS_MAX,
    VERSION,
    ProbeError,
    ProbeResult,
    probe,
    serve_probes,
)
from p2pmesh.drivers.tls import Credentials

KEY = bytes(range(32))
OTHER_KEY = bytes(32)
HEADER = struct.Struct(">4sBHI")
ECHO = struct.Struct(">I")


def header(magic: bytes, version: int, pings: int, bulk: int, echo: int = 0) -> bytes:
    """A probe header as a client writes it (version 2 adds the echo size)."""
    return HEADER.pack(magic, version, pings, bulk) + (ECHO.pack(echo) if version >= 2 else b"")


class Member:
    def __init__(self, key: bytes = KEY) -> None:
        self.ident = Identity.from_seed(os.urandom(32))
        self.server_ctx, self.client_ctx = Credentials.issue(self.ident, key).contexts()

    @property
    def node_id(self) -> str:
        return self.ident.node_id


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HOSTS = ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no ::1"))]


async def _good_probe(port: int, client: Member, server: Member, host: str = "127.0.0.1") -> ProbeResult:
    return await probe(host, port, client.client_ctx, server.node_id, pings=3, bulk_bytes=256 << 10)


async def _closed_by_server(stream: trio.abc.ReceiveStream, seconds: float = 3.0) -> bool:
    """True if the server ends the connection (EOF or reset) within `seconds`."""
    with trio.move_on_after(seconds):
        try:
            for _ in range(64):  # bounded: a well-behaved server sends at most a few records
                if not await stream.receive_some(65536):
                    return True
        except (trio.BrokenResourceError, OSError):
            return True
    return False


async def _tls_client(port: int, client: Member) -> trio.SSLStream[trio.SocketStream]:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
    await tls.do_handshake()
    return tls


@pytest.mark.trio
@pytest.mark.parametrize("host", HOSTS)
async def test_probe_measures_a_link(host: str) -> None:
    server, client = Member(), Member()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, host, 0, server.server_ctx)
            result = await probe(host, port, client.client_ctx, server.node_id, pings=7, bulk_bytes=1 << 20)
            assert result.pings == 7 and result.bulk_bytes == 1 << 20
            assert 0 < result.rtt_ms < 1000
            assert 0 < result.gbps < 10_000
            # The echo phase: an activation-sized message costs at least a ping's round trip.
            assert result.echo_bytes == 16 << 10 and result.echo_rtt_ms > 0
            # A bracketed host works too (the form addresses take in HOST:PORT strings).
            again = await probe(f"[{host}]", port, client.client_ctx, server.node_id, pings=1, bulk_bytes=1)
            assert again.pings == 1 and again.rtt_ms > 0
            # Bound to exactly `host`: the same port on another local address has no listener.
            other = "127.0.0.2" if host == "127.0.0.1" else "127.0.0.1"
            with pytest.raises(ProbeError):
                await probe(other, port, client.client_ctx, server.node_id, timeout_s=1.0)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_wrong_node_id_is_an_error() -> None:
    server, client, someone_else = Member(), Member(), Member()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, "127.0.0.1", 0, server.server_ctx)
            with pytest.raises(ProbeError) as info:
                await probe("127.0.0.1", port, client.client_ctx, someone_else.node_id)
            assert info.value.reason == "wrong_node"
            assert server.node_id in str(info.value)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_client_of_another_cluster_is_refused_and_server_keeps_serving() -> None:
    server, client, outsider = Member(), Member(), Member(OTHER_KEY)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, "127.0.0.1", 0, server.server_ctx)
            with pytest.raises(ProbeError) as info:
                await probe("127.0.0.1", port, outsider.client_ctx, server.node_id)
            assert info.value.reason == "refused"
            # An outsider's certificate is refused by the server too, not just its own check:
            # its client context trusting our CA would still present an untrusted leaf.
            hybrid = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            hybrid.minimum_version = ssl.TLSVersion.TLSv1_3
            hybrid.check_hostname = False
            hybrid.load_verify_locations(cadata=Credentials.issue(server.ident, KEY).ca_pem.decode())
            outsider_creds = Credentials.issue(outsider.ident, OTHER_KEY)
            _load_chain(hybrid, outsider_creds)
            with pytest.raises(ProbeError) as info:
                await probe("127.0.0.1", port, hybrid, server.node_id)
            assert info.value.reason == "refused"
            assert (await _good_probe(port, client, server)).pings == 3
            nursery.cancel_scope.cancel()


def _load_chain(ctx: ssl.SSLContext, creds: Credentials) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
        with open(cert, "wb") as f:
            f.write(creds.cert_pem)
        with open(key, "wb") as f:
            f.write(creds.key_pem)
        ctx.load_cert_chain(cert, key)


@pytest.mark.trio
async def test_silent_server_times_out(autojump_clock: trio.abc.Clock) -> None:
    # The connect and accept are loopback, done before every task blocks; then the only
    # deadline is the probe's own timeout, which the mock clock reaches at once.
    client, server = Member(), Member()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[trio.abc.Stream] = []

    async def accept_and_stay_silent() -> None:
        for _ in range(4):  # bounded
            accepted.append(await listeners[0].accept())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_and_stay_silent)
            start = trio.current_time()
            with pytest.raises(ProbeError) as info:
                await probe("127.0.0.1", port, client.client_ctx, server.node_id, timeout_s=0.5)
            assert info.value.reason == "timeout"
            assert trio.current_time() - start == pytest.approx(0.5)  # the probe's timeout, on the mock clock
            nursery.cancel_scope.cancel()
    for stream in accepted:
        await trio.aclose_forcefully(stream)
    for listener in listeners:
        await listener.aclose()


@pytest.mark.trio
async def test_nobody_listening_is_refused() -> None:
    client, server = Member(), Member()
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with trio.fail_after(10):
        with pytest.raises(ProbeError) as info:
            await probe("127.0.0.1", port, client.client_ctx, server.node_id, timeout_s=2.0)
    assert info.value.reason in ("refused", "timeout")


@pytest.mark.trio
@pytest.mark.parametrize(
    "payload",
    [
        b"\x00" * HEADER.size,  # garbage header
        header(b"XXXX", VERSION, 1, 1),  # wrong magic
        HEADER.pack(MAGIC, VERSION + 1, 1, 1) + ECHO.pack(0),  # unknown version
        header(MAGIC, VERSION, 1, BULK_BYTES_MAX + 1),  # oversized bulk claim
        header(MAGIC, VERSION, PINGS_MAX + 1, 1),  # too many pings
        header(MAGIC, VERSION, 1, 1, ECHO_BYTES_MAX + 1),  # oversized echo
        header(MAGIC, VERSION, 0, 1 << 20) + b"x" * 100,  # hangs up mid-bulk
        HEADER.size * b"\xff" + b"x" * 100,  # garbage and more garbage
    ],
)
async def test_hostile_clients_are_refused_and_server_keeps_serving(
    payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="p2pmesh.probe")
    server, client = Member(), Member()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, "127.0.0.1", 0, server.server_ctx)
            tls = await _tls_client(port, client)
            await tls.send_all(payload)
            if payload.endswith(b"x" * 100) and payload.startswith(MAGIC):
                await trio.aclose_forcefully(tls)  # the hang-up; the server must survive it
            else:
                assert await _closed_by_server(tls)
                await trio.aclose_forcefully(tls)
            # Not even TLS: raw garbage fails the handshake.
            raw = await trio.open_tcp_stream("127.0.0.1", port)
            await raw.send_all(b"GET / HTTP/1.0\r\n\r\n")
            assert await _closed_by_server(raw)
            await raw.aclose()
            result = await _good_probe(port, client, server)
            assert result.pings == 3 and result.gbps > 0
            nursery.cancel_scope.cancel()
    refusals = [r for r in caplog.records if "probe session from" in r.getMessage()]
    assert len(refusals) >= 2 and refusals[0].levelno == logging.WARNING


@pytest.mark.trio
async def test_a_version_1_client_is_still_answered() -> None:
    """An agent of the previous release probes without the echo phase: same pings and bulk."""
    server, client = Member(), Member()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, "127.0.0.1", 0, server.server_ctx)
            tls = await _tls_client(port, client)
            await tls.send_all(header(MAGIC, 1, 2, 10) + struct.pack(">Q", 7) + struct.pack(">Q", 8))
            assert await _recv(tls, 16) == struct.pack(">QQ", 7, 8)
            await tls.send_all(b"z" * 10)
            assert await _recv(tls, 8) == struct.pack(">Q", 10)
            await trio.aclose_forcefully(tls)
            nursery.cancel_scope.cancel()


async def _recv(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = b""
    for _ in range(n):  # bounded: at least a byte a read
        if len(buf) >= n:
            break
        buf += await stream.receive_some(n - len(buf))
    return buf


@pytest.mark.trio
async def test_client_rejects_out_of_limit_arguments() -> None:
    client, server = Member(), Member()
    for kwargs in ({"pings": 0}, {"pings": PINGS_MAX + 1}, {"bulk_bytes": BULK_BYTES_MAX + 1},
                   {"echo_bytes": ECHO_BYTES_MAX + 1}, {"echo_bytes": -1}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            await probe("127.0.0.1", 1, client.client_ctx, server.node_id, **kwargs)  # type: ignore[arg-type]


@pytest.mark.trio
async def test_session_limit_closes_extra_connections(autojump_clock: trio.abc.Clock) -> None:
    # On the mock clock: the watchers' one-second wait and the server's handshake timeouts
    # pass in no real time; loopback closes arrive before the run loop goes idle.
    server, client = Member(), Member()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_probes, "127.0.0.1", 0, server.server_ctx)
            # Silent connections hold a slot each (stuck in the handshake, which times out
            # after 5 s): the ones beyond the limit are closed at once.
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(SESSIONS_MAX + 2)]
            results = [False] * len(silent)

            async def watch(i: int) -> None:
                results[i] = await _closed_by_server(silent[i], seconds=1.0)

            async with trio.open_nursery() as watchers:
                for i in range(len(silent)):
                    watchers.start_soon(watch, i)
            assert results.count(True) == 2, results
            # Full: a real probe is turned away too.
            with pytest.raises(ProbeError) as info:
                await _good_probe(port, client, server)
            assert info.value.reason == "refused"
            # Slots come back once the holders hang up.
            for stream in silent:
                await stream.aclose()
            for _ in range(50):  # bounded retry while the server notices the hang-ups
                try:
                    result = await _good_probe(port, client, server)
                    break
                except ProbeError:
                    await trio.sleep(0.05)
            else:
                pytest.fail("probe never succeeded after the slots were freed")
            assert result.pings == 3
            nursery.cancel_scope.cancel()


@pytest.mark.trio
@pytest.mark.parametrize("host", ["", "localhost"])
async def test_server_binds_only_to_an_address(host: str) -> None:
    server = Member()
    with trio.fail_after(5):
        with pytest.raises(OSError):  # never silently the wildcard, never a name lookup
            await serve_probes(host, 0, server.server_ctx)
