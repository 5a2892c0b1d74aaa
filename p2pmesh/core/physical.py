"""The physical graph of the cluster and the ring the leader proposes from it.

Every member publishes its ports (PortInfo) and its probe results (LinkProbe) into the
committed state. From that state alone this module
- pairs the two ends of every Thunderbolt cable by domain UUID: a port on Mac A whose peer
  UUID is B's domain UUID on a port whose peer UUID is A's, both with carrier (a Mac
  behind a dock never matches: the dock's UUID is not a Mac's port);
- adds an Ethernet or Wi-Fi link between two members whose ports of that kind share an
  IPv4 subnet;
- adds a last-resort ``network`` link between members with no link at all (they reach each
  other somehow: the control plane works), so a ring can always close, flagged slow; its
  ends probe it over their transport addresses (LinkProbe over PATH_INTERFACE), and the
  planner costs it at what they measured (``Cable.planned_gbps``, ``rtt_ms``);
- solves the ring (core/ring.py) over the members that are up, and describes every hop
  with the interfaces and IPv4 addresses the data plane will use.

It is a pure function of the committed state, so every node derives the same graph; only
the leader proposes, and only when the ring's *identity* (order, links and addresses)
differs from the committed one. Measured RTTs are carried for display but never cause a new
epoch: an epoch change restarts the data-plane workers, which noise must not do. For the same
reason the ring solver sees a network path's kind defaults, never its measurement: Macs on
one switch all have the same path, and a solve on noisy figures would reorder their ring.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Generator
from dataclasses import dataclass

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import PATH_INTERFACE, ClusterState, Member, PortInfo, RingHop, SetRing
from p2pmesh.core.ring import KINDS, Link, Ring, RingError, solve_steps

NETWORK_KIND = "network"
"""A hop over whatever IP path the control plane uses (no known cable): the slowest kind."""
NOMINAL_GBPS = {"thunderbolt": 40.0, "ethernet": 1.0, "wifi": 0.5, NETWORK_KIND: 0.1}
"""Assumed speed when a port does not report one."""
NEGOTIATE_SLICE_STEPS = 500
"""The leader solves in its event loop, at most this many search steps per step of the
machine (a few milliseconds), so a long solve is spread over several steps and heartbeats
keep flowing (scripts/bench_ring.py measures the longest step). Up to 16 members the solve
is exact; above, ring.py's step cap applies, and a capped search still returns the same ring
on every node."""


@dataclass(frozen=True, slots=True)
class Cable:
    """One physical link between two members, as both ends published it."""

    a: NodeId
    b: NodeId
    kind: str
    gbps: float
    a_port: PortInfo | None
    b_port: PortInfo | None
    rtt_ms: float | None
    measured_gbps: float | None

    def end(self, node: NodeId) -> PortInfo | None:
        return self.a_port if node == self.a else self.b_port

    @property
    def planned_gbps(self) -> float:
        """The Gb/s the planner costs: the ports' speed for a cable (a probe's 1 MiB burst
        cannot tell 10 from 40 Gb/s), the measured rate for a network path (no port says its
        speed, and NOMINAL_GBPS's guess is 10-100x off on a LAN or loopback)."""
        if self.kind == NETWORK_KIND and self.measured_gbps is not None and self.measured_gbps > 0:
            return self.measured_gbps
        return self.gbps


def serving(state: ClusterState) -> list[Member]:
    """The members the data plane runs on: every member that is up."""
    return [m for m in state.members if m.up]


def cables(state: ClusterState, members: list[Member] | None = None) -> list[Cable]:
    """Every link between the given members (default: all), deterministic in order."""
    members = sorted(members if members is not None else list(state.members), key=lambda m: m.node_id)
    out = _thunderbolt_cables(members) + _lan_links(members)
    linked = {frozenset((c.a, c.b)) for c in out}
    for i, a in enumerate(members):
        for b in members[i + 1 :]:
            if frozenset((a.node_id, b.node_id)) not in linked:
                out.append(Cable(a.node_id, b.node_id, NETWORK_KIND, NOMINAL_GBPS[NETWORK_KIND], None, None, None, None))
    by_id = {m.node_id: m for m in members}
    return [_with_probes(c, by_id) for c in out]


def _thunderbolt_cables(members: list[Member]) -> list[Cable]:
    ends: list[tuple[NodeId, PortInfo]] = [
        (m.node_id, p)
        for m in members
        for p in sorted(m.ports, key=lambda p: p.interface)
        if p.kind == "thunderbolt" and p.up and p.domain_uuid and p.peer_domain_uuid
    ]
    used: set[int] = set()
    out = []
    for i, (a, pa) in enumerate(ends):
        if i in used:
            continue
        for j in range(i + 1, len(ends)):
            b, pb = ends[j]
            if j in used or b == a:
                continue
            if pa.peer_domain_uuid == pb.domain_uuid and pb.peer_domain_uuid == pa.domain_uuid:
                used.update((i, j))
                gbps = min(pa.gbps or NOMINAL_GBPS["thunderbolt"], pb.gbps or NOMINAL_GBPS["thunderbolt"])
                out.append(Cable(a, b, "thunderbolt", gbps, pa, pb, None, None))
                break
    return out


def _lan_links(members: list[Member]) -> list[Cable]:
    out = []
    for i, a in enumerate(members):
        for b in members[i + 1 :]:
            best: Cable | None = None
            for pa in a.ports:
                for pb in b.ports:
                    if pa.kind == pb.kind and pa.kind in ("ethernet", "wifi") and pa.up and pb.up:
                        if common_subnet(pa.ipv4, pb.ipv4) is not None:
                            gbps = min(pa.gbps or NOMINAL_GBPS[pa.kind], pb.gbps or NOMINAL_GBPS[pb.kind])
                            c = Cable(a.node_id, b.node_id, pa.kind, gbps, pa, pb, None, None)
                            if best is None or _lan_rank(c) < _lan_rank(best):
                                best = c
            if best is not None:
                out.append(best)
    return out


def _lan_rank(c: Cable) -> tuple[int, float, str, str]:
    assert c.a_port is not None and c.b_port is not None
    return (0 if c.kind == "ethernet" else 1, -c.gbps, c.a_port.interface, c.b_port.interface)


def _with_probes(c: Cable, by_id: dict[NodeId, Member]) -> Cable:
    """Attach the probe results either end measured over this cable, or over the transport
    path for a network link (the best of both). The cable's latency is the round trip of an
    activation-sized message where a probe measured one (what the data plane pays per hop
    and per all-reduce step), else of a ping."""
    pings: list[float] = []
    echoes: list[float] = []
    rates: list[float] = []
    for node, other in ((c.a, c.b), (c.b, c.a)):
        port = c.end(node)
        for probe in by_id[node].probes:
            if probe.peer == other and probe.interface == (port.interface if port is not None else PATH_INTERFACE):
                pings.append(probe.rtt_ms)
                echoes += [probe.echo_rtt_ms] if probe.echo_rtt_ms > 0 else []
                rates.append(probe.gbps)
    if not pings:
        return c
    return Cable(c.a, c.b, c.kind, c.gbps, c.a_port, c.b_port, min(echoes or pings), max(rates))


def common_subnet(left: tuple[str, ...], right: tuple[str, ...]) -> tuple[str, str] | None:
    """The first pair of addresses (bare, no prefix) that share a subnet, if any."""
    for x in left:
        for y in right:
            try:
                ix, iy = ipaddress.IPv4Interface(x), ipaddress.IPv4Interface(y)
            except ValueError:
                continue  # a malformed address published by a buggy peer: just not usable
            if ix.network == iy.network and ix.ip != iy.ip:
                return str(ix.ip), str(iy.ip)
    return None


RingPlan = tuple[tuple[NodeId, ...], tuple[RingHop, ...]]


def plan_inputs(state: ClusterState) -> tuple[tuple[object, ...], ...]:
    """Everything plan_ring reads: of each member that is up, its id, ports, probes and
    addresses. A leader keeps its plan while these stay the same (the solve is costly)."""
    return tuple((m.node_id, m.ports, m.probes, m.addresses) for m in state.members if m.up)


def plan_ring(state: ClusterState) -> RingPlan | None:
    """The ring order and hops over the members that are up (a function of plan_inputs
    alone), or None when there is none: plan_ring_steps run to its end."""
    steps = plan_ring_steps(state)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def plan_ring_steps(state: ClusterState) -> Generator[None, None, RingPlan | None]:
    """plan_ring in slices of NEGOTIATE_SLICE_STEPS search steps, yielding between them
    (the leader keeps the generator while plan_inputs stays the same, and advances it once
    per step of its machine, so a long solve never stalls its heartbeats)."""
    members = serving(state)
    if not members:
        return None
    links = cables(state, members)
    nodes = [m.node_id for m in members]
    try:
        ring = yield from solve_steps(nodes, [Link(c.a, c.b, c.kind, c.gbps, None if c.kind == NETWORK_KIND else c.rtt_ms)
                                              for c in links],
                                      slice_steps=NEGOTIATE_SLICE_STEPS)
    except RingError:
        return None  # cannot happen with network links; never propose nonsense
    return tuple(NodeId(n) for n in ring.order), _describe(ring, links, {m.node_id: m for m in members})


def negotiate(state: ClusterState, plan: RingPlan | None = None) -> SetRing | None:
    """The ring the leader should propose now, or None when the committed one is right.
    ``plan``: plan_ring(state), when the caller kept it for the same members."""
    if plan is None:
        plan = plan_ring(state)
    if plan is None:
        return None
    order, hops = plan
    if order == state.ring and _identity(hops) == _identity(state.ring_hops):
        return None
    return SetRing(state.ring_epoch + 1, order, hops)


def _identity(hops: tuple[RingHop, ...]) -> tuple[tuple[object, ...], ...]:
    return tuple((h.src, h.dst, h.kind, h.src_interface, h.dst_interface, h.src_ipv4, h.dst_ipv4, h.rdma) for h in hops)


def _describe(ring: Ring, links: list[Cable], by_id: dict[NodeId, Member]) -> tuple[RingHop, ...]:
    out = []
    for hop in ring.hops:
        described = describe_hop(NodeId(hop.src), NodeId(hop.dst), links, by_id, kind=hop.kind)
        assert described is not None  # the solver only uses hops that exist
        out.append(described)
    return tuple(out)


def describe_hop(
    src: NodeId, dst: NodeId, links: list[Cable], by_id: dict[NodeId, Member], *, kind: str | None = None
) -> RingHop | None:
    """The hop from src to dst over the best link between them (of ``kind`` when given):
    its interfaces, and the IPv4 pair the data plane uses on it (None when the ends share no
    subnet there; `p2pmesh links plan` fixes that)."""
    pair_links = [c for c in links if {c.a, c.b} == {src, dst}]
    if kind is None and pair_links:
        kind = min((c.kind for c in pair_links), key=KINDS.index)
    candidates = [c for c in pair_links if c.kind == kind]
    if not candidates:
        return None
    # Several cables of the best kind between one pair: the data plane uses the fastest
    # (ties: the lowest interface name), so every node names the same one.
    cable = min(candidates, key=lambda c: (-c.gbps, _port_name(c.end(src)), _port_name(c.end(dst))))
    sp, dp = cable.end(src), cable.end(dst)
    if sp is not None and dp is not None:
        pair = common_subnet(sp.ipv4, dp.ipv4)
    else:
        ends = (_first_ipv4(by_id[src]), _first_ipv4(by_id[dst]))
        pair = (ends[0], ends[1]) if ends[0] is not None and ends[1] is not None else None
    return RingHop(
        src=src,
        dst=dst,
        kind=cable.kind,
        gbps=cable.planned_gbps,
        rtt_ms=cable.rtt_ms,
        src_interface=sp.interface if sp else None,
        dst_interface=dp.interface if dp else None,
        src_ipv4=pair[0] if pair else None,
        dst_ipv4=pair[1] if pair else None,
        rdma=bool(sp and dp and sp.rdma and dp.rdma),
    )


def on_one_host(members: list[Member]) -> bool:
    """Whether two of these members are agents on one machine: joined by no cable, their
    first IPv4 transport addresses are loopback ones (127.0.0.0/8 reaches no other machine),
    so the path between them is this host's loopback, and they share its cores."""
    loopback = [m for m in members if (a := _first_ipv4(m)) is not None and ipaddress.IPv4Address(a).is_loopback]
    return len(loopback) >= 2


def _port_name(p: PortInfo | None) -> str:
    return p.interface if p is not None else ""


def _first_ipv4(m: Member) -> str | None:
    """The member's first IPv4 control-plane address (host part of "ip:port")."""
    for address in m.addresses:
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            continue
    return None
