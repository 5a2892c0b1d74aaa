"""The virtual network: per-message latency, loss, duplication and reordering, plus the
faults that cut links: partitions (symmetric or one-way), and cables unplugged.

``deliveries()`` turns one send into zero, one or two (duplicated) arrival delays, drawn
from the world's seeded generator. Reordering comes from jitter: two messages on one link
may arrive in either order. Latencies are in microseconds.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from p2pmesh.core.ids import NodeId


@dataclass(frozen=True, slots=True)
class LinkProfile:
    latency_us_min: int = 100
    latency_us_max: int = 1_000
    loss: float = 0.0
    duplicate: float = 0.0


class Network:
    def __init__(self, rng: random.Random, profile: LinkProfile) -> None:
        self.rng = rng
        self.profile = profile
        self.blocked: dict[tuple[NodeId, NodeId], int] = {}
        """Directed pairs that cannot deliver, with how many active faults cut each one
        (overlapping partitions and unplugged cables heal independently)."""
        self.loss_override: float | None = None

    def reachable(self, src: NodeId, dst: NodeId) -> bool:
        return (src, dst) not in self.blocked

    def deliveries(self, src: NodeId, dst: NodeId) -> list[int]:
        if (src, dst) in self.blocked:
            return []
        p = self.profile
        rng = self.rng
        loss = p.loss if self.loss_override is None else self.loss_override
        if loss and rng.random() < loss:
            return []
        # randrange(a, b + 1) is what randint(a, b) calls (documented as its alias): the same
        # draws, one call less on the world's hottest path.
        delay = rng.randrange(p.latency_us_min, p.latency_us_max + 1)
        if p.duplicate and rng.random() < p.duplicate:
            return [delay, rng.randrange(p.latency_us_min, p.latency_us_max * 3 + 1)]
        return [delay]

    # --- faults ------------------------------------------------------------------
    def cut(self, a: NodeId, b: NodeId, *, both_ways: bool = True) -> list[tuple[NodeId, NodeId]]:
        pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
        for pair in pairs:
            self.blocked[pair] = self.blocked.get(pair, 0) + 1
        return pairs

    def mend(self, pairs: list[tuple[NodeId, NodeId]]) -> None:
        for pair in pairs:
            left = self.blocked.get(pair, 0) - 1
            if left > 0:
                self.blocked[pair] = left
            else:
                self.blocked.pop(pair, None)

    def partition(self, groups: list[list[NodeId]]) -> list[tuple[NodeId, NodeId]]:
        pairs: list[tuple[NodeId, NodeId]] = []
        for i, ga in enumerate(groups):
            for gb in groups[i + 1 :]:
                for a in ga:
                    for b in gb:
                        pairs += self.cut(a, b)
        return pairs

    def heal(self) -> None:
        self.blocked.clear()
        self.loss_override = None
