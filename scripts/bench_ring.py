#!/usr/bin/env python3
"""Ring solver timing at 16 nodes.

    .venv/bin/python scripts/bench_ring.py [--graphs 50]

Generated cablings of 16 Macs: a Thunderbolt ring in random order plus 8, 16 or 32 random
extra links of mixed kinds (a Mac has a handful of ports, so real graphs are sparse), and a
dense case (a random Ethernet/Wi-Fi link between most pairs), and the graphs a cluster
itself negotiates (core/physical.py): random Thunderbolt cables with no full ring (islands,
lines) plus a slow "network" path between every pair no cable joins. Baseline in the same
run: the same solver on the bare 16-node ring (the least work possible).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pmesh.core.ring import KINDS, Link, solve  # noqa: E402


def graph(rng: random.Random, extra: int, dense: bool) -> tuple[list[str], list[Link]]:
    nodes = [f"m{i:02d}" for i in range(16)]
    order = nodes[:]
    rng.shuffle(order)
    links = [Link(order[i], order[(i + 1) % 16], "thunderbolt", float(rng.choice([40, 80, 120])), rng.uniform(0.1, 0.5)) for i in range(16)]
    if dense:
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                if rng.random() < 0.8:
                    links.append(Link(a, b, rng.choice(KINDS[1:]), float(rng.choice([1, 10])), rng.uniform(0.5, 5)))
    else:
        for _ in range(extra):
            a, b = rng.sample(nodes, 2)
            links.append(Link(a, b, rng.choice(KINDS), float(rng.choice([10, 40, 80])), rng.uniform(0.1, 1)))
    return nodes, links


def cluster_graph(rng: random.Random) -> tuple[list[str], list[Link]]:
    nodes = [f"m{i:02d}" for i in range(16)]
    order = nodes[:]
    rng.shuffle(order)
    links = [Link(order[i], order[i + 1], "thunderbolt", 40.0, rng.uniform(0.1, 0.5)) for i in range(15) if rng.random() < 0.6]
    joined = {frozenset((l.a, l.b)) for l in links}
    links += [Link(a, b, "network", 0.1) for i, a in enumerate(nodes) for b in nodes[i + 1 :] if frozenset((a, b)) not in joined]
    return nodes, links


def timed(nodes: list[str], links: list[Link]) -> tuple[float, bool]:
    t = time.perf_counter()
    ring = solve(nodes, links)
    return (time.perf_counter() - t) * 1000, ring.exact


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--graphs", type=int, default=50)
    p.add_argument("--json", default=None, help="also write the raw figures as JSON to this file (for scripts/bench.py)")
    args = p.parse_args()
    rng = random.Random(2026)
    base = statistics.median(timed(*graph(rng, 0, False))[0] for _ in range(args.graphs))
    raw: dict = {"graphs": args.graphs, "bare_ring_median_ms": base, "rows": []}
    print("| 16 nodes | median ms | max ms | exact | ratio to bare ring |")
    print("|---|---|---|---|---|")
    print(f"| bare Thunderbolt ring (baseline) | {base:.2f} | | | 1.0 |")
    for label, extra, dense in (("+8 links", 8, False), ("+16 links", 16, False), ("+32 links", 32, False), ("dense Ethernet/Wi-Fi mesh", 0, True)):
        runs = [timed(*graph(rng, extra, dense)) for _ in range(args.graphs)]
        ms = [r[0] for r in runs]
        exact = sum(1 for r in runs if r[1])
        print(f"| {label} | {statistics.median(ms):.2f} | {max(ms):.1f} | {exact}/{len(runs)} | {statistics.median(ms) / base:.1f} |")
        raw["rows"].append({"label": label, "median_ms": statistics.median(ms), "max_ms": max(ms), "exact": exact, "graphs": len(runs)})
    runs = [timed(*cluster_graph(rng)) for _ in range(args.graphs)]
    ms = [r[0] for r in runs]
    exact = sum(1 for r in runs if r[1])
    print(f"| cluster graph: Thunderbolt islands + network paths | {statistics.median(ms):.2f} | {max(ms):.1f} | {exact}/{len(runs)} | {statistics.median(ms) / base:.1f} |")
    raw["rows"].append({"label": "cluster graph: Thunderbolt islands + network paths", "median_ms": statistics.median(ms), "max_ms": max(ms),
                        "exact": exact, "graphs": len(runs)})
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
