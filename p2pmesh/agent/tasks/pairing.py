"""Pairing over a direct cable (`p2pmesh pair`): the agent side of core/pairing.py.

The user runs `p2pmesh pair` on a Mac of the cluster (the host: it listens, for a bounded
window, on its Thunderbolt addresses only, at the agent's port + PAIR_PORT_OFFSET) and
`p2pmesh pair --join` on the new Mac (the guest: a Mac alone in its own cluster). The guest
dials the Macs with another cluster key that zeroconf saw on one of its Thunderbolt
cables, never anything else. Both Macs show a six-digit code; each user confirms that the
two codes match. Then the host seals its cluster key to the guest, and the guest's agent
forgets its one-Mac cluster, installs the key and restarts itself into the host's cluster
(agent/runtime.run_agent). Nothing is changed on either Mac when a code is refused, a step times
out or the other end misbehaves.

Frames: a 2-byte big-endian length, then one message of at most MESSAGE_BYTES_MAX bytes.
Every step is bounded in time (STEP_TIMEOUT_S); the whole session by the window.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent.ports import ClusterView
from p2pmesh.core import pairing
from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.pairing import PairingRefused
from p2pmesh.drivers.streams import recv_exactly

log = logging.getLogger("p2pmesh.pairing")

PAIR_PORT_OFFSET = 3
"""Pairing listens on the agent's port + 3 (probes + 1, model files + 2)."""
WINDOW_S_DEFAULT = 120.0
WINDOW_S_MAX = 900.0
STEP_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 2.0
DIAL_ROUND_S = 1.0

Emit = Callable[[dict[str, Any]], Awaitable[None]]
"""Sends one progress event to the user (the `p2pmesh pair` command)."""
Ask = Callable[[dict[str, Any]], Awaitable[bool]]
"""Shows the code event to the user and returns their answer: do both Macs show it?"""


class PairingError(Exception):
    """Pairing could not run or did not finish; the message says what to do."""


@dataclass(frozen=True, slots=True)
class PairingConfig:
    node_id: NodeId
    cluster_key: bytes = field(repr=False)
    port: int = 0
    """The agent's bound port: the host listens at port + PAIR_PORT_OFFSET."""
    cluster_key_file: Path | None = None
    """Set when the user keeps the key in a file of their own: a guest refuses to replace it."""


@dataclass(frozen=True, slots=True)
class Pairing:
    """What pairing uses of the agent: the view (its ports, whether it is in a cluster and
    how large), its configuration, the Macs zeroconf saw with another cluster key (None:
    the agent runs without mDNS), and a way to take a new key (the runtime restarts into
    its cluster)."""

    view: ClusterView
    config: PairingConfig
    adopt_key: Callable[[bytes], None]
    strangers: Callable[[], Mapping[NodeId, tuple[str, ...]]] | None = None


@dataclass(frozen=True, slots=True)
class Stranger:
    """A Mac that zeroconf saw with another cluster key: where its agent listens."""

    node_id: NodeId
    addresses: tuple[str, ...]
    """HOST:PORT of its agent, as advertised (IPv6 with its scope)."""


async def send_frame(stream: trio.abc.Stream, data: bytes) -> None:
    with trio.fail_after(STEP_TIMEOUT_S):
        await stream.send_all(len(data).to_bytes(2, "big") + data)


async def receive_frame(stream: trio.abc.Stream, timeout_s: float = STEP_TIMEOUT_S) -> bytes:
    """One frame; RemoteProtocolError for an oversized one or a closed stream."""
    with trio.fail_after(timeout_s):
        size = int.from_bytes(await recv_exactly(stream, 2), "big")
        if size > pairing.MESSAGE_BYTES_MAX:
            raise RemoteProtocolError("the other Mac sent an oversized pairing frame")
        return await recv_exactly(stream, size)


async def cable_interfaces(view: ClusterView) -> dict[str, tuple[str, ...]]:
    """This Mac's Thunderbolt interfaces that are up, with their IPv4 networks (CIDR), and
    any bridge over one (macOS's Thunderbolt Bridge holds the cable's addresses)."""
    from p2pmesh.drivers.netconfig import NetconfigError, gather_bridges

    ports = {p.interface: tuple(p.ipv4) for p in view.current.ports if p.kind == "thunderbolt" and p.up}
    try:
        bridges = await gather_bridges() if ports else {}
    except NetconfigError as exc:
        log.debug("cannot list bridges: %s", exc)
        bridges = {}
    return pairing.cable_links(ports, bridges, _ipv4_networks)


def _ipv4_networks(interface: str) -> tuple[str, ...]:
    import ifaddr

    return tuple(f"{ip.ip}/{ip.network_prefix}" for adapter in ifaddr.get_adapters() if adapter.nice_name == interface
                 for ip in adapter.ips if isinstance(ip.ip, str))


def _interface_of_scope(scope: str) -> str | None:
    """An IPv6 scope as an interface name (zeroconf gives the index)."""
    if not scope.isdigit():
        return scope or None
    try:
        return socket.if_indextoname(int(scope))
    except OSError:
        return None


