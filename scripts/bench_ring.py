#!/usr/bin/env python3
"""Ring solver timing at 16 nodes, and the leader's longest step while it re-plans a ring.

    .venv/bin/python scripts/bench_ring.py [--graphs 50] [--family-graphs 60] [--leader-seeds 3]

Generated cablings of 16 Macs: a Thunderbolt ring in random order plus 8, 16 or 32 random
extra links of mixed kinds (a Mac has a handful of ports, so real graphs are sparse), and a
dense case (a random Ethernet/Wi-Fi link between most pairs), and the graphs a cluster
itself negotiates (core/physical.py): random Thunderbolt cables with no full ring (islands,
lines) plus a slow "network" path between every pair no cable joins. Baseline in the same
run: the same solver on the bare 16-node ring (the least work possible).

The LAN-cluster rows (sim/ring_graphs.py, issue 13) are the shape real clusters have: up to
5 Thunderbolt cables per Mac and every Mac on one 10 GbE LAN; with Ethernet RTTs unknown, as
in a cluster (only cables are probed), and with an RTT drawn per pair (a harder latency
level). Each row reports the median and the worst solve over its graphs.

The leader rows run 16 simulated Macs (sim/world.py) cabled like a LAN cluster (4 ports
each there, the simulator's), pull cables of the committed ring, and time (CPU) every
`Machine.handle()` of the leader from the pull until the new ring is committed: the ring
solve is spread over several steps (core/physical.py), so the longest step, not the solve,
is what can delay a heartbeat.
"""
from __future__ import annotations

import gc
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import cpu, parser, row, table, write_json  # noqa: E402
from p2pmesh.core.machine import Machine  # noqa: E402
from p2pmesh.core.raft import Role  # noqa: E402
from p2pmesh.core.ring import KINDS, Link, solve  # noqa: E402
from sim.cabling import TB_GBPS  # noqa: E402
from sim.ring_graphs import lan_cluster  # noqa: E402
from sim.scenario import SIM_SETTINGS  # noqa: E402
from sim.world import World  # noqa: E402


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
    ring, took = cpu(lambda: solve(nodes, links))
    return took * 1000, ring.exact


class _TimedMachine(Machine):
    """Records how long each step of a leader takes (wall clock, outside the core)."""

    steps: list[tuple[float, bool]] = []  # (seconds, a ring solve was in progress after it)

    def handle(self, event, now_ms):  # type: ignore[no-untyped-def]
        ready, took = cpu(lambda: Machine.handle(self, event, now_ms))
        if self.raft is not None and self.raft.role is Role.LEADER:
            _TimedMachine.steps.append((took, self.duties.ring_solving is not None))
        return ready


def _true_ring(w: World) -> tuple[str, ...]:
    """The ring the cabling calls for (as sim/ring_scenario.py computes it)."""
    ids = {x.index: x.node_id for x in w.nodes if x.alive}
    links = [Link(ids[c.a], ids[c.b], "thunderbolt", TB_GBPS) for c in w.cabling.cables]
    joined = {frozenset((l.a, l.b)) for l in links}
    order = sorted(ids.values())
    links += [Link(a, b, "network", 0.1) for i, a in enumerate(order) for b in order[i + 1 :] if frozenset((a, b)) not in joined]
    return solve(list(order), links).order


def _committed(w: World) -> tuple[str, ...] | None:
    leader = w.leader()
    return None if leader is None or leader.machine is None or leader.machine.raft is None else leader.machine.raft.state.ring


