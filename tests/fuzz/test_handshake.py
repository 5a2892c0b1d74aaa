"""Fuzz target: the handshake. Admission is TLS 1.3 with certificates from the cluster CA
(drivers/tls.py), driven by the transport (drivers/transport.py); the only parsing p2pmesh
does itself is reading the node id out of the verified peer certificate (tls.peer_node_id).

- A recorded real handshake's client bytes, replayed as they were or mutated (flipped,
  cut, spliced, repeated), never complete a handshake with a fresh server: the server draws
  new randomness and a new key share, so the old Finished and CertificateVerify prove
  nothing. The only errors are ssl.SSLError.
- The same hostile bytes sent to a real Transport on 127.0.0.1 are refused: the refusal is
  counted, no connection is registered, nothing reaches the inbox, no handshake slot stays
  taken; and afterwards a real key holder still gets in.
- peer_node_id on a mutated certificate returns a node id or raises RemoteProtocolError.

Peers with another key, a flood of silent connections and a dialed peer with another id
are in tests/agent/test_transport.py; real agents in tests/agent/test_admission.py.
"""
from __future__ import annotations

import math
import os
import random
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import example, given
from hypothesis import strategies as st

from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.identity import Identity
from p2pmesh.core.machine import FrameReceived, Input
from p2pmesh.drivers.tls import Credentials, peer_node_id
from p2pmesh.drivers.transport import Transport
from tests.fuzz import fuzz_settings, tally

KEY = bytes(range(32))
SOCKET_S_MAX = 10.0
"""A refused handshake ends in milliseconds; this bound catches a server that hangs."""

SERVER = Credentials.issue(Identity.from_seed(os.urandom(32)), KEY)
CLIENT = Credentials.issue(Identity.from_seed(os.urandom(32)), KEY)
SERVER_CTX, _ = SERVER.contexts()
_, CLIENT_CTX = CLIENT.contexts()


