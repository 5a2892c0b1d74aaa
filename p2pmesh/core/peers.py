"""The Macs this node has heard of (discovery and their Hellos), and the cluster ranking
that formation and merging use (core/machine.py's module comment has the rules).

The book is bounded (``peers_known_max``); a Hello is fresh for ``peer_silent_ms``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import Hello, Peer


@dataclass(slots=True)
class PeerInfo:
    addresses: tuple[str, ...]
    hello: Hello | None = None
    hello_ms: int = -1
    mate: Peer | None = None
    """The incarnation last seen speaking Raft in our cluster (so no Hello is needed)."""
    replied_ms: int = -(10**9)
    """When we last greeted it (answers to outsiders are at most one per hello period)."""


def rank(members: int, cluster: ClusterId) -> tuple[int, str]:
    """Larger clusters win; between equals the lower id wins (negated by inverting chars)."""
    return (members, "".join(chr(0x10FFFF - ord(c)) for c in cluster))


class PeerBook:
    """Known peers by node id, at most ``known_max`` of them."""

    def __init__(self, known_max: int, silent_ms: int) -> None:
        self.known_max = known_max
        self.silent_ms = silent_ms
        self._peers: dict[NodeId, PeerInfo] = {}

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def items(self) -> Iterator[tuple[NodeId, PeerInfo]]:
        return iter(self._peers.items())

    def get(self, node_id: NodeId) -> PeerInfo | None:
        return self._peers.get(node_id)

    def forget(self, node_id: NodeId) -> None:
        self._peers.pop(node_id, None)

    def learn(self, node_id: NodeId, addresses: tuple[str, ...]) -> PeerInfo | None:
        """The peer's entry, added when there is room (None when the book is full)."""
        info = self._peers.get(node_id)
        if info is None:
            if len(self._peers) >= self.known_max:
                return None
            info = self._peers[node_id] = PeerInfo(addresses)
        return info

    def fresh_hellos(self, now_ms: int) -> list[Hello]:
        horizon = now_ms - self.silent_ms
        return [p.hello for p in self._peers.values() if p.hello is not None and p.hello_ms >= horizon]

    def best_foreign_cluster(self, mine: ClusterId | None, now_ms: int) -> Hello | None:
        """The highest-ranked healthy cluster other than ``mine`` that a fresh Hello names."""
        best: Hello | None = None
        for h in self.fresh_hellos(now_ms):
            if h.cluster is None or not h.healthy or h.cluster == mine or h.members == 0:
                continue
            if best is None or rank(h.members, h.cluster) > rank(best.members, best.cluster):  # type: ignore[arg-type]
                best = h
        return best

    def lowest_unformed(self, node_id: NodeId, now_ms: int) -> bool:
        """No unformed peer with a fresh Hello has a lower node id than ``node_id``."""
        return all(h.src > node_id for h in self.fresh_hellos(now_ms) if h.cluster is None)
