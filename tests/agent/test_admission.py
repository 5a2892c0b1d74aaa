"""Admission against real agent processes on loopback (127.0.0.x only): who gets in, and
what an admitted connection can still not do.

- A client without the key: no certificate at all, a certificate from another cluster
  key, or plain TCP. The handshake fails, the client receives nothing, the agent logs the
  refusal and its membership is unchanged. (Two whole agents with different keys never forming one cluster
  is tests/agent/test_agents_loopback.py::test_an_agent_with_another_key_is_refused; the
  transport alone, in one process, is tests/agent/test_transport.py.)
- A replayed handshake: the bytes of a real, successful handshake captured on the wire and
  replayed on a new connection are refused.
- A peer claiming another node's id: a key holder can put any id in its certificate's
  name, but the agent takes the id from the certificate's key; a Hello claiming the victim
  is refused as malformed and the connection closed.
- A frame from a removed member: a member that left still holds the key and its identity,
  so it can connect; but the Raft messages of its old incarnation no longer write to the
  cluster (its forwarded proposal never reaches the log).
"""
from __future__ import annotations

import socket
import ssl
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from p2pmesh.core import wire
from p2pmesh.core.identity import Identity
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import Capabilities, ForwardProposal, Header, Hello, Put, ReadIndexRequest, ReadIndexResponse
from p2pmesh.drivers import tls
from p2pmesh.drivers.keys import read_key, write_key
from p2pmesh.drivers.storage import Storage
from tests.agent.harness import ROOT, AgentProc, free_port, one_cluster, wait_for

FORM_TIMEOUT_S = 30
IO_TIMEOUT_S = 10
KEY = bytes(range(32))
_LEN = struct.Struct(">I")


def _key_file(tmp_path: Path, key: bytes = KEY, name: str = "key") -> Path:
    path = tmp_path / f"{name}.txt"
    write_key(path, key)
    return path


def _agents(tmp_path: Path, n: int) -> list[AgentProc]:
    key_file = _key_file(tmp_path)
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(n)]
    agents = []
    for i, listen in enumerate(listens):
        a = AgentProc(tmp_path / f"a{i}", listen, peers=[p for p in listens if p != listen], key_file=key_file)
        a.state_dir.mkdir()
        agents.append(a)
    return agents


def _hostport(agent: AgentProc) -> tuple[str, int]:
    host, port = agent.listen.rsplit(":", 1)
    return host, int(port)


def _frame(message: Any) -> bytes:
    body = wire.encode(message)
    return _LEN.pack(len(body)) + body


def _standalone(tmp_path: Path) -> AgentProc:
    (a,) = _agents(tmp_path, 1)
    a.start()
    wait_for(lambda: (a.status() or {}).get("role") == "standalone", FORM_TIMEOUT_S, "a standalone agent")
    return a


def _refusal_logged(agent: AgentProc, source: str) -> bool:
    return f"refused connection from {source}:" in agent.log_text()


# --------------------------------------------------------------------------------------