def leader_replans(seeds: int, pulls: int) -> dict:
    """Longest leader step while 16 simulated Macs re-plan their ring after a cable pull."""
    worst_ms: list[float] = []
    solving_steps: list[int] = []
    for seed in range(seeds):
        _, links = lan_cluster(seed, ports=4)  # the simulated Macs have 4 ports
        w = World(seed, nodes=16, settings=SIM_SETTINGS, machine_class=_TimedMachine)
        for l in links:
            if l.kind == "thunderbolt":
                try:
                    w.plug(w.nodes[int(l.a[1:])], w.nodes[int(l.b[1:])])
                except ValueError:
                    pass  # that Mac's ports are full
        for node in w.nodes:
            w.at(w.rng.randint(0, 50_000), lambda node=node: w.boot(node))
        if not w.run_until(5_000_000, stop=lambda: all(x.alive for x in w.nodes) and w.converged()):
            raise SystemExit(f"seed {seed}: 16 simulated Macs formed no cluster")
        expected = _true_ring(w)
        w.run_until(w.now_us + 3_000_000, stop=lambda: _committed(w) == expected)
        # One process holds all 16 machines here: a full garbage collection scans all of
        # them (tens of ms) wherever it falls. An agent holds one; freeze what formation
        # built so that collections scan what the steps create, as they would there.
        gc.freeze()
        rng = random.Random(seed)
        for _ in range(pulls):
            ring = _committed(w) or ()
            index = {x.node_id: x.index for x in w.nodes}
            hops = {frozenset((index[ring[i]], index[ring[(i + 1) % len(ring)]])) for i in range(len(ring))}
            in_ring = [c for c in w.cabling.cables if frozenset((c.a, c.b)) in hops]
            if not in_ring:
                break  # no Thunderbolt hop left in the ring
            w.unplug(rng.choice(in_ring))
            expected = _true_ring(w)
            if expected == ring:
                continue
            _TimedMachine.steps = []
            if not w.run_until(w.now_us + 3_000_000, stop=lambda: _committed(w) == expected):
                raise SystemExit(f"seed {seed}: the ring did not follow a pulled cable")
            worst_ms.append(max(t for t, _ in _TimedMachine.steps) * 1000)
            solving_steps.append(sum(1 for _, solving in _TimedMachine.steps if solving))
        gc.unfreeze()
    return {"replans": len(worst_ms), "max_step_ms": max(worst_ms, default=0.0),
            "median_max_step_ms": statistics.median(worst_ms) if worst_ms else 0.0,
            "max_solving_steps": max(solving_steps, default=0)}


def _ring_row(raw: dict, base: float, label: str, runs: list[tuple[float, bool]]) -> None:
    ms = [r[0] for r in runs]
    exact = sum(1 for r in runs if r[1])
    row(label, f"{statistics.median(ms):.2f}", f"{max(ms):.1f}", f"{exact}/{len(runs)}", f"{statistics.median(ms) / base:.1f}")
    raw["rows"].append({"label": label, "median_ms": statistics.median(ms), "max_ms": max(ms), "exact": exact, "graphs": len(runs)})


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--graphs", type=int, default=50)
    p.add_argument("--family-graphs", type=int, default=60, help="graphs per LAN-cluster row")
    p.add_argument("--leader-seeds", type=int, default=6, help="simulated 16-Mac clusters for the leader rows")
    args = p.parse_args()
    rng = random.Random(2026)
    base = statistics.median(timed(*graph(rng, 0, False))[0] for _ in range(args.graphs))
    raw: dict = {"graphs": args.graphs, "bare_ring_median_ms": base, "rows": []}
    table("16 nodes", "median ms", "max ms", "exact", "ratio to bare ring")
    row("bare Thunderbolt ring (baseline)", f"{base:.2f}", "", "", "1.0")
    for label, extra, dense in (("+8 links", 8, False), ("+16 links", 16, False), ("+32 links", 32, False), ("dense Ethernet/Wi-Fi mesh", 0, True)):
        runs = [timed(*graph(rng, extra, dense)) for _ in range(args.graphs)]
        ms = [r[0] for r in runs]
        exact = sum(1 for r in runs if r[1])
        _ring_row(raw, base, label, runs)
    runs = [timed(*cluster_graph(rng)) for _ in range(args.graphs)]
    _ring_row(raw, base, "cluster graph: Thunderbolt islands + network paths", runs)
    for label, lan_rtt in (("LAN cluster: <= 5 Thunderbolt cables per Mac + 10 GbE mesh", False),
                           ("LAN cluster, an RTT per Ethernet pair", True)):
        _ring_row(raw, base, label, [timed(*lan_cluster(seed, lan_rtt=lan_rtt)) for seed in range(args.family_graphs)])
    leader = leader_replans(args.leader_seeds, 3)
    raw["leader"] = leader
    print(f"\nleader, 16 simulated Macs, {leader['replans']} re-plans after a cable pull: longest Machine.handle() "
          f"{leader['max_step_ms']:.1f} ms (median of the per-re-plan maxima {leader['median_max_step_ms']:.1f} ms); "
          f"a solve spanned up to {leader['max_solving_steps']} steps")
    write_json(args.json, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
