"""The committed ring as JSON: the `ring` object of `p2pmesh status --json` (drawn for
people by p2pmesh/cli/terminal.py). Pure: the agent builds its status from it.

The JSON is built from the committed cluster state only, with each hop's measured RTT taken
from the latest probe results the two ends published (the ring itself does not change when
a measurement does; see core/physical.py). A "network" hop (no known cable: the agents'
transport path) shows its measured Gb/s too, the figure the planner costs it at.
"""
from __future__ import annotations

from typing import Any

from p2pmesh.core.messages import PATH_INTERFACE, ClusterState, LinkProbe, RingHop
from p2pmesh.core.physical import NETWORK_KIND


def ring_json(state: ClusterState) -> dict[str, Any]:
    """The `ring` object: epoch, order (node ids in ring order), hops, slow hops."""
    hops = [_hop_json(h, state) for h in state.ring_hops]
    return {
        "epoch": state.ring_epoch,
        "order": list(state.ring),
        "hops": hops,
        "slow_hops": [h for h in hops if h["kind"] != "thunderbolt"],
        "bottleneck_gbps": min((h["gbps"] for h in hops), default=None),
    }


def _hop_json(h: RingHop, state: ClusterState) -> dict[str, Any]:
    probes = _probes(h, state)
    rates = [p.gbps for p in probes if p.gbps > 0]
    echoes = [p.echo_rtt_ms for p in probes if p.echo_rtt_ms > 0]
    return {
        "from": h.src,
        "to": h.dst,
        "kind": h.kind,
        "gbps": max(rates) if rates and h.kind == NETWORK_KIND else h.gbps,
        "rtt_ms": round(min(p.rtt_ms for p in probes), 3) if probes else h.rtt_ms,
        # The round trip of an activation-sized echo: what the planner costs a hop and an
        # all-reduce step at (core/physical.py), None where no probe echoed.
        "echo_rtt_ms": round(min(echoes), 3) if echoes else None,
        "from_interface": h.src_interface,
        "to_interface": h.dst_interface,
        "from_ipv4": h.src_ipv4,
        "to_ipv4": h.dst_ipv4,
        "rdma": h.rdma,
    }


def _probes(h: RingHop, state: ClusterState) -> list[LinkProbe]:
    """The latest probes either end published over this hop's link (a network hop has no
    interface: its probes went over the transport path, PATH_INTERFACE)."""
    src_if = h.src_interface if h.src_interface is not None else PATH_INTERFACE
    dst_if = h.dst_interface if h.dst_interface is not None else PATH_INTERFACE
    return [p for m in state.members for p in m.probes
            if (m.node_id, p.peer, p.interface) in ((h.src, h.dst, src_if), (h.dst, h.src, dst_if))]
