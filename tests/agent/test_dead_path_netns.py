"""A pulled Thunderbolt cable must not silence two Macs the LAN still joins (found by
scripts/chaos.py, docs/reliability.md): the agents' connection ran over the cable and
TCP kept retransmitting into the removed route for as long as the cable was out. Now the
transport's dead-path timeout (DEAD_PATH_S) ends it and the pair redials over the LAN."""
from __future__ import annotations

import re
import time
from pathlib import Path

from p2pmesh.drivers.transport import DEAD_PATH_S
from tests.agent.harness import AgentProc, one_cluster, wait_for
from tests.agent.netns import Bench, ip, require_root

FORM_TIMEOUT_S = 40
PULL_S = 8.0
"""Longer than standalone_after_ms (3 s): a pair still cut off by then leaves the cluster."""


def _control_connections(host: str) -> list[str]:
    out = ip("netns", "exec", host, "ss", "-Htn", "state", "established").stdout
    return [line for line in out.splitlines() if ":7741" in line]


def test_a_pulled_cable_moves_the_connection_to_the_lan(tmp_path: Path) -> None:
    require_root()
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "cluster.key"
    write_key(key, bytes(range(7, 39)))
    bench = Bench.create(2)
    agents: list[AgentProc] = []
    try:
        bench.lan()
        cable = bench.plug(0, 1, thunderbolt=True)
        # The LAN cables come up only after the pair is connected over the cable.
        for i, host in enumerate(bench.hosts):
            ip("-n", host, "link", "set", f"lan{i}", "down")
        agents = bench.agents(tmp_path, key, tag="dp")
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of 2 over the cable")
        assert any(cable.addr_a in c for c in _control_connections(bench.hosts[0]))
        for i, host in enumerate(bench.hosts):
            ip("-n", host, "link", "set", f"lan{i}", "up")
        time.sleep(1.0)

        bench.set_link(cable, up=False)
        pulled = time.monotonic()
        on_lan = wait_for(lambda: [c for c in _control_connections(bench.hosts[0]) if "10.99.0." in c],
                          DEAD_PATH_S + 4.0, "a control connection over the LAN")
        assert on_lan
        wait_for(lambda: one_cluster(agents, 2), PULL_S, "the cluster whole again while the cable is out")
        assert time.monotonic() - pulled < PULL_S
        time.sleep(max(0.0, PULL_S - (time.monotonic() - pulled)))
        bench.set_link(cable, up=True)
        wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster after the replug")
        # Nobody gave up its log: no rejoin with a fresh incarnation, no standalone cluster.
        for a in agents:
            log = a.log_text()
            assert not re.search(r"joining cluster \S+ \(from|cluster standalone", log), log[-2000:]
    finally:
        for a in agents:
            a.stop()
        bench.close()
