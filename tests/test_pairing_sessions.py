"""The agent side of pairing (p2pmesh/agent/tasks/pairing.py) over real TCP on loopback: the host and
guest sessions agree, a stranger's garbage is refused before any code is shown, and a
connection that breaks after the code ends the pairing instead of asking again."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from p2pmesh.agent.ports import ViewPublisher
from p2pmesh.agent.tasks import pairing
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId

KEY = bytes(range(32))


@dataclass
class _Mac:
    """One side's pairing ports (a real view, its key) and the keys it was given."""

    node_id: NodeId
    cluster_key: bytes = KEY
    adopted: list[bytes] = field(default_factory=list)

    @property
    def ports(self) -> pairing.Pairing:
        config = pairing.PairingConfig(self.node_id, self.cluster_key)
        return pairing.Pairing(ViewPublisher(self.node_id).view, config, self.adopted.append)


async def _connected() -> tuple[trio.SocketStream, trio.SocketStream, trio.SocketListener]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    return client, server, listeners[0]


def _asker(answer: bool, seen: list[dict[str, Any]]) -> pairing.Ask:
    async def ask(event: dict[str, Any]) -> bool:
        seen.append(event)
        return answer
    return ask


async def _no_emit(event: dict[str, Any]) -> None:
    pass


@pytest.mark.trio
@pytest.mark.parametrize("host_yes, guest_yes", [(True, True), (True, False), (False, True)])
async def test_the_key_crosses_only_when_both_users_say_yes(host_yes: bool, guest_yes: bool) -> None:
    host_agent, guest_agent = _Mac(NodeId("b" * 32)), _Mac(NodeId("a" * 32), cluster_key=bytes(32))
    client, server, listener = await _connected()
    host_seen: list[dict[str, Any]] = []
    guest_seen: list[dict[str, Any]] = []
    results: dict[str, dict[str, Any]] = {}

    async def host() -> None:
        results["host"] = await pairing._host_session(host_agent.ports, server, _no_emit, _asker(host_yes, host_seen))

    async def guest() -> None:
        results["guest"] = await pairing._guest_session(guest_agent.ports, client, _no_emit, _asker(guest_yes, guest_seen))

    with trio.fail_after(20):
        async with client, server, listener, trio.open_nursery() as nursery:
            nursery.start_soon(host)
            nursery.start_soon(guest)
    assert host_seen[0]["code"] == guest_seen[0]["code"]
    both = host_yes and guest_yes
    assert results["host"]["paired"] is both and results["guest"]["paired"] is both
    assert guest_agent.adopted == ([KEY] if both else [])


@pytest.mark.trio
@pytest.mark.parametrize("garbage", [b"\x00\x05hello", b"\xff\xff" + b"x" * 10, b"\x00"])
async def test_garbage_before_a_code_is_refused_and_asks_nothing(garbage: bytes) -> None:
    client, server, listener = await _connected()
    seen: list[dict[str, Any]] = []
    with trio.fail_after(20):
        async with client, server, listener:
            await client.send_all(garbage)
            await client.aclose()
            with pytest.raises(RemoteProtocolError):
                await pairing._host_session(_Mac(NodeId("b" * 32)).ports, server, _no_emit, _asker(True, seen))
    assert seen == []


@pytest.mark.trio
async def test_a_guest_gone_after_the_code_ends_the_pairing(autojump_clock: trio.abc.Clock) -> None:
    # The guest's pause before it vanishes is mock time: the host has read the offer's reply
    # (a loopback frame) before every task blocks and the clock jumps.
    from p2pmesh.core import pairing as core

    client, server, listener = await _connected()
    guest = core.Guest(NodeId("a" * 32), bytes(range(1, 33)), bytes(16))
    seen: list[dict[str, Any]] = []

    async def vanish_after_reveal() -> None:
        await pairing.send_frame(client, guest.hello())
        await pairing.send_frame(client, guest.on_offer(await pairing.receive_frame(client)))
        await trio.sleep(0.2)
        await client.aclose()

    with trio.fail_after(20):
        async with server, listener, trio.open_nursery() as nursery:
            nursery.start_soon(vanish_after_reveal)
            result = await pairing._host_session(_Mac(NodeId("b" * 32)).ports, server, _no_emit, _asker(True, seen))
    assert result["paired"] is False and "broke off after the code" in result["error"]
    assert len(seen) == 1