def test_a_client_without_the_key_is_refused(tmp_path: Path) -> None:
    a = _standalone(tmp_path)
    try:
        host, port = _hostport(a)
        before = a.status()
        assert before is not None
        hello = _frame(Hello(NodeId("ee" * 16), 1, None, 0, False, None, (), Capabilities(0, "")))

        # 1. TLS without any client certificate (127.0.0.10).
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname = False
        no_cert.verify_mode = ssl.CERT_NONE
        # 2. TLS with a certificate from another cluster key (127.0.0.11).
        _, other_key = tls.Credentials.issue(Identity.from_seed(bytes([5]) * 32), bytes(32)).contexts()
        for source, ctx in (("127.0.0.10", no_cert), ("127.0.0.11", other_key)):
            with socket.create_connection((host, port), timeout=IO_TIMEOUT_S, source_address=(source, 0)) as raw:
                got = b""
                try:
                    with ctx.wrap_socket(raw, server_hostname="p2pmesh") as s:
                        s.sendall(hello)  # TLS 1.3: the server checks the client's certificate after this
                        while chunk := s.recv(4096):
                            got += chunk
                except (ssl.SSLError, OSError):
                    pass  # the server's alert, or a reset
                assert got == b""  # not one byte of the agent's traffic
            wait_for(lambda: _refusal_logged(a, source), IO_TIMEOUT_S, f"the refusal of {source}")
        # 3. Plain TCP: a frame without TLS (127.0.0.12).
        with socket.create_connection((host, port), timeout=IO_TIMEOUT_S, source_address=("127.0.0.12", 0)) as s:
            s.sendall(hello)
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(4096):
                    pass  # at most a TLS alert
            except OSError:
                pass
        wait_for(lambda: _refusal_logged(a, "127.0.0.12"), IO_TIMEOUT_S, "the refusal of plain TCP")

        after = a.status()
        assert after is not None and after["role"] == "standalone"
        assert [m["node_id"] for m in after["members"]] == [m["node_id"] for m in before["members"]]
    finally:
        a.stop()


# --------------------------------------------------------------------------------------


async def _capture_handshake(host: str, port: int, client_ctx: ssl.SSLContext) -> tuple[bytes, bytes]:
    """A real client completes a real handshake with the agent through a relay on 127.0.0.1 that records both directions: (client's bytes, agent's)."""
    sent, received = bytearray(), bytearray()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    relay_port = listeners[0].socket.getsockname()[1]

    async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, record: bytearray, done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                record.extend(data)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()

    async with trio.open_nursery() as nursery:
        async def relay() -> None:
            inbound = await listeners[0].accept()
            upstream = await trio.open_tcp_stream(host, port)
            async with inbound, upstream, trio.open_nursery() as pumps:
                pumps.start_soon(pump, inbound, upstream, sent, pumps.cancel_scope)
                pumps.start_soon(pump, upstream, inbound, received, pumps.cancel_scope)

        nursery.start_soon(relay)
        with trio.fail_after(IO_TIMEOUT_S):
            stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", relay_port), client_ctx,
                                    server_hostname="p2pmesh")
            await stream.do_handshake()  # admitted: a key holder
            await trio.sleep(0.5)  # the agent's session tickets, if any, are part of the capture
            await stream.aclose()
            await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()
    return bytes(sent), bytes(received)


def _tls_records(data: bytes) -> list[tuple[int, bytes]]:
    """(content type, body) of each TLS record in ``data``."""
    out, pos = [], 0
    while pos + 5 <= len(data):
        kind, length = data[pos], struct.unpack(">H", data[pos + 3:pos + 5])[0]
        out.append((kind, data[pos + 5:pos + 5 + length]))
        pos += 5 + length
    return out


def test_a_replayed_handshake_is_refused(tmp_path: Path) -> None:
    """Why a replay cannot get in: in TLS 1.3 the server answers every ClientHello with a
    fresh random and a fresh ephemeral key share, so the keys of the new session differ from
    the recorded one's. The recorded client Finished and CertificateVerify (a signature over
    the old transcript, by the client's node key) then neither decrypt nor verify, and the
    handshake fails before any frame is read. A session-ticket resumption would still need
    the ticket's secret, and Python's ssl accepts no 0-RTT early data, so nothing is
    replayable before the handshake completes. The identity (the node id) is only bound once
    the handshake completes, which a replay never does."""
    a = _standalone(tmp_path)
    try:
        host, port = _hostport(a)
        _, client_ctx = tls.Credentials.issue(Identity.from_seed(bytes([9]) * 32), read_key(a.key_file)).contexts()  # type: ignore[arg-type]
        sent, received = trio.run(_capture_handshake, host, port, client_ctx)
        assert _tls_records(sent)[0][0] == 22 and len(_tls_records(sent)) >= 3  # ClientHello, then the rest
        assert not _refusal_logged(a, "127.0.0.1")  # the original was admitted

        client_hello_bytes = 5 + len(_tls_records(sent)[0][1])
        with socket.create_connection((host, port), timeout=IO_TIMEOUT_S, source_address=("127.0.0.13", 0)) as s:
            s.sendall(sent[:client_hello_bytes])  # as a real client paces it: the hello, then the answer
            answer = s.recv(65536)
            s.sendall(sent[client_hello_bytes:])
            s.shutdown(socket.SHUT_WR)
            try:
                while chunk := s.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        wait_for(lambda: _refusal_logged(a, "127.0.0.13"), IO_TIMEOUT_S, "the refusal of the replay")
        # The agent answered the replayed ClientHello with a new ServerHello (another random).
        original_hello, replay_hello = _tls_records(received)[0][1], _tls_records(answer)[0][1]
        assert original_hello[:1] == replay_hello[:1] == b"\x02"
        assert original_hello[6:38] != replay_hello[6:38]
        status = a.status()
        assert status is not None and status["role"] == "standalone" and len(status["members"]) == 1
    finally:
        a.stop()


