"""The leader spreads a long ring solve over its steps (core/physical.py) and still commits
the ring the cabling calls for: 16 simulated Macs cabled like a LAN cluster with no
Thunderbolt ring, a ring cable pulled."""
from __future__ import annotations

import random

from p2pmesh.core.machine import Machine, Ready
from p2pmesh.core.raft import Role
from p2pmesh.core.ring import Link, solve
from sim.cabling import TB_GBPS
from sim.ring_graphs import lan_cluster
from sim.scenario import SIM_SETTINGS
from sim.world import World


class _CountingMachine(Machine):
    solving_steps = 0

    def handle(self, event, now_ms):  # type: ignore[no-untyped-def]
        ready: Ready = super().handle(event, now_ms)
        if self.raft is not None and self.raft.role is Role.LEADER and self.duties.ring_solving is not None:
            _CountingMachine.solving_steps += 1
        return ready


def _true_ring(w: World) -> tuple[str, ...]:
    ids = {x.index: x.node_id for x in w.nodes if x.alive}
    links = [Link(ids[c.a], ids[c.b], "thunderbolt", TB_GBPS) for c in w.cabling.cables]
    joined = {frozenset((l.a, l.b)) for l in links}
    order = sorted(ids.values())
    links += [Link(a, b, "network", 0.1) for i, a in enumerate(order) for b in order[i + 1 :] if frozenset((a, b)) not in joined]
    ring = solve(list(order), links)
    assert ring.exact
    return ring.order


def _committed(w: World) -> tuple[str, ...] | None:
    leader = w.leader()
    return None if leader is None or leader.machine is None or leader.machine.raft is None else leader.machine.raft.state.ring


def test_a_long_solve_spans_leader_steps_and_commits_the_true_ring() -> None:
    _, links = lan_cluster(1, ports=4)
    w = World(1, nodes=16, settings=SIM_SETTINGS, machine_class=_CountingMachine)
    for l in links:
        if l.kind == "thunderbolt":
            w.plug(w.nodes[int(l.a[1:])], w.nodes[int(l.b[1:])])
    for node in w.nodes:
        w.at(w.rng.randint(0, 50_000), lambda node=node: w.boot(node))
    assert w.run_until(5_000_000, stop=lambda: all(x.alive for x in w.nodes) and w.converged())
    expected = _true_ring(w)
    assert w.run_until(w.now_us + 3_000_000, stop=lambda: _committed(w) == expected)
    rng = random.Random(1)
    spanned = []
    for _ in range(3):
        ring = _committed(w)
        assert ring is not None
        index = {x.node_id: x.index for x in w.nodes}
        hops = {frozenset((index[ring[i]], index[ring[(i + 1) % len(ring)]])) for i in range(len(ring))}
        w.unplug(rng.choice([c for c in w.cabling.cables if frozenset((c.a, c.b)) in hops]))
        expected = _true_ring(w)
        _CountingMachine.solving_steps = 0
        assert w.run_until(w.now_us + 3_000_000, stop=lambda: _committed(w) == expected), "the ring did not follow"
        spanned.append(_CountingMachine.solving_steps)
    assert max(spanned) > 1, spanned  # the solve was spread over steps, and the ring is still right