def on_cable(address: str, cables: dict[str, tuple[str, ...]]) -> bool:
    """core/pairing.on_cable with this machine's interface indexes."""
    return pairing.on_cable(address, cables, _interface_of_scope)


async def _listen_hosts(view: ClusterView) -> list[str]:
    """Where the host listens: its cables' IPv4 addresses and IPv6 link-local addresses."""
    from p2pmesh.drivers.discovery import interface_addresses

    cables = await cable_interfaces(view)
    hosts = [cidr.split("/")[0] for networks in cables.values() for cidr in networks]
    if cables:
        hosts += [a for a in interface_addresses(cables, include_loopback=False) if a.startswith("fe80")]
    return sorted(set(hosts))


def _window(request: dict[str, Any]) -> float:
    window = request.get("timeout_s", WINDOW_S_DEFAULT)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 1 <= window <= WINDOW_S_MAX:
        raise PairingError(f"the pairing window must be 1 to {WINDOW_S_MAX:.0f} s")
    return float(window)


async def pair(me: Pairing, request: dict[str, Any], emit: Emit, ask: Ask) -> dict[str, Any]:
    """Run one pairing as the user asked (``join``: this Mac is the guest). Returns the
    final event; PairingError for what the user must fix first."""
    window = _window(request)
    if me.view.current.state is None:
        raise PairingError("the agent is still starting; try again in a few seconds")
    with trio.move_on_after(window):
        if request.get("join"):
            return await _guest(me, window, emit, ask)
        return await _host(me, window, emit, ask)
    return {"paired": False, "error": f"no Mac paired within {window:.0f} s"}


async def _host(me: Pairing, window: float, emit: Emit, ask: Ask) -> dict[str, Any]:
    hosts = await _listen_hosts(me.view)
    if not hosts:
        raise PairingError("no Thunderbolt cable with an address is connected to this Mac: pairing works over a direct cable")
    port = me.config.port + PAIR_PORT_OFFSET
    listeners: list[trio.SocketListener] = []
    for host in hosts:
        try:
            listeners += await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            log.warning("cannot listen for pairing on %s port %d: %s", host, port, exc)
    if not listeners:
        raise PairingError(f"cannot listen for pairing on port {port} of this Mac's cables")
    try:
        return await _host_listening(me, listeners, [f"{h}:{port}" for h in hosts], window, emit, ask)
    finally:
        for listener in listeners:  # closed however the window ends: the port is open only meanwhile
            await trio.aclose_forcefully(listener)


async def _host_listening(me: Pairing, listeners: list[trio.SocketListener], where: list[str], window: float,
                          emit: Emit, ask: Ask) -> dict[str, Any]:
    await emit({"event": "waiting", "role": "host", "listening": where, "window_s": window})
    result: dict[str, Any] = {}
    done = trio.Event()
    busy = False

    async def one(stream: trio.SocketStream) -> None:
        nonlocal busy, result
        async with stream:
            if busy or done.is_set():
                return  # one pairing at a time; the other Mac retries
            busy = True
            try:
                result = await _host_session(me, stream, emit, ask)
                done.set()
            except BROKEN as exc:  # before any code was shown: keep listening
                log.warning("a pairing attempt failed: %s", _why(exc))
                await emit({"event": "attempt failed", "reason": _why(exc)})
            finally:
                busy = False

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(trio.serve_listeners, one, [listener])
        await done.wait()
        nursery.cancel_scope.cancel()
    return result


async def _host_session(me: Pairing, stream: trio.SocketStream, emit: Emit, ask: Ask) -> dict[str, Any]:
    host = pairing.Host(me.config.node_id, os.urandom(pairing.SECRET_BYTES), os.urandom(pairing.NONCE_BYTES),
                        me.config.cluster_key, os.urandom(12))
    await send_frame(stream, host.on_commit(await receive_frame(stream)))
    host.on_reveal(await receive_frame(stream))
    assert host.derived is not None and host.peer is not None
    try:
        return await _host_after_code(host, stream, ask)
    except BROKEN as exc:
        # The code was shown: never ask about another one in this run (a stale "yes" typed
        # for this code must not answer for the next).
        return {"paired": False, "peer": host.peer, "error": f"the pairing broke off after the code was shown ({_why(exc)})"}


