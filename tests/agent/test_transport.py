"""The transport under hostile conditions, in one trio process over loopback: peers without
the key, a flood of half-open connections, oversized frames, a dialed peer that turns out
to be someone else."""
from __future__ import annotations

import os
import random
import struct

import pytest
import trio

from p2pmesh.core.identity import Identity
from p2pmesh.core.machine import FrameReceived, Input
from p2pmesh.drivers.tls import Credentials
from p2pmesh.drivers.transport import Transport

KEY = bytes(range(32))
OTHER_KEY = bytes(32)


def _transport(key: bytes, inbox: trio.MemorySendChannel[Input]) -> tuple[Transport, Identity]:
    ident = Identity.from_seed(os.urandom(32))
    server_ctx, client_ctx = Credentials.issue(ident, key).contexts()
    return Transport(me=ident.node_id, server_ctx=server_ctx, client_ctx=client_ctx, inbox=inbox, rng=random.Random(1)), ident


async def _serve(nursery: trio.Nursery, t: Transport) -> str:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(t.run, listeners)
    return f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def _frames(inbox: trio.MemoryReceiveChannel[Input], seconds: float) -> list[FrameReceived]:
    out: list[FrameReceived] = []
    with trio.move_on_after(seconds):
        async for ev in inbox:
            if isinstance(ev, FrameReceived):
                out.append(ev)
    return out


@pytest.mark.trio
async def test_frames_flow_between_key_holders_and_not_to_others() -> None:
    inbox_a_send, inbox_a = trio.open_memory_channel[Input](100)
    inbox_b_send, _ = trio.open_memory_channel[Input](100)
    inbox_c_send, _ = trio.open_memory_channel[Input](100)
    a, ident_a = _transport(KEY, inbox_a_send)
    b, _ = _transport(KEY, inbox_b_send)
    outsider, _ = _transport(OTHER_KEY, inbox_c_send)
    async with trio.open_nursery() as nursery:
        addr_a = await _serve(nursery, a)
        await _serve(nursery, b)
        await _serve(nursery, outsider)
        b.learn(ident_a.node_id, (addr_a,))
        outsider.learn(ident_a.node_id, (addr_a,))
        for _ in range(30):
            b.send(ident_a.node_id, b"hello from b")
            outsider.send(ident_a.node_id, b"hello from outsider")
            await trio.sleep(0.05)
        frames = await _frames(inbox_a, 1.0)
        assert frames and all(f.data == b"hello from b" and f.peer == b.me for f in frames)
        assert a.refused >= 1  # the outsider's handshakes failed
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_flood_of_silent_connections_does_not_starve_a_real_peer() -> None:
    inbox_send, inbox = trio.open_memory_channel[Input](100)
    a, ident_a = _transport(KEY, inbox_send)
    b, _ = _transport(KEY, trio.open_memory_channel[Input](100)[0])
    async with trio.open_nursery() as nursery:
        addr = await _serve(nursery, a)
        await _serve(nursery, b)
        host, port = addr.split(":")
        # The flood comes from another host (another loopback address) than the real peer.
        silent = [await trio.open_tcp_stream(host, int(port), local_address="127.0.0.9") for _ in range(60)]
        b.learn(ident_a.node_id, (addr,))
        with trio.fail_after(3):
            while True:
                b.send(ident_a.node_id, b"still here")
                frames = await _frames(inbox, 0.2)
                if frames:
                    break
        assert frames[0].data == b"still here"
        for s in silent:
            await s.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_an_oversized_frame_closes_the_connection_without_delivery() -> None:
    inbox_send, inbox = trio.open_memory_channel[Input](100)
    a, ident_a = _transport(KEY, inbox_send)
    ident_b = Identity.from_seed(os.urandom(32))
    _, client_ctx = Credentials.issue(ident_b, KEY).contexts()
    async with trio.open_nursery() as nursery:
        addr = await _serve(nursery, a)
        host, port = addr.split(":")
        raw = await trio.open_tcp_stream(host, int(port))
        tls = trio.SSLStream(raw, client_ctx, server_hostname="p2pmesh")
        await tls.do_handshake()
        await tls.send_all(struct.pack(">I", 64 * 1024 * 1024) + b"x" * 1000)
        with trio.fail_after(10):
            try:
                while await tls.receive_some(1024):
                    pass
            except trio.BrokenResourceError:
                pass  # closed by the transport: what we expect
        assert await _frames(inbox, 0.3) == []
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_dialed_peer_with_an_unexpected_node_id_is_dropped() -> None:
    a, ident_a = _transport(KEY, trio.open_memory_channel[Input](100)[0])
    b, _ = _transport(KEY, trio.open_memory_channel[Input](100)[0])
    async with trio.open_nursery() as nursery:
        addr_a = await _serve(nursery, a)
        await _serve(nursery, b)
        impostor_id = Identity.from_seed(bytes([7]) * 32).node_id
        b.learn(impostor_id, (addr_a,))  # a's address, advertised under another id
        for _ in range(10):
            b.send(impostor_id, b"x")
            await trio.sleep(0.05)
        assert impostor_id not in b.conns and ident_a.node_id not in b.conns
        nursery.cancel_scope.cancel()
