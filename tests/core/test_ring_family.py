"""The ring solver is exact on the cablings real clusters have (sim/ring_graphs.py): Macs with
up to 5 Thunderbolt cables each, all on one 10 GbE LAN. Small ones are checked against brute
force (objective and tie-break), 16-Mac ones against an independent Held-Karp dynamic
program over node subsets (objective). Timings are the benchmark's (scripts/bench_ring.py)."""
from __future__ import annotations

import itertools

import pytest

from p2pmesh.core.ring import DEFAULT_RTT_MS, KINDS, Link, Ring, solve, solve_steps
from sim.ring_graphs import lan_cluster

Value = tuple[int, float, int]


def _pairs(links: list[Link]) -> dict[frozenset[str], tuple[int, float, int]]:
    """Per pair: (slow, Gb/s, RTT in 1e-9 ms) of its best kind, as docs/ring.md defines."""
    grouped: dict[frozenset[str], list[Link]] = {}
    for l in links:
        grouped.setdefault(frozenset((l.a, l.b)), []).append(l)
    out = {}
    for p, g in grouped.items():
        kind = min((l.kind for l in g), key=KINDS.index)
        same = [l for l in g if l.kind == kind]
        rtt = min(l.rtt_ms if l.rtt_ms is not None else DEFAULT_RTT_MS[l.kind] for l in same)
        out[p] = (0 if kind == "thunderbolt" else 1, sum(l.gbps for l in same), round(rtt * 1e9))
    return out


def _value(ring: Ring) -> Value:
    return len(ring.slow_hops), ring.bottleneck_gbps, sum(round(h.rtt_ms * 1e9) for h in ring.hops)


def _brute(nodes: list[str], links: list[Link]) -> tuple[tuple[int, float, int], tuple[str, ...]]:
    pair = _pairs(links)
    first, *rest = sorted(nodes)
    best = None
    for perm in itertools.permutations(rest):
        cyc = [first, *perm]
        hops = [pair.get(frozenset((cyc[i], cyc[(i + 1) % len(cyc)]))) for i in range(len(cyc))]
        if any(h is None for h in hops):
            continue
        key = (sum(h[0] for h in hops), -min(h[1] for h in hops), sum(h[2] for h in hops))  # type: ignore[index]
        canonical = min(tuple(cyc), (cyc[0], *reversed(cyc[1:])))
        if best is None or (key, canonical) < best:
            best = (key, canonical)
    assert best is not None
    return best


def _held_karp(nodes: list[str], links: list[Link]) -> Value:
    """The best (slow hops, bottleneck, latency) by dynamic programming over node subsets:
    for every (subset visited, last node), the non-dominated (slow, bottleneck) pairs with
    the least latency of a path from the first node. Independent of the solver's search."""
    order = sorted(nodes)
    n = len(order)
    pair = _pairs(links)
    hop = [[pair.get(frozenset((order[i], order[j]))) if i != j else None for j in range(n)] for i in range(n)]
    layer: dict[tuple[int, int], dict[tuple[int, float], int]] = {(1, 0): {(0, float("inf")): 0}}
    for _ in range(n - 1):
        nxt: dict[tuple[int, int], dict[tuple[int, float], int]] = {}
        for (mask, v), costs in layer.items():
            for j in range(n):
                h = hop[v][j]
                if h is None or mask >> j & 1:
                    continue
                out = nxt.setdefault((mask | 1 << j, j), {})
                for (s, bn), lat in costs.items():
                    k = (s + h[0], min(bn, h[1]))
                    if out.get(k, lat + h[2] + 1) > lat + h[2]:
                        out[k] = lat + h[2]
        for costs in nxt.values():  # keep what no other entry beats on every component
            items = list(costs.items())
            for k, lat in items:
                if any(o != k and o[0] <= k[0] and o[1] >= k[1] and ol <= lat for o, ol in items):
                    del costs[k]
        layer = nxt
    best: tuple[int, float, int] | None = None
    for (mask, v), costs in layer.items():
        back = hop[v][0]
        if back is None:
            continue
        for (s, bn), lat in costs.items():
            cand = (s + back[0], -min(bn, back[1]), lat + back[2])
            best = cand if best is None or cand < best else best
    assert best is not None
    return best[0], -best[1], best[2]


