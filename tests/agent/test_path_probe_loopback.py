"""Real agents on loopback, joined by no cable: each probes the path to the other over its
transport address (agent/tasks/links.py), and `status --json` shows the ring's network hops
with the measured round trip and rate instead of the kind's defaults (issue 16)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from p2pmesh.core.physical import NOMINAL_GBPS
from p2pmesh.core.ring import DEFAULT_RTT_MS
from tests.agent.harness import AgentProc, formed_cluster, free_port, wait_for

FORM_TIMEOUT_S = 30
PROBE_TIMEOUT_S = 30
"""A ring epoch probes at once (a failure is retried after 5 s): well within this."""


def _agents(tmp_path: Path) -> list[AgentProc]:
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "key"
    write_key(key, bytes(range(32)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(2)]
    out = []
    for i, listen in enumerate(listens):
        a = AgentProc(tmp_path / f"a{i}", listen, peers=[x for x in listens if x != listen], key_file=key)
        a.state_dir.mkdir()
        out.append(a)
    return out


def _measured_hops(agent: AgentProc) -> list[dict[str, Any]] | None:
    s = agent.status()
    hops = ((s or {}).get("ring") or {}).get("hops") or []
    if len(hops) == 2 and all(h["rtt_ms"] is not None for h in hops):
        return hops
    return None


def test_two_loopback_agents_measure_their_network_hop(tmp_path: Path) -> None:
    with formed_cluster(_agents(tmp_path), FORM_TIMEOUT_S) as agents:
        hops = wait_for(lambda: _measured_hops(agents[0]), PROBE_TIMEOUT_S, "measured network hops")
        ids = {(agents[0].status() or {})["node_id"], (agents[1].status() or {})["node_id"]}
        assert {(h["from"], h["to"]) for h in hops} == {tuple(ids), tuple(reversed(tuple(ids)))}
        for h in hops:
            print("measured", h["from"][:8], "->", h["to"][:8], h["rtt_ms"], "ms", h["gbps"], "Gb/s")
            assert h["kind"] == "network" and h["from_interface"] is None
            # Loopback through TLS and trio: well under the kind's 5 ms default, and faster
            # than its 0.1 Gb/s guess (the 1 MiB burst alone takes ~100 ms at that rate).
            assert 0 < h["rtt_ms"] < DEFAULT_RTT_MS["network"], h
            assert h["gbps"] > NOMINAL_GBPS["network"], h
        # Both agents hold the same committed figures.
        assert _measured_hops(agents[1]) is not None
