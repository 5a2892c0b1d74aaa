"""Seeded cablings of the shape real clusters have, for the ring solver's tests and benchmark.

``lan_cluster``: N Macs (16 by default), each with up to ``ports`` Thunderbolt cables to
others (a random number of ports used per Mac, sometimes two cables between one pair), and
every Mac on one 10 GbE LAN: a full mesh of Ethernet links. Thunderbolt hops carry a probed
RTT or none (the 0.2 ms default); Ethernet hops have no RTT, as in a cluster, where only
Thunderbolt cables are probed (core/physical.py), unless ``lan_rtt`` draws one per pair
(a harder latency level). Many of these have no all-Thunderbolt ring, which is the case
that used to take seconds (issue 13).
"""
from __future__ import annotations

import itertools
import random

from p2pmesh.core.ring import Link

LAN_GBPS = 10.0
TB_GBPS = (40.0, 80.0)


def lan_cluster(seed: int, *, nodes: int = 16, ports: int = 5, lan_rtt: bool = False) -> tuple[list[str], list[Link]]:
    rng = random.Random(seed)
    names = [f"m{i:02d}" for i in range(nodes)]
    free = {n: rng.randint(1, ports) for n in names}
    pairs = list(itertools.combinations(names, 2))
    rng.shuffle(pairs)
    want = rng.randint(nodes // 2, nodes * ports // 2)
    links: list[Link] = []
    for a, b in pairs * 2:  # a second round may add a second cable between a pair
        if len(links) >= want:
            break
        if free[a] and free[b] and rng.random() < 0.5:
            free[a] -= 1
            free[b] -= 1
            links.append(Link(a, b, "thunderbolt", rng.choice(TB_GBPS), rng.choice([None, rng.uniform(0.1, 0.5)])))
    links += [Link(a, b, "ethernet", LAN_GBPS, rng.uniform(0.3, 1.0) if lan_rtt else None)
              for a, b in itertools.combinations(names, 2)]
    return names, links
