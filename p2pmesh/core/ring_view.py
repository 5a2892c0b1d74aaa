"""The committed ring as JSON: the `ring` object of `p2pmesh status --json` (drawn for
people by p2pmesh/cli/terminal.py). Pure: the agent builds its status from it.

The JSON is built from the committed cluster state only, with each hop's measured RTT taken
from the latest probe results the two ends published (the ring itself does not change when
a measurement does; see core/physical.py).
"""
from __future__ import annotations

from typing import Any

from p2pmesh.core.messages import ClusterState, RingHop


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
    return {
        "from": h.src,
        "to": h.dst,
        "kind": h.kind,
        "gbps": h.gbps,
        "rtt_ms": _measured_rtt(h, state),
        "from_interface": h.src_interface,
        "to_interface": h.dst_interface,
        "from_ipv4": h.src_ipv4,
        "to_ipv4": h.dst_ipv4,
        "rdma": h.rdma,
    }


def _measured_rtt(h: RingHop, state: ClusterState) -> float | None:
    rtts = []
    for m in state.members:
        for p in m.probes:
            if (m.node_id, p.peer, p.interface) in ((h.src, h.dst, h.src_interface), (h.dst, h.src, h.dst_interface)):
                rtts.append(p.rtt_ms)
    return round(min(rtts), 3) if rtts else h.rtt_ms
