"""The ring solver against brute force on generated cablings, plus the contract cases."""
from __future__ import annotations

import itertools
import random

import pytest

from p2pmesh.core.ring import DEFAULT_RTT_MS, KINDS, Link, RingError, parse_graph, solve


def _brute(nodes: list[str], links: list[Link]) -> tuple[tuple[int, float, int], tuple[str, ...]] | None:
    """The best objective (latency in whole 1e-9 ms) and, among the rings that reach it, the
    canonical smallest one."""
    pair: dict[frozenset[str], tuple[int, float, int]] = {}
    grouped: dict[frozenset[str], list[Link]] = {}
    for l in links:
        grouped.setdefault(frozenset((l.a, l.b)), []).append(l)
    for p, g in grouped.items():
        kind = min((l.kind for l in g), key=KINDS.index)
        same = [l for l in g if l.kind == kind]
        pair[p] = (0 if kind == "thunderbolt" else 1, sum(l.gbps for l in same),
                   round(min(l.rtt_ms if l.rtt_ms is not None else DEFAULT_RTT_MS[l.kind] for l in same) * 1e9))
    first, rest = sorted(nodes)[0], sorted(nodes)[1:]
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
    return best


def _graph(rng: random.Random, n: int, shape: str) -> list[Link]:
    nodes = [f"n{i}" for i in range(n)]
    links: list[Link] = []

    def add(a: str, b: str) -> None:
        kind = rng.choice(KINDS) if shape == "mixed" else "thunderbolt"
        links.append(Link(a, b, kind, float(rng.choice([10, 20, 40, 80])), rng.choice([None, rng.uniform(0.1, 2)])))

    if shape in ("square", "ring"):
        for i in range(n):
            add(nodes[i], nodes[(i + 1) % n])
    elif shape in ("mesh", "mixed"):
        for a, b in itertools.combinations(nodes, 2):
            if shape == "mesh" or rng.random() < 0.6:
                add(a, b)
    elif shape == "line":
        for i in range(n - 1):
            add(nodes[i], nodes[i + 1])
    elif shape == "star":
        for i in range(1, n):
            add(nodes[0], nodes[i])
    elif shape in ("islands", "network"):
        # What a cluster negotiates: a few Thunderbolt groups, and the slow "network" path
        # between every pair no cable joins (core/physical.py); "network" has no cables.
        if shape == "islands":
            for i in range(n - 1):
                if rng.random() < 0.6:
                    add(nodes[i], nodes[i + 1])
        joined = {frozenset((l.a, l.b)) for l in links}
        for a, b in itertools.combinations(nodes, 2):
            if frozenset((a, b)) not in joined:
                links.append(Link(a, b, "network", 0.1))
    elif shape == "multi":
        for i in range(n):
            add(nodes[i], nodes[(i + 1) % n])
            if rng.random() < 0.5:
                add(nodes[i], nodes[(i + 1) % n])  # a second cable between the same pair
        for _ in range(n):
            a, b = rng.sample(nodes, 2)
            add(a, b)
    return links


@pytest.mark.parametrize("shape", ["square", "ring", "mesh", "mixed", "line", "star", "multi", "islands", "network"])
def test_solver_matches_brute_force(shape: str) -> None:
    rng = random.Random(shape)
    for trial in range(40):
        n = rng.randint(3, 7)
        links = _graph(rng, n, shape)
        nodes = [f"n{i}" for i in range(n)]
        expected = _brute(nodes, links)
        if expected is None:
            with pytest.raises(RingError):
                solve(nodes, links)
            continue
        ring = solve(nodes, links)
        assert ring.exact
        got = (len(ring.slow_hops), -ring.bottleneck_gbps, sum(round(h.rtt_ms * 1e9) for h in ring.hops))
        assert (got, ring.order) == expected, (shape, trial, links)
        assert sorted(ring.order) == sorted(nodes) and ring.order[0] == min(nodes)


def test_same_graph_gives_the_same_ring_whatever_the_link_order() -> None:
    rng = random.Random(5)
    links = _graph(rng, 8, "mesh")
    nodes = [f"n{i}" for i in range(8)]
    first = solve(nodes, links)
    for _ in range(5):
        shuffled = links[:]
        rng.shuffle(shuffled)
        assert solve(list(reversed(nodes)), shuffled) == first


