"""The agent's link tasks: watch this Mac's ports, measure its cables, and (only when the
user asked with --configure-links) address the ring's cables.

Each task turns I/O into core inputs (PortsObserved, ProbesMeasured) on the agent's inbox
or reads the committed, durable state from the ClusterView (agent/ports.py), waking when it
changes; none of them touches the Machine. Only what watches the outside world keeps a
period (ports, addresses, the periodic probe).
- watch_ports: polls the link watcher (sysfs on Linux: cheap, every 0.25 s, so a pulled
  cable reaches the ring within the 1 s target; system_profiler on macOS: slow, every 3 s);
- probes: serves the bounded probe protocol on this Mac's Thunderbolt addresses and on its
  transport addresses (never on other interfaces), and probes every cabled peer over its
  cable, and every peer joined by no known cable (a "network" hop) over the address the
  data plane reaches it at, after each ring change and then every PROBE_PERIOD_S;
- warn_bridges: after each ring epoch, warns when a bridge joins this Mac's ring cables;
- configure_links: after each ring epoch, adds the planned /30 addresses for this Mac's ring
  cables (p2pmesh links plan shows the same commands).
"""
from __future__ import annotations

import ipaddress
import logging
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio

from p2pmesh.agent.ports import ClusterView, Inbox, Snapshot
from p2pmesh.core import physical
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import PATH_INTERFACE, ClusterState, LinkProbe, Member, PortInfo
from p2pmesh.core.node_io import AddressesChanged, PortsObserved, ProbesMeasured
from p2pmesh.core.validate import PORTS_MAX

log = logging.getLogger("p2pmesh.links")

WATCH_PERIOD_S = 3.0 if sys.platform == "darwin" else 0.25
ADDRESS_PERIOD_S = 1.0
"""How often the interface addresses are listed (getifaddrs: cheap, no tool run)."""
PROBE_PERIOD_S = 60.0
PROBE_SETTLE_S = 15.0
"""A ring change is probed at once and again this long after: the first round runs while
agents start, workers restart and load weights, and a path probed through a busy event loop
reads slow (2.9 ms instead of 0.15 ms for a loopback round trip, measured here)."""
PROBE_RETRY_S = 5.0
PROBE_RETRIES = 3
"""A probe that failed (the peer's listener not up yet: it joined this very epoch) is tried
again after PROBE_RETRY_S, at most PROBE_RETRIES times per ring epoch, not a period later."""
PROBE_PORT_OFFSET = 1
"""Probes listen on the agent's port + 1, on Thunderbolt and transport addresses only."""
PROBE_TARGETS_MAX = 16
"""Of each sort (cables, paths): PROBES_MAX (core/validate.py) bounds what one node publishes."""


async def watch_ports(inbox: Inbox, interfaces: tuple[str, ...]) -> None:
    """Poll this Mac's ports (only ``interfaces`` when given) and report each change. A
    period, not the view: cables come and go outside the cluster's knowledge."""
    from p2pmesh.drivers import linkwatch

    only = set(interfaces) or None
    last: tuple[PortInfo, ...] | None = None
    failing = False
    while True:  # runs for the agent's lifetime; cancelled with its nursery
        try:
            found = await linkwatch.detect_ports(interfaces=only)
            # Thunderbolt first, so a host with very many interfaces still publishes its
            # cables within the bound the cluster accepts.
            ports = tuple(sorted(found, key=lambda p: (p.kind != "thunderbolt", p.interface))[:PORTS_MAX])
            failing = False
        except Exception as exc:  # a tool failed: keep the last good view, say so once
            if not failing:
                log.warning("cannot read this Mac's ports: %s", exc)
            failing = True
            ports = last or ()
        if ports != last:
            last = ports
            await inbox.put(PortsObserved(ports))
        await trio.sleep(WATCH_PERIOD_S)


async def watch_addresses(inbox: Inbox, addresses: Callable[[], tuple[str, ...]], advertised: tuple[str, ...]) -> None:
    """Report this Mac's control-plane addresses whenever they change (a cable came up with
    an address, a laptop moved networks, a new DHCP lease). The core publishes them
    (UpdateMember), so peers dial, and LAN hops use, where the Mac is now."""
    last = advertised
    while True:  # runs for the agent's lifetime; cancelled with its nursery
        await trio.sleep(ADDRESS_PERIOD_S)
        try:
            now = addresses()
        except OSError as exc:  # the interface list could not be read: keep the last one
            log.debug("cannot list this Mac's addresses: %s", exc)
            continue
        if now and now != last:
            log.info("this Mac's addresses changed: %s", ", ".join(now))
            last = now
            await inbox.put(AddressesChanged(now))


