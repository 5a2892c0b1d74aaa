"""Virtual Thunderbolt cabling: which port of which simulated Mac is cabled to which.

Each simulated Mac has ``PORTS_PER_NODE`` Thunderbolt ports, each with its own domain UUID
(as on Apple silicon, where every receptacle is its own bus). Plugging a cable tells both
ends' machines their new ports (PortsObserved), exactly what the agent's link watcher
does, so the leader's ring negotiation runs on the same inputs as on real Macs. The
control-plane network is separate (sim/network.py: everyone is on one LAN), just like the
namespace bench where the hosts share an Ethernet switch and the veths are the cables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from p2pmesh.core.messages import PortInfo

PORTS_PER_NODE = 4
TB_GBPS = 40.0


@dataclass(frozen=True, slots=True)
class SimCable:
    a: int
    port_a: int
    b: int
    port_b: int


def domain_uuid(node: int, port: int) -> str:
    return f"00000000-0000-0000-{node:04x}-{port:012x}"


@dataclass
class Cabling:
    cables: list[SimCable] = field(default_factory=list)

    def plug(self, a: int, b: int) -> SimCable:
        """Cable node a to node b on the first free port of each."""
        cable = SimCable(a, self._free_port(a), b, self._free_port(b))
        self.cables.append(cable)
        return cable

    def unplug(self, cable: SimCable) -> None:
        self.cables.remove(cable)

    def between(self, a: int, b: int) -> SimCable | None:
        for c in self.cables:
            if {c.a, c.b} == {a, b}:
                return c
        return None

    def _free_port(self, node: int) -> int:
        used = {c.port_a for c in self.cables if c.a == node} | {c.port_b for c in self.cables if c.b == node}
        for port in range(PORTS_PER_NODE):
            if port not in used:
                return port
        raise ValueError(f"node {node} has no free Thunderbolt port (it has {PORTS_PER_NODE})")

    def ports_of(self, node: int) -> tuple[PortInfo, ...]:
        """What the node's link watcher would see: every port, cabled or not."""
        peer: dict[int, str] = {}
        for c in self.cables:
            if c.a == node:
                peer[c.port_a] = domain_uuid(c.b, c.port_b)
            if c.b == node:
                peer[c.port_b] = domain_uuid(c.a, c.port_a)
        return tuple(
            PortInfo(
                interface=f"en{port + 2}",
                kind="thunderbolt",
                domain_uuid=domain_uuid(node, port),
                peer_domain_uuid=peer.get(port),
                up=port in peer,
                gbps=TB_GBPS if port in peer else None,
                ipv4=(),
                rdma=False,
            )
            for port in range(PORTS_PER_NODE)
        )