def test_a_full_thunderbolt_ring_is_preferred_and_slow_hops_are_named() -> None:
    nodes, links = parse_graph({
        "nodes": ["a", "b", "c", "d"],
        "links": [
            {"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 40},
            {"a": "b", "b": "c", "kind": "thunderbolt", "gbps": 40},
            {"a": "c", "b": "d", "kind": "thunderbolt", "gbps": 40},
            {"a": "d", "b": "a", "kind": "wifi", "gbps": 1},
            {"a": "a", "b": "c", "kind": "ethernet", "gbps": 10},
        ],
    })
    ring = solve(nodes, links)
    out = ring.to_json()
    assert out["bottleneck_gbps"] == 1.0
    assert out["ring"] == ["a", "b", "c", "d"]  # the only cycle through all four
    assert [(h["from"], h["to"], h["kind"]) for h in out["slow_hops"]] == [("d", "a", "wifi")]
    assert set(out) >= {"ring", "hops", "slow_hops", "bottleneck_gbps"}


def test_two_cables_between_a_pair_count_together() -> None:
    nodes, links = parse_graph({"nodes": ["a", "b"], "links": [
        {"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 40},
        {"a": "b", "b": "a", "kind": "thunderbolt", "gbps": 40},
    ]})
    assert solve(nodes, links).bottleneck_gbps == 80.0


@pytest.mark.parametrize(
    "graph, fragment",
    [
        ({"nodes": ["a", "b", "c"], "links": [{"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 40}]}, "'c' has no link"),
        ({"nodes": ["a", "b", "c"], "links": [{"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 40},
                                             {"a": "b", "b": "c", "kind": "thunderbolt", "gbps": 40}]}, "only one other node"),
        ({"nodes": "abc"}, "list of non-empty strings"),
        ({"nodes": ["a", "b"], "links": [{"a": "a", "b": "z", "kind": "thunderbolt", "gbps": 40}]}, "not both in"),
        ({"nodes": ["a", "b"], "links": [{"a": "a", "b": "b", "kind": "carrier-pigeon", "gbps": 1}]}, "kind"),
        ({"nodes": ["a", "b"], "links": [{"a": "a", "b": "b", "kind": "wifi", "gbps": -1}]}, "positive"),
    ],
)
def test_impossible_or_malformed_graphs_name_the_problem(graph: dict, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RingError, match=fragment):
        nodes, links = parse_graph(graph)
        solve(nodes, links)


def test_sixteen_sparse_nodes_solve_exactly_and_fast() -> None:
    rng = random.Random(16)
    nodes = [f"m{i:02d}" for i in range(16)]
    links = [Link(nodes[i], nodes[(i + 1) % 16], "thunderbolt", 40.0, rng.uniform(0.1, 0.5)) for i in range(16)]
    for _ in range(24):
        a, b = rng.sample(nodes, 2)
        links.append(Link(a, b, rng.choice(KINDS), float(rng.choice([10, 40, 80])), rng.uniform(0.1, 1)))
    ring = solve(nodes, links)
    assert ring.exact and not ring.slow_hops and len(ring.order) == 16


def test_the_cli_solves_and_refuses_with_clear_exit_codes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    good = tmp_path / "g.json"
    good.write_text(json.dumps({"nodes": ["a", "b", "c"], "links": [
        {"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 40},
        {"a": "b", "b": "c", "kind": "thunderbolt", "gbps": 40},
        {"a": "c", "b": "a", "kind": "wifi", "gbps": 1, "rtt_ms": 4},
    ]}))
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "ring", "solve", str(good), "--json"], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ring"] == ["a", "b", "c"] and out["bottleneck_gbps"] == 1.0 and len(out["slow_hops"]) == 1
    lonely = tmp_path / "l.json"
    lonely.write_text(json.dumps({"nodes": ["a", "b", "z"], "links": [{"a": "a", "b": "b", "kind": "wifi", "gbps": 1}]}))
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "ring", "solve", str(lonely), "--json"], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "'z'" in r.stderr
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "ring", "solve", str(bad)], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not JSON" in r.stderr


@pytest.mark.parametrize("layout", ["none", "line", "pairs", "triples", "two-lines"])
def test_sixteen_node_cluster_graphs_with_network_paths_solve_exactly(layout: str) -> None:
    """The graphs a cluster negotiates: Thunderbolt groups plus a slow path between every
    other pair. The bounds must keep these exact (the leader solves them in its loop)."""
    n = 16
    nodes = [f"n{i:02d}" for i in range(n)]
    keep = {
        "none": lambda i: False,
        "line": lambda i: True,
        "pairs": lambda i: i % 2 == 0,
        "triples": lambda i: i % 3 != 2,
        "two-lines": lambda i: i != 7,
    }[layout]
    links = [Link(nodes[i], nodes[i + 1], "thunderbolt", 40.0) for i in range(n - 1) if keep(i)]
    joined = {frozenset((l.a, l.b)) for l in links}
    links += [Link(a, b, "network", 0.1) for a, b in itertools.combinations(nodes, 2) if frozenset((a, b)) not in joined]
    ring = solve(nodes, links)
    assert ring.exact
    groups = n - len([l for l in links if l.kind == "thunderbolt"])  # the cables form a forest
    assert len(ring.slow_hops) == max(1, groups)  # one slow hop between consecutive groups


@pytest.mark.parametrize("link", [
    {"a": ["x"], "b": "n1", "kind": "thunderbolt", "gbps": 40},
    {"a": "n0", "b": "n1", "kind": "thunderbolt", "gbps": float("inf")},
    {"a": "n0", "b": "n1", "kind": "thunderbolt", "gbps": 40, "rtt_ms": float("nan")},
])
def test_non_string_ends_and_non_finite_numbers_are_refused(link: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(RingError):
        parse_graph({"nodes": ["n0", "n1"], "links": [link]})


def test_a_kept_ring_plan_depends_only_on_what_plan_ring_reads() -> None:
    # A leader keeps plan_ring's result while plan_inputs stays the same (core/machine.py):
    # the fields left out must not change the plan, and a new Member field must be judged.
    import dataclasses

    from p2pmesh.core.messages import Capabilities, ClusterState, Measure, Member, PortInfo
    from p2pmesh.core.physical import plan_inputs, plan_ring

    ignored = {"inc", "voter", "caps", "measure"}
    read = {"node_id", "up", "addresses", "ports", "probes"}
    assert {f.name for f in dataclasses.fields(Member)} == ignored | read
    tb = [PortInfo(f"en{i}", "thunderbolt", f"d{i}", f"d{(i + 1) % 4}", True, 40.0, (), False) for i in range(4)]
    members = tuple(Member(f"{i:032x}", 1, True, True, (f"10.0.0.{i + 1}",), Capabilities(2**35, "M4 Max"), ports=(tb[i],))
                    for i in range(4))
    state = ClusterState("c1", members, 0, (), ())
    other = dataclasses.replace(state, members=tuple(
        dataclasses.replace(m, inc=7, voter=False, caps=Capabilities(2**30, "M2 Max"), measure=Measure("m", 1, 1.0))
        for m in members))
    assert plan_inputs(other) == plan_inputs(state) and plan_ring(other) == plan_ring(state)
    assert plan_ring(state) is not None
    moved = dataclasses.replace(state, members=(dataclasses.replace(members[0], addresses=("10.9.9.9",)), *members[1:]))
    assert plan_inputs(moved) != plan_inputs(state)


def test_a_cable_costs_the_echo_round_trip_where_the_probe_measured_one() -> None:
    # The data plane sends activations, not 8-byte pings: the probe's activation-sized echo
    # is the cable's latency when either end measured it (drivers/probe.py, version 2).
    from p2pmesh.core.messages import Capabilities, ClusterState, LinkProbe, Member, PortInfo
    from p2pmesh.core.physical import cables

    a, b = f"{1:032x}", f"{2:032x}"
    tb = [PortInfo("en1", "thunderbolt", "da", "db", True, 40.0, (), False),
          PortInfo("en2", "thunderbolt", "db", "da", True, 40.0, (), False)]

    def rtt(probe_a: LinkProbe, probe_b: LinkProbe) -> float | None:
        ma = Member(a, 1, True, True, ("10.0.0.1",), Capabilities(2**35, "M4 Max"), ports=(tb[0],), probes=(probe_a,))
        mb = Member(b, 1, True, True, ("10.0.0.2",), Capabilities(2**35, "M4 Max"), ports=(tb[1],), probes=(probe_b,))
        (cable,) = [c for c in cables(ClusterState("c1", (ma, mb), 0, (), ())) if c.kind == "thunderbolt"]
        return cable.rtt_ms

    assert rtt(LinkProbe("en1", b, 0.05, 20.0, 0.4), LinkProbe("en2", a, 0.06, 20.0, 0.3)) == 0.3
    # An older peer does not echo: the other end's echo still says what an activation costs.
    assert rtt(LinkProbe("en1", b, 0.05, 20.0, 0.4), LinkProbe("en2", a, 0.06, 20.0)) == 0.4
    assert rtt(LinkProbe("en1", b, 0.05, 20.0), LinkProbe("en2", a, 0.06, 20.0)) == 0.05