# --------------------------------------------------------------------------------------


def _impostor_context(cluster_key: bytes, victim: NodeId) -> tuple[ssl.SSLContext, NodeId]:
    """What a key holder can make: a certificate from the cluster CA that names the victim
    (subject and serial), over the impostor's own key. Returns the context and the node id
    its key really proves."""
    ca = tls._ca_key(cluster_key)
    own = Ed25519PrivateKey.from_private_bytes(bytes([11]) * 32)
    real_id = Identity.from_seed(bytes([11]) * 32).node_id
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, victim)]))
        .issuer_name(tls._CA_NAME)
        .public_key(own.public_key())
        .serial_number(int(victim, 16))
        .not_valid_before(tls._NOT_BEFORE)
        .not_valid_after(tls._NOT_AFTER)
        .sign(ca, None)
    )
    genuine = tls.Credentials.issue(Identity.from_seed(bytes([11]) * 32), cluster_key)
    forged = tls.Credentials(
        ca_pem=genuine.ca_pem,
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=own.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        node_id=victim,
    )
    return forged.contexts()[1], real_id


def test_a_peer_claiming_another_nodes_id_is_refused(tmp_path: Path) -> None:
    agents = _agents(tmp_path, 2)
    try:
        for a in agents:
            a.start()
        status = wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of 2")
        target, victim_agent = agents
        victim = NodeId((victim_agent.status() or {})["node_id"])
        victim_view = next(m for m in status["members"] if m["node_id"] == victim)
        ctx, real_id = _impostor_context(KEY, victim)
        host, port = _hostport(target)
        hello = Hello(victim, 1, ClusterId(status["cluster_id"]), 2, True, victim, ("127.0.0.99:1",), Capabilities(1, "forged"))

        async def impersonate() -> bytes:
            stream = trio.SSLStream(await trio.open_tcp_stream(host, port), ctx, server_hostname="p2pmesh")
            got = b""
            with trio.fail_after(IO_TIMEOUT_S):
                await stream.do_handshake()  # the CA signed it: admitted, as real_id
                await stream.send_all(_frame(hello))
                try:
                    while chunk := await stream.receive_some(65536):
                        got += chunk
                except trio.BrokenResourceError:
                    pass
            return got  # until the agent closed the connection

        trio.run(impersonate)
        wait_for(lambda: f"closing the connection to {real_id}: it sent a malformed frame" in target.log_text(),
                 IO_TIMEOUT_S, "the impostor's connection closed as malformed")
        after = wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "the same cluster of 2")
        assert after["cluster_id"] == status["cluster_id"]
        assert {m["node_id"] for m in after["members"]} == {m["node_id"] for m in status["members"]}
        assert next(m for m in after["members"] if m["node_id"] == victim)["addresses"] == victim_view["addresses"]
        assert real_id not in {m["node_id"] for m in after["members"]}
    finally:
        for a in agents:
            a.stop()