def _my_cables(state: ClusterState, me: NodeId) -> list[tuple[str, str, str]]:
    """(my interface, peer node id, peer IPv4) for every Thunderbolt cable of this Mac whose
    two ends share an IPv4 subnet (the probe goes over that very cable)."""
    out = []
    for c in physical.cables(state, physical.serving(state)):
        if c.kind != "thunderbolt" or me not in (c.a, c.b):
            continue
        mine, theirs = (c.a_port, c.b_port) if c.a == me else (c.b_port, c.a_port)
        if mine is None or theirs is None:
            continue
        pair = physical.common_subnet(mine.ipv4, theirs.ipv4)
        if pair is not None:
            out.append((mine.interface, c.b if c.a == me else c.a, pair[1]))
    return out[:PROBE_TARGETS_MAX]


def _my_paths(state: ClusterState, me: NodeId) -> list[tuple[NodeId, str, int]]:
    """(peer node id, its IPv4, its probe port) for every peer joined to this Mac by no known
    cable: probed at the first IPv4 transport address it publishes, the one a network hop
    of the data plane uses (core/physical.describe_hop), at that address's port + 1."""
    by_id = {m.node_id: m for m in state.members}
    out = []
    for c in physical.cables(state, physical.serving(state)):
        if c.kind != physical.NETWORK_KIND or me not in (c.a, c.b):
            continue
        peer = c.b if c.a == me else c.a
        target = _ipv4_transport(by_id[peer])
        if target is not None:
            out.append((peer, target[0], target[1] + PROBE_PORT_OFFSET))
    return out[:PROBE_TARGETS_MAX]


def _ipv4_transport(m: Member) -> tuple[str, int] | None:
    for address in m.addresses:
        host, _, port = address.rpartition(":")
        try:
            return str(ipaddress.IPv4Address(host)), int(port)
        except ValueError:
            continue
    return None


def _my_probe_hosts(snapshot: Snapshot, transport_hosts: tuple[str, ...]) -> set[str]:
    """This Mac's Thunderbolt addresses and its transport addresses: the explicit listen
    hosts, or (listening on every address) the addresses it publishes, which peers dial."""
    hosts = {addr.split("/")[0] for p in snapshot.ports if p.kind == "thunderbolt" and p.up for addr in p.ipv4}
    if transport_hosts:
        return hosts | set(transport_hosts)
    state = snapshot.state
    mine = next((m for m in state.members if m.node_id == snapshot.node_id), None) if state is not None else None
    for address in mine.addresses if mine is not None else ():
        host = address.rpartition(":")[0].strip("[]")
        if host:
            hosts.add(host)
    return hosts


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """Where probes listen (the agent's port + PROBE_PORT_OFFSET) and the TLS contexts
    (the cluster's credentials: a probe is answered only inside the cluster)."""

    port: int
    server_ctx: ssl.SSLContext
    client_ctx: ssl.SSLContext
    transport_hosts: tuple[str, ...] = ()
    """The hosts the agent's transport listens on explicitly; empty when it listens on every
    address (probes then listen on the addresses this Mac publishes, never the wildcard)."""


