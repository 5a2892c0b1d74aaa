"""End to end on the namespace bench: cables with no IPv4 at all, agents run with
--configure-links, and real MLX ring workers run over the ring the agents committed.

Four hosts on a LAN, cabled in a square with Thunderbolt-marked veths that carry only IPv6
link-local addresses (as a fresh Thunderbolt cable does). The agents form, commit the
square ring, add a /30 per cable (the consented --configure-links), publish the new
addresses and commit a ring whose every hop has an IPv4 pair. `p2pmesh ring --mlx-hostfile`
renders it, and one `mx.distributed` ring worker per namespace (rank i on the host the ring
puts at i) does an all_sum and a neighbour send/recv over the cables."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.agent.harness import ROOT, AgentProc, one_cluster, wait_for
from tests.agent.netns import Bench, ip, require_root
from tests.worker.test_mlx_ring import assert_ring_works, run_ranks

FORM_TIMEOUT_S = 40
RING_TIMEOUT_S = 20


def _ring(agent: AgentProc) -> dict[str, Any] | None:
    s = agent.status()
    return s.get("ring") if s else None


def _addressed_square(ring: dict[str, Any] | None) -> bool:
    return bool(ring) and len(ring["order"]) == 4 and not ring["slow_hops"] and all(  # type: ignore[index]
        h["from_ipv4"] and h["to_ipv4"] for h in ring["hops"]  # type: ignore[index]
    )


def test_configured_links_carry_a_real_mlx_ring(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(4)
    agents: list[AgentProc] = []
    try:
        bench.lan()
        for i in range(4):
            bench.plug(i, (i + 1) % 4, ipv4=False, thunderbolt=True)
        key = tmp_path / "key"
        from p2pmesh.drivers.keys import write_key

        write_key(key, bytes(range(2, 34)))
        agents = bench.agents(tmp_path, key, tag="mx")
        for a in agents:
            a.extra.append("--configure-links")
            a.start()
        wait_for(lambda: one_cluster(agents, 4), FORM_TIMEOUT_S, "one cluster of 4")
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        ring = wait_for(lambda: (r := _ring(agents[0])) and _addressed_square(r) and r, RING_TIMEOUT_S,
                        "a square ring with an IPv4 pair on every cable")
        # The addresses are the planned link-local /30s, on the cables only.
        for hop in ring["hops"]:
            assert hop["from_ipv4"].startswith("169.254.") and hop["to_ipv4"].startswith("169.254.")
        for i, host in enumerate(bench.hosts):
            lan = ip("-n", host, "-4", "addr", "show", "dev", f"lan{i}").stdout
            assert "169.254." not in lan  # nothing added to the LAN port

        out = subprocess.run(
            [sys.executable, "-m", "p2pmesh", "ring", "--mlx-hostfile", "--state-dir", str(agents[0].state_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=20,
        )
        assert out.returncode == 0, out.stderr
        hostfile = json.loads(out.stdout)
        assert len(hostfile) == 4
        prefixes = [bench.exec_prefix(ids.index(node)) for node in ring["order"]]
        assert_ring_works(run_ranks(hostfile, tmp_path, prefixes))
    finally:
        for a in agents:
            a.stop()
        bench.close()