def _record_handshake() -> list[bytes]:
    """The client's flights of one real, successful handshake (ClientHello; then
    Certificate, CertificateVerify, Finished), through memory BIOs."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = CLIENT_CTX.wrap_bio(c_in, c_out, server_side=False, server_hostname="p2pmesh")
    server = SERVER_CTX.wrap_bio(s_in, s_out, server_side=True)
    flights: list[bytes] = []
    done = [False, False]
    for _ in range(10):
        for i, (end, out, peer_in) in enumerate(((client, c_out, s_in), (server, s_out, c_in))):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            data = out.read()
            if data:
                peer_in.write(data)
                if end is client:
                    flights.append(data)
        if all(done):
            break
    assert all(done) and peer_node_id(server.getpeercert(binary_form=True)) == CLIENT.node_id
    return flights


FLIGHTS = _record_handshake()


@st.composite
def _client_bytes(draw: st.DrawFn) -> list[bytes]:
    """The recorded flights, replayed as they are or with one to three mutations."""
    flights = [bytearray(f) for f in FLIGHTS]
    for _ in range(draw(st.integers(0, 3))):
        f = flights[draw(st.integers(0, len(flights) - 1))]
        op = draw(st.sampled_from(("flip", "set", "cut", "insert", "splice", "repeat")))
        pos = draw(st.integers(0, max(0, len(f) - 1)))
        if op == "flip" and f:
            f[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and f:
            f[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del f[pos:]
        elif op == "insert":
            f[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "splice":
            other = FLIGHTS[draw(st.integers(0, len(FLIGHTS) - 1))]
            f[pos:] = other[draw(st.integers(0, len(other))):]
        elif op == "repeat":
            f[pos:pos] = f[pos:pos + draw(st.integers(1, 64))]
    return [bytes(f) for f in flights]


_hostile = st.one_of(_client_bytes(), _client_bytes(), st.lists(st.binary(max_size=300), min_size=1, max_size=3))


@fuzz_settings(default=300)
@given(_hostile)
@example(FLIGHTS)  # the pure replay
@example([FLIGHTS[0], FLIGHTS[0]])
def test_replayed_or_mutated_client_bytes_never_complete_a_handshake(flights: list[bytes]) -> None:
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = SERVER_CTX.wrap_bio(s_in, s_out, server_side=True)
    outcome = "refused: needs more"
    for data in flights:
        s_in.write(data)
        try:
            server.do_handshake()
        except ssl.SSLWantReadError:
            continue
        except ssl.SSLError as exc:
            assert exc.reason or str(exc)
            outcome = "refused: TLS error"
            break
        raise AssertionError("a handshake completed from recorded or forged client bytes")
    with pytest.raises(ValueError, match="handshake not done"):
        server.getpeercert(binary_form=True)  # no peer identity was ever established
    tally("handshake", outcome)


# --------------------------------------------------------------------------------------
# The same against a real Transport on loopback


@dataclass
class _Served:
    transport: Transport
    token: trio.lowlevel.TrioToken
    inbox: trio.MemoryReceiveChannel[Input]
    port: int

    def read(self, fn: Any) -> Any:
        return trio.from_thread.run_sync(fn, trio_token=self.token)


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        send, receive = trio.open_memory_channel[Input](math.inf)
        transport = Transport(me=SERVER.node_id, server_ctx=SERVER_CTX, client_ctx=SERVER.contexts()[1], inbox=send,
                              rng=random.Random(1))
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run, listeners)
            box["served"] = _Served(transport, trio.lowlevel.current_trio_token(), receive,
                                    listeners[0].socket.getsockname()[1])
            box["stop"] = nursery.cancel_scope
            ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(30)
    s: _Served = box["served"]
    yield s
    trio.from_thread.run_sync(box["stop"].cancel, trio_token=s.token)
    thread.join(10)


def _counters(t: Transport) -> tuple[int, int, int]:
    return t.refused, len(t.conns), len(t.pending)


@fuzz_settings(default=60, scale=0.5)
@given(_hostile)
@example(FLIGHTS)
def test_hostile_handshakes_are_refused_by_the_transport(served: _Served, flights: list[bytes]) -> None:
    refused, conns, pending = served.read(lambda: _counters(served.transport))
    assert conns == 0 and pending == 0
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_S_MAX) as s:
        for data in flights:
            try:
                s.sendall(data)
            except OSError:
                break  # the server already gave up and closed
        try:
            s.shutdown(socket.SHUT_WR)  # the end of what we send: the server must decide now
            while s.recv(65536):
                pass  # its ServerHello and alerts, until it closes
        except TimeoutError:
            raise AssertionError(f"the transport neither refused nor closed within {SOCKET_S_MAX} s") from None
        except OSError:
            pass  # it closed first (a reset, or already gone)
    deadline = time.monotonic() + SOCKET_S_MAX
    while served.read(lambda: _counters(served.transport)) != (refused + 1, 0, 0):
        assert time.monotonic() < deadline, served.read(lambda: _counters(served.transport))
        time.sleep(0.005)
    with pytest.raises(trio.WouldBlock):
        served.read(served.inbox.receive_nowait)
    tally("transport handshake", "refused")


def test_a_key_holder_still_gets_in_after_the_fuzzing(served: _Served) -> None:
    async def connect_and_send() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", served.port)
        tls = trio.SSLStream(stream, CLIENT_CTX, server_hostname="p2pmesh")
        with trio.fail_after(SOCKET_S_MAX):
            await tls.do_handshake()
            await tls.send_all(b"\x00\x00\x00\x05hello")
            await trio.sleep(0.2)
        await tls.aclose()

    trio.run(connect_and_send)
    events = []
    deadline = time.monotonic() + SOCKET_S_MAX
    while not any(isinstance(e, FrameReceived) for e in events):
        assert time.monotonic() < deadline, events
        try:
            events.append(served.read(served.inbox.receive_nowait))
        except trio.WouldBlock:
            time.sleep(0.01)
    frame = next(e for e in events if isinstance(e, FrameReceived))
    assert frame.peer == CLIENT.node_id and frame.data == b"hello"


# --------------------------------------------------------------------------------------
# Reading the node id out of a certificate

LEAF_DER = x509.load_pem_x509_certificate(CLIENT.cert_pem).public_bytes(serialization.Encoding.DER)


@st.composite
def _mutated_cert(draw: st.DrawFn) -> bytes:
    data = bytearray(LEAF_DER)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(("flip", "set", "cut", "insert")))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        if not data:
            break
    return bytes(data)


@fuzz_settings(default=400)
@given(st.one_of(_mutated_cert(), st.binary(max_size=300)))
@example(b"")
# Regressions: a certificate whose key algorithm cryptography does not know, or with an
# invalid version, raised UnsupportedAlgorithm or InvalidVersion, which the transport's
# handshake did not catch.
@example(LEAF_DER.replace(bytes.fromhex("300506032b6570032100"), bytes.fromhex("300506032a0370032100")))  # key OID 1.2.3.112
@example(LEAF_DER.replace(bytes.fromhex("a003020102"), bytes.fromhex("a003020109"), 1))  # version 10
def test_a_certificate_gives_a_node_id_or_a_protocol_error(der: bytes) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cryptography warns about some malformed fields
            node_id = peer_node_id(der)
    except RemoteProtocolError as exc:
        assert str(exc)
        tally("certificate", "refused")
        return
    assert len(node_id) == 32 and set(node_id) <= set("0123456789abcdef")
    tally("certificate", "accepted")