async def probes(view: ClusterView, inbox: Inbox, config: ProbeConfig) -> None:
    """Serve probes on this Mac's Thunderbolt and transport addresses and probe its peers
    (cables and network paths): after every ring change, and every PROBE_PERIOD_S (a link's
    speed changes outside the cluster's knowledge: the period is why this task has a
    timeout)."""
    from p2pmesh.drivers.probe import serve_probes

    port, server_ctx, client_ctx = config.port, config.server_ctx, config.client_ctx
    serving: dict[str, trio.CancelScope] = {}
    last_epoch = -1
    next_probe = 0.0
    retries = 0

    async def serve_one(host: str, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await serve_probes(host, port, server_ctx)
            except OSError as exc:
                log.warning("cannot serve link probes on %s:%d: %s", host, port, exc)

    async with trio.open_nursery() as nursery:
        while True:  # for the agent's lifetime
            snapshot = view.current
            hosts = _my_probe_hosts(snapshot, config.transport_hosts)
            for host in set(serving) - hosts:
                serving.pop(host).cancel()
            for host in hosts - set(serving):
                serving[host] = trio.CancelScope()
                nursery.start_soon(serve_one, host, serving[host])
            state = snapshot.state
            epoch = state.ring_epoch if state is not None else 0
            if epoch != last_epoch or trio.current_time() >= next_probe:
                fresh = epoch != last_epoch
                if fresh:
                    last_epoch, retries = epoch, 0
                results, tried = await _probe_round(state, snapshot.node_id, port, client_ctx) if state else ([], 0)
                retries = retries + 1 if len(results) < tried else 0
                wait = (PROBE_RETRY_S if 0 < retries <= PROBE_RETRIES else PROBE_SETTLE_S if fresh else PROBE_PERIOD_S)
                next_probe = trio.current_time() + wait
                if results or snapshot.probes:
                    await inbox.put(ProbesMeasured(tuple(results)))
            await view.changed(snapshot.version, timeout_s=max(0.0, next_probe - trio.current_time()))


async def _probe_round(state: ClusterState, me: NodeId, port: int,
                       client_ctx: ssl.SSLContext) -> tuple[list[LinkProbe], int]:
    """Probe each cable at the peer's end of it and each network path at the peer's
    transport address, one after the other (so they do not slow each other): the results,
    and how many were tried."""
    from p2pmesh.drivers.probe import ProbeError, probe

    targets = [(i, peer, ip, port) for i, peer, ip in _my_cables(state, me)]
    targets += [(PATH_INTERFACE, peer, ip, p) for peer, ip, p in _my_paths(state, me)]
    results: list[LinkProbe] = []
    for interface, peer, host, peer_port in targets:
        try:
            r = await probe(host, peer_port, client_ctx, peer, timeout_s=3.0)
        except ProbeError as exc:
            log.info("probe of %s over %s failed: %s", peer[:8], interface or f"the path to {host}", exc)
            continue
        results.append(LinkProbe(interface, peer, round(r.rtt_ms, 3), round(r.gbps, 2), round(r.echo_rtt_ms, 3)))
    return results, len(targets)


async def _ring_epochs(view: ClusterView) -> AsyncIterator[tuple[Snapshot, ClusterState]]:
    """Each committed ring epoch once, with the snapshot that brought it, for the agent's
    lifetime (woken by the view: no period)."""
    last_epoch = -1
    seen = -1
    while True:
        snapshot = await view.changed(seen)
        seen = snapshot.version
        state = snapshot.state
        if state is not None and state.ring_epoch != last_epoch:
            last_epoch = state.ring_epoch
            yield snapshot, state


async def warn_bridges(view: ClusterView) -> None:
    """After every ring change, warn (once per distinct warning) when a bridge joins this
    Mac's ring cables (macOS's Thunderbolt Bridge does by default): a loop that can flood
    the network. Only a warning: the user decides (docs/links.md)."""
    from p2pmesh.core.addressing import bridge_warnings
    from p2pmesh.drivers.netconfig import NetconfigError, gather_bridges

    platform = "darwin" if sys.platform == "darwin" else "linux"
    said: set[str] = set()
    async for snapshot, state in _ring_epochs(view):
        me = snapshot.node_id
        mine = {h.src_interface for h in state.ring_hops if h.src == me and h.src_interface}
        mine |= {h.dst_interface for h in state.ring_hops if h.dst == me and h.dst_interface}
        if mine:
            try:
                bridges = await gather_bridges()
            except NetconfigError as exc:
                log.debug("cannot list bridges: %s", exc)
                bridges = {}
            for warning in bridge_warnings(bridges, mine, platform=platform):
                if warning not in said:
                    said.add(warning)
                    log.warning("%s", warning)


async def configure_links(view: ClusterView) -> None:
    """Add the planned addresses for this Mac's ring cables after every ring change."""
    from p2pmesh.core.addressing import AddressingError, commands_for, plan_addresses
    from p2pmesh.drivers.netconfig import NetconfigError, apply

    platform = "darwin" if sys.platform == "darwin" else "linux"
    done: set[tuple[str, ...]] = set()
    async for snapshot, state in _ring_epochs(view):
        present = {port.interface: port.ipv4 for port in snapshot.ports}
        try:
            commands = commands_for(snapshot.node_id, plan_addresses(state.ring_hops), platform, present=present)
        except AddressingError as exc:
            log.warning("cannot plan data-plane addresses: %s", exc)
            commands = []
        todo = [c for c in commands if tuple(c) not in done]
        if todo:
            log.info("configuring ring links (--configure-links): %s", "; ".join(" ".join(c) for c in todo))
            try:
                await apply(todo)
                done.update(tuple(c) for c in todo)
            except NetconfigError as exc:
                log.warning("could not configure a ring link: %s", exc)
