"""The committed ring follows the virtual cabling (sim/ring_scenario.py), and a machine
that stops re-negotiating is caught."""
from __future__ import annotations

import json

import pytest

from p2pmesh.core.leader import LeaderDuties
from p2pmesh.core.machine import Machine
from p2pmesh.core.raft import Raft
from sim.cli import main as sim_main
from sim.ring_scenario import SETTLE_BOUND_US, RingScenario, run_ring_seed
from sim.scenario import SIM_SETTINGS
from sim.world import World


@pytest.mark.parametrize("nodes", [2, 3, 4, 6, 8])
def test_ring_follows_cables_across_seeds(nodes: int) -> None:
    for seed in range(25):
        r = run_ring_seed(seed, nodes=nodes)
        assert r.violation is None, f"seed {seed}: {r.violation}: {r.detail}"
        assert r.changes > 0
        assert all(ms <= SETTLE_BOUND_US / 1000 for ms in r.cable_settle_ms)


def test_rings_cli_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["rings", "--seeds", "0-4", "--nodes", "4"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["seeds"] == 5 and summary["failures"] == 0 and summary["changes"] == 60
    assert summary["cable_to_ring_ms"]["max"] <= 1000


class _FrozenRingDuties(LeaderDuties):
    """A planted bug: the leader proposes the first ring and never another."""

    def negotiate_ring(self, r: Raft, now_ms: int) -> None:
        if r.state.ring_epoch == 0:
            super().negotiate_ring(r, now_ms)


class _FrozenRing(Machine):
    leader_class = _FrozenRingDuties


def test_a_leader_that_stops_negotiating_is_caught() -> None:
    found = []
    for seed in range(10):
        scenario = RingScenario(seed, nodes=4)
        scenario.world.machine_class = _FrozenRing
        r = scenario.run()
        found.append(r.violation)
    assert "ring-follows-cables" in found


def _square() -> tuple[World, list]:
    w = World(3, nodes=4, settings=SIM_SETTINGS)
    n = w.nodes
    cables = [w.plug(n[0], n[1]), w.plug(n[1], n[2]), w.plug(n[2], n[3]), w.plug(n[3], n[0])]
    for node in n:
        w.boot(node)
    assert w.run_until(5_000_000, stop=lambda: w.converged() and _ring(w) is not None and len(_ring(w)[0]) == 4)
    return w, cables


def _ring(w: World) -> tuple[tuple[str, ...], tuple] | None:
    leader = w.leader()
    if leader is None or leader.machine is None or leader.machine.raft is None:
        return None
    state = leader.machine.raft.state
    return state.ring, state.ring_hops


def _neighbours(order: tuple[str, ...]) -> set[frozenset[str]]:
    return {frozenset((order[i], order[(i + 1) % len(order)])) for i in range(len(order))}


def test_square_unplug_and_replug() -> None:
    w, cables = _square()
    ids = [x.node_id for x in w.nodes]
    order, hops = _ring(w)  # type: ignore[misc]
    square = {frozenset((ids[i], ids[(i + 1) % 4])) for i in range(4)}
    assert _neighbours(order) == square
    assert all(h.kind == "thunderbolt" for h in hops)
    epoch_before = w.leader().machine.raft.state.ring_epoch  # type: ignore[union-attr]

    w.unplug(cables[0])  # n0 - n1
    pulled = frozenset((ids[0], ids[1]))
    assert w.run_until(w.now_us + 1_000_000, stop=lambda: any(h.kind != "thunderbolt" for h in _ring(w)[1]))  # type: ignore[index]
    order, hops = _ring(w)  # type: ignore[misc]
    slow = [h for h in hops if h.kind != "thunderbolt"]
    assert len(slow) == 1 and frozenset((slow[0].src, slow[0].dst)) == pulled
    assert w.leader().machine.raft.state.ring_epoch > epoch_before  # type: ignore[union-attr]

    w.plug(w.nodes[0], w.nodes[1])
    assert w.run_until(w.now_us + 1_000_000, stop=lambda: all(h.kind == "thunderbolt" for h in _ring(w)[1]))  # type: ignore[index]
    order, hops = _ring(w)  # type: ignore[misc]
    assert _neighbours(order) == square