async def _host_after_code(host: pairing.Host, stream: trio.SocketStream, ask: Ask) -> dict[str, Any]:
    assert host.derived is not None
    answer: dict[str, bool] = {}
    outcome: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        async def ask_user() -> None:
            answer["yes"] = await ask({"event": "code", "code": host.derived.code, "peer": host.peer})  # type: ignore[union-attr]
            if not answer["yes"]:
                await _send_quietly(stream, pairing.refuse())
                nursery.cancel_scope.cancel()  # no need to wait for the other Mac's answer

        nursery.start_soon(ask_user)
        # The guest's confirm may come before or after this user answers. Errors are caught
        # here, inside the nursery, so they leave it as a result, not an exception group.
        try:
            host.on_confirm(await receive_frame(stream, timeout_s=WINDOW_S_MAX))
        except PairingRefused:
            outcome = {"paired": False, "peer": host.peer, "error": "the user on the other Mac said the codes differ"}
            nursery.cancel_scope.cancel()
        except BROKEN as exc:
            outcome = {"paired": False, "peer": host.peer, "error": f"the pairing broke off after the code was shown ({_why(exc)})"}
            nursery.cancel_scope.cancel()
    if outcome:
        return outcome
    if not answer.get("yes"):
        return {"paired": False, "peer": host.peer, "error": "you said the codes differ: nothing was shared"}
    await send_frame(stream, host.answer(True))
    log.info("gave the cluster key to %s after the user confirmed code %s", host.peer, host.derived.code)
    return {"paired": True, "peer": host.peer, "role": "host"}


BROKEN = (RemoteProtocolError, PairingRefused, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)
"""How a pairing connection ends early: the other Mac's fault, its user's no, silence, or
the connection gone."""


def _why(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "the other Mac stopped answering"
    if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, OSError)):
        return "the connection broke"
    return str(exc)


async def _send_quietly(stream: trio.abc.Stream, data: bytes) -> None:
    try:
        await send_frame(stream, data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
        pass  # the other end is gone: it learns nothing either way


async def strangers_on_cables(me: Pairing) -> list[Stranger]:
    cables = await cable_interfaces(me.view)
    seen = me.strangers() if me.strangers is not None else {}
    out = []
    for node_id, addresses in seen.items():
        mine = tuple(a for a in addresses if on_cable(a, cables))
        if mine:
            out.append(Stranger(node_id, mine))
    return out


async def _guest(me: Pairing, window: float, emit: Emit, ask: Ask) -> dict[str, Any]:
    if me.config.cluster_key_file is not None:
        raise PairingError(f"this agent reads its key from {me.config.cluster_key_file}: install a key there instead")
    if me.strangers is None:
        raise PairingError("pairing finds the other Mac with zeroconf, and this agent runs with --no-mdns")
    state = me.view.current.state
    members = len(state.members) if state is not None else 0
    if members > 1:
        raise PairingError(f"this Mac is in a cluster of {members} Macs; --join adds a Mac that is alone. "
                           "Run `p2pmesh pair` without --join here to let another Mac in")
    await emit({"event": "waiting", "role": "guest", "window_s": window})
    said_none = False
    while True:  # bounded by the window (pair's move_on_after)
        strangers = await strangers_on_cables(me)  # lists bridges: once a round
        for stranger in strangers:
            for address in stranger.addresses:
                host, _, port = address.rpartition(":")
                try:
                    with trio.fail_after(DIAL_TIMEOUT_S):
                        stream = await trio.open_tcp_stream(host.strip("[]"), int(port) + PAIR_PORT_OFFSET)
                except (OSError, trio.TooSlowError, ValueError):
                    continue  # not pairing (yet), or not on this address
                async with stream:
                    try:
                        return await _guest_session(me, stream, emit, ask)
                    except BROKEN as exc:  # before any code was shown: try the next
                        await emit({"event": "attempt failed", "reason": _why(exc)})
        if not said_none and not strangers:
            said_none = True
            await emit({"event": "looking", "detail": "no Mac with another cluster key seen on a Thunderbolt cable yet"})
        await trio.sleep(DIAL_ROUND_S)


async def _guest_session(me: Pairing, stream: trio.SocketStream, emit: Emit, ask: Ask) -> dict[str, Any]:
    guest = pairing.Guest(me.config.node_id, os.urandom(pairing.SECRET_BYTES), os.urandom(pairing.NONCE_BYTES))
    await send_frame(stream, guest.hello())
    await send_frame(stream, guest.on_offer(await receive_frame(stream)))
    assert guest.derived is not None
    yes = await ask({"event": "code", "code": guest.derived.code, "peer": guest.peer})
    try:
        await send_frame(stream, guest.answer(yes))
        if not yes:
            return {"paired": False, "peer": guest.peer, "error": "you said the codes differ: nothing was installed"}
        key = guest.on_key(await receive_frame(stream, timeout_s=WINDOW_S_MAX))
    except PairingRefused:
        return {"paired": False, "peer": guest.peer, "error": "the user on the other Mac said the codes differ"}
    except BROKEN as exc:  # the code was shown: end here rather than ask about another
        return {"paired": False, "peer": guest.peer, "error": f"the pairing broke off after the code was shown ({_why(exc)})"}
    try:
        me.adopt_key(key)
    except LocalProtocolError as exc:
        raise PairingError(str(exc)) from None
    log.info("received the cluster key from %s (code %s): joining its cluster", guest.peer, guest.derived.code)
    return {"paired": True, "peer": guest.peer, "role": "guest", "restarting": True}
