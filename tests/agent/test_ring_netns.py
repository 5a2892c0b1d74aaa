"""The ring follows real (veth) cables: four namespace hosts on one Ethernet switch, cabled
in a square with veths marked as Thunderbolt. Real agents detect their ports, publish
them, and the leader commits a ring that follows the cables; pulling a cable, killing a
Mac and plugging back each produce the right new ring."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import ROOT, AgentProc, one_cluster, wait_for
from tests.agent.netns import Bench, ip, require_root

FORM_TIMEOUT_S = 40
RING_TIMEOUT_S = 15
"""Generous for a loaded CI machine; scripts/bench_ring_netns.py measures the 1 s target."""


def _key(tmp_path: Path) -> Path:
    from p2pmesh.drivers.keys import write_key

    path = tmp_path / "cluster.key"
    write_key(path, bytes(range(1, 33)))
    return path


@pytest.fixture
def square(tmp_path: Path):  # type: ignore[no-untyped-def]
    require_root()
    bench = Bench.create(4)
    agents: list[AgentProc] = []
    try:
        bench.lan()
        for i in range(4):
            bench.plug(i, (i + 1) % 4, thunderbolt=True)
        agents = bench.agents(tmp_path, _key(tmp_path), tag="sq")
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 4), FORM_TIMEOUT_S, "one cluster of 4")
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        yield bench, agents, ids
    finally:
        for a in agents:
            a.stop()
        bench.close()


def _ring(agent: AgentProc) -> dict[str, Any] | None:
    s = agent.status()
    return s.get("ring") if s else None


def _pairs(ring: dict[str, Any]) -> set[frozenset[str]]:
    order = ring["order"]
    return {frozenset((order[i], order[(i + 1) % len(order)])) for i in range(len(order))}


def _square_ring(ring: dict[str, Any] | None, ids: list[str]) -> bool:
    if not ring or len(ring["order"]) != 4 or any(h["kind"] != "thunderbolt" for h in ring["hops"]):
        return False
    return _pairs(ring) == {frozenset((ids[i], ids[(i + 1) % 4])) for i in range(4)}


def test_square_ring_follows_the_cables_unplug_and_replug(square) -> None:  # type: ignore[no-untyped-def]
    bench, agents, ids = square
    ring = wait_for(lambda: (r := _ring(agents[0])) and _square_ring(r, ids) and r, RING_TIMEOUT_S, "the square ring")
    # Every hop names the cable's interfaces and the addresses already on it (10.77.n.x).
    for hop in ring["hops"]:
        assert hop["from_interface"].startswith("tb") and hop["to_interface"].startswith("tb")
        assert hop["from_ipv4"].startswith("10.77.") and hop["to_ipv4"].startswith("10.77.")
    # Every agent shows the same committed ring.
    assert all(_ring(a)["order"] == ring["order"] for a in agents[1:])  # type: ignore[index]
    # The bounded probes measure each cable: RTTs appear in the ring hops.
    wait_for(lambda: all(h["rtt_ms"] is not None for h in (_ring(agents[0]) or {"hops": [{"rtt_ms": None}]})["hops"]),
             RING_TIMEOUT_S, "measured RTT on every hop")

    epoch = ring["epoch"]
    pulled = frozenset((ids[0], ids[1]))
    bench.set_link(bench.cables[0], up=False)  # the h0-h1 cable
    started = time.monotonic()

    def one_slow_hop() -> dict[str, Any] | None:
        r = _ring(agents[2])
        if not r or len(r["order"]) != 4:
            return None
        slow = r["slow_hops"]
        return r if len(slow) == 1 and frozenset((slow[0]["from"], slow[0]["to"])) == pulled else None

    ring = wait_for(one_slow_hop, RING_TIMEOUT_S, "a ring with the pulled cable replaced by the LAN")
    assert time.monotonic() - started < RING_TIMEOUT_S
    assert ring["epoch"] > epoch
    assert ring["slow_hops"][0]["kind"] == "ethernet"  # the switch the hosts share (bench-marked LAN)

    bench.set_link(bench.cables[0], up=True)
    ring = wait_for(lambda: (r := _ring(agents[1])) and _square_ring(r, ids) and r, RING_TIMEOUT_S, "the square ring back")
    # The terminal drawing names the epoch, the cables and their speed.
    for command in (["ring"], ["status"]):
        out = subprocess.run([sys.executable, "-m", "p2pmesh", *command, "--state-dir", str(agents[1].state_dir)],
                             cwd=ROOT, capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        assert f"ring epoch {ring['epoch']}: 4 nodes" in out.stdout and "thunderbolt 40 Gb/s" in out.stdout
        assert "(this Mac)" in out.stdout


def test_a_dead_mac_leaves_the_ring(square) -> None:  # type: ignore[no-untyped-def]
    bench, agents, ids = square
    wait_for(lambda: _square_ring(_ring(agents[0]), ids), RING_TIMEOUT_S, "the square ring")
    leader = agents[0].status()["leader"]  # type: ignore[index]
    victim = next(i for i in range(4) if ids[i] != leader)
    agents[victim].signal(signal.SIGKILL)
    alive = [a for i, a in enumerate(agents) if i != victim]

    def without_victim() -> bool:
        r = _ring(alive[0])
        return bool(r) and sorted(r["order"]) == sorted(i for k, i in enumerate(ids) if k != victim)  # type: ignore[index]

    wait_for(without_victim, RING_TIMEOUT_S, "a ring of the three live Macs")
    r = _ring(alive[0])
    assert r is not None and len(r["slow_hops"]) == 1  # three Macs of a square: a line plus one LAN hop


def test_a_bridge_over_a_ring_cable_is_warned_about_and_left_alone(tmp_path: Path) -> None:
    """A ring cable enslaved to a bridge (what macOS's Thunderbolt Bridge does) gets a
    warning in the agent's log with the fix, and the agent changes nothing."""
    require_root()
    bench = Bench.create(2)
    agents: list[AgentProc] = []
    try:
        bench.lan()
        cable = bench.plug(0, 1, thunderbolt=True)
        host = bench.hosts[0]
        ip("-n", host, "link", "add", "tbbridge", "type", "bridge")
        ip("-n", host, "link", "set", cable.dev_a, "master", "tbbridge")
        agents = bench.agents(tmp_path, _key(tmp_path), tag="br")
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of 2")
        wait_for(lambda: "tbbridge bridges the ring interface" in agents[0].log_text(), RING_TIMEOUT_S, "the bridge warning")
        assert "nomaster" in agents[0].log_text()
        members = ip("-n", host, "link", "show", "master", "tbbridge").stdout
        assert cable.dev_a in members  # still bridged: p2pmesh only warns
    finally:
        for a in agents:
            a.stop()
        bench.close()
