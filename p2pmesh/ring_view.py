"""How the committed ring is shown: the `ring` object of `p2pmesh status --json`, and the
terminal drawing of `p2pmesh ring` and `p2pmesh status`.

The JSON is built from the committed cluster state only, with each hop's measured RTT taken
from the latest probe results the two ends published (the ring itself does not change when
a measurement does; see core/physical.py).
"""
from __future__ import annotations

from typing import Any

from p2pmesh.core.messages import ClusterState, RingHop

SHORT_ID = 8


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


def draw(ring: dict[str, Any], me: str | None = None) -> str:
    """A few lines of text: the ring as a cycle of nodes joined by their cables."""
    order: list[str] = ring.get("order") or []
    if not order:
        return "ring: none committed yet"
    lines = [f"ring epoch {ring['epoch']}: {len(order)} node{'s' if len(order) != 1 else ''}"]
    if len(order) == 1:
        lines.append(f"  {_name(order[0], me)} (alone: no data-plane hops)")
        return "\n".join(lines)
    for h in ring.get("hops", []):
        cable = "====" if h["kind"] == "thunderbolt" else "----"
        rtt = f", {h['rtt_ms']:g} ms" if h.get("rtt_ms") is not None else ""
        via = f" [{h['from_interface']} -> {h['to_interface']}]" if h.get("from_interface") else ""
        slow = "   <- slow hop" if h["kind"] != "thunderbolt" else ""
        lines.append(f"  {_name(h['from'], me)} {cable}{cable} {_name(h['to'], me)}  {h['kind']} {h['gbps']:g} Gb/s{rtt}{via}{slow}")
    lines.append(f"  back to {_name(order[0], me)}; bottleneck {ring.get('bottleneck_gbps') or 0:g} Gb/s")
    return "\n".join(lines)


def _name(node: str, me: str | None) -> str:
    return node[:SHORT_ID] + (" (this Mac)" if node == me else "")