# --------------------------------------------------------------------------------------


def _incarnations(state: Any) -> dict[str, int]:
    """node id -> incarnation, as the log a node persisted last says."""
    incs = {m.node_id: m.inc for m in state.snapshot.state.members}
    for entry in state.entries:
        cmd = entry.command
        if hasattr(cmd, "node_id") and hasattr(cmd, "inc"):
            incs[cmd.node_id] = cmd.inc
    return incs


def _all_puts(state: Any) -> list[tuple[str, str]]:
    kv = list(state.snapshot.state.kv)
    kv += [(e.command.key, e.command.value) for e in state.entries if isinstance(e.command, Put)]
    return kv


def test_a_frame_from_a_removed_member_changes_nothing(tmp_path: Path) -> None:
    agents = _agents(tmp_path, 3)
    try:
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
        leaver, rest = agents[0], agents[1:]
        leaver_id = NodeId((leaver.status() or {})["node_id"])
        r = subprocess.run([sys.executable, "-m", "p2pmesh", "leave", "--state-dir", str(leaver.state_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert leaver.proc is not None and leaver.proc.wait(timeout=20) == 0
        status = wait_for(lambda: one_cluster(rest, 2), FORM_TIMEOUT_S, "the remaining two as a cluster of 2")

        # What the removed member still has: the key, its identity and its old incarnation.
        with Storage.open(leaver.state_dir) as st:
            seed = st.load_identity_seed()
            persisted = st.load()
        assert seed is not None and persisted is not None
        incs = _incarnations(persisted)
        leader_id = NodeId(status["leader"])
        leader = next(a for a in rest if (a.status() or {}).get("node_id") == leader_id)
        _, ctx = tls.Credentials.issue(Identity.from_seed(seed), KEY).contexts()
        host, port = _hostport(leader)
        term = (leader.status() or {})["term"]
        hdr = Header(ClusterId(status["cluster_id"]), leaver_id, incs[leaver_id], leader_id, incs[leader_id], term)

        async def speak_as_removed_member() -> list[Any]:
            stream = trio.SSLStream(await trio.open_tcp_stream(host, port), ctx, server_hostname="p2pmesh")
            replies: list[Any] = []
            with trio.fail_after(IO_TIMEOUT_S):
                await stream.do_handshake()  # it still holds the key: the transport admits it
                # A forwarded write, then a read: the leader answers the read only when the
                # header is current (cluster, addressee and its incarnation, term), so the
                # answer proves the write was judged on membership alone.
                await stream.send_all(_frame(ForwardProposal(hdr, Put("written-by", "a removed member"))))
                await stream.send_all(_frame(ReadIndexRequest(hdr, 4242)))
                buf = b""
                while not any(isinstance(m, ReadIndexResponse) and m.ctx == 4242 for m in replies):
                    buf += await stream.receive_some(65536)
                    while len(buf) >= 4 and len(buf) >= 4 + _LEN.unpack_from(buf)[0]:
                        n = _LEN.unpack_from(buf)[0]
                        replies.append(wire.decode(buf[4:4 + n]))
                        buf = buf[4 + n:]
            await trio.sleep(1.0)  # time for a proposal to commit, had it been accepted
            await stream.aclose()
            return replies

        replies = trio.run(speak_as_removed_member)
        assert any(isinstance(m, ReadIndexResponse) and m.ctx == 4242 for m in replies)
        after = wait_for(lambda: one_cluster(rest, 2), FORM_TIMEOUT_S, "the cluster of 2, unchanged")
        assert after["cluster_id"] == status["cluster_id"] and after["leader"] == leader_id
        assert leaver_id not in {m["node_id"] for m in after["members"]}
    finally:
        for a in agents:
            a.stop()
    # The committed state, read from the remaining members' own wal: no write of the removed member.
    for a in rest:
        with Storage.open(a.state_dir) as st:
            state = st.load()
        assert state is not None
        assert ("written-by", "a removed member") not in _all_puts(state)