@pytest.mark.parametrize("lan_rtt", [False, True])
def test_small_lan_clusters_match_brute_force(lan_rtt: bool) -> None:
    for seed in range(60):
        n = 4 + seed % 5
        nodes, links = lan_cluster(seed, nodes=n, lan_rtt=lan_rtt)
        (slow, neg_bn, lat), order = _brute(nodes, links)
        ring = solve(nodes, links)
        assert ring.exact
        assert (_value(ring), ring.order) == ((slow, -neg_bn, lat), order), (seed, n)


@pytest.mark.slow
@pytest.mark.parametrize("seed, lan_rtt", [(9, False), (29, False), (56, False), (29, True)])
def test_sixteen_mac_lan_clusters_are_exact(seed: int, lan_rtt: bool) -> None:
    """Seeds whose cables close no Thunderbolt ring (3 to 7 slow hops): the slow ones."""
    nodes, links = lan_cluster(seed, lan_rtt=lan_rtt)
    ring = solve(nodes, links)
    assert ring.exact and len(ring.order) == 16
    pair = _pairs(links)
    assert all(pair[frozenset((h.src, h.dst))][0] == (h.kind != "thunderbolt") for h in ring.hops)
    assert _value(ring) == _held_karp(nodes, links)
    assert len(ring.slow_hops) > 0  # what makes these the hard case


def test_a_solve_in_slices_gives_the_same_ring() -> None:
    nodes, links = lan_cluster(29)
    steps = solve_steps(nodes, links, slice_steps=200)
    slices = 0
    while True:
        try:
            next(steps)
            slices += 1
        except StopIteration as done:
            ring = done.value
            break
    assert slices > 1 and ring == solve(nodes, links)


def test_a_mac_cabled_to_every_other_solves_exactly() -> None:
    """A star: the hub uses two of its fifteen cables, so the best ring has 14 slow hops
    (the bound that knows this keeps the search short; it used to run out of steps)."""
    nodes = [f"m{i:02d}" for i in range(16)]
    links = [Link("m00", n, "thunderbolt", 40.0) for n in nodes[1:]]
    links += [Link(a, b, "ethernet", 10.0) for a, b in itertools.combinations(nodes[1:], 2)]
    ring = solve(nodes, links)
    assert ring.exact and len(ring.slow_hops) == 14
    assert [h.kind for h in ring.hops][0] == "thunderbolt" and [h.kind for h in ring.hops][-1] == "thunderbolt"
    assert ring.order == tuple(nodes)  # the canonical smallest list among the equal rings


def _one_lan(seed: int) -> tuple[list[str], list[Link]]:
    """A few Macs, random cables (sometimes a full Thunderbolt ring, sometimes a path), RTTs
    drawn from a few values so rings tie, and every Mac on one LAN of one speed and RTT."""
    import random

    rng = random.Random(seed)
    n = 4 + seed % 5
    nodes = [f"m{i}" for i in range(n)]
    links: list[Link] = []
    shape = seed % 3
    if shape == 0:  # a Thunderbolt ring plus chords: the general search must win
        order = nodes[:]
        rng.shuffle(order)
        links += [Link(order[i], order[(i + 1) % n], "thunderbolt", 40.0) for i in range(n)]
    elif shape == 1:  # a Thunderbolt path through every Mac: one slow hop, or none
        order = nodes[:]
        rng.shuffle(order)
        links += [Link(order[i], order[i + 1], "thunderbolt", 40.0) for i in range(n - 1)]
    for a, b in itertools.combinations(nodes, 2):
        if rng.random() < 0.3:
            links.append(Link(a, b, "thunderbolt", rng.choice([40.0, 80.0]), rng.choice([None, 0.1, 0.3])))
    kind = rng.choice(["ethernet", "wifi", "network"])
    rtt = rng.choice([None, 0.4, 1.0])
    links += [Link(a, b, kind, rng.choice([1.0, 10.0]) if seed % 2 else 10.0, rtt) for a, b in itertools.combinations(nodes, 2)]
    if seed % 2:  # one LAN speed per graph, so that the slow hops are all alike
        speed = links[-1].gbps
        links = [l if l.kind == "thunderbolt" else Link(l.a, l.b, l.kind, speed, l.rtt_ms) for l in links]
    return nodes, links


def test_one_lan_graphs_match_brute_force() -> None:
    """The segment search (every slow hop alike: the segments' order does not matter) finds
    the brute-force ring and value, with and without a Thunderbolt ring."""
    for seed in range(150):
        nodes, links = _one_lan(seed)
        (slow, neg_bn, lat), order = _brute(nodes, links)
        ring = solve(nodes, links)
        assert ring.exact
        assert (_value(ring), ring.order) == ((slow, -neg_bn, lat), order), seed
