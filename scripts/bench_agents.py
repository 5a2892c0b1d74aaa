#!/usr/bin/env python3
"""Benchmark real agents in network namespaces (needs root):

    sudo .venv/bin/python scripts/bench_agents.py [--rounds 3] [--json [FILE]]

1. formation: 5 hosts on a full mesh of veth "cables", agents started at once, from process
   start to one committed membership of 5 (mDNS included). Baseline in the same run: the
   time until every agent process answers on its control socket (Python + imports + TLS
   setup), i.e. the floor no protocol can beat.
2. failover: SIGKILL the leader; time until a new leader has committed (commit index moves
   past what the old leader had). Compared with the configured election timeout.
3. merge: two clusters of 2 hosts; cables plugged between them; time until one cluster of 4.
   Compared with the interface poll period (how often agents notice new cables).
Results print as a Markdown table; docs/benchmarks.md records them with this command.
"""
from __future__ import annotations

import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row, table, write_json  # noqa: E402
from p2pmesh.drivers.discovery import POLL_S  # noqa: E402
from p2pmesh.drivers.keys import write_key  # noqa: E402
from tests.agent.harness import AgentProc, control_status, timed_wait  # noqa: E402
from tests.agent.netns import Bench, require_root  # noqa: E402

TIMEOUT_S = 60.0




def one_cluster(agents: list[AgentProc], n: int) -> dict | None:
    ss = [control_status(a) for a in agents]
    if any(s is None for s in ss):
        return None
    if len({s["cluster_id"] for s in ss}) != 1 or len({s["leader"] for s in ss}) != 1 or ss[0]["leader"] is None:
        return None
    members = ss[0]["members"]
    return ss[0] if len(members) == n and all(m["voter"] and m["up"] for m in members) else None




def round_formation_failover(root: Path, key: Path, r: int) -> tuple[float, float, float, float]:
    bench = Bench.create(5)
    agents: list[AgentProc] = []
    try:
        bench.plug_full_mesh()
        agents = bench.agents(root, key, f"f{r}-")
        t0 = time.monotonic()
        for a in agents:
            a.start()
        timed_wait(lambda: all(control_status(a) for a in agents), TIMEOUT_S, "agents to answer", 0.01)
        answer = time.monotonic() - t0
        s = None

        def formed() -> bool:
            nonlocal s
            s = one_cluster(agents, 5)
            return s is not None

        timed_wait(formed, TIMEOUT_S, "formation", 0.01)
        formation = time.monotonic() - t0
        assert s is not None
        leader = next(a for a in agents if (control_status(a) or {}).get("node_id") == s["leader"])
        commit = max((control_status(a) or {}).get("commit_index", 0) for a in agents)
        rest = [a for a in agents if a is not leader]
        t1 = time.monotonic()
        leader.signal(signal.SIGKILL)

        def new_leader() -> bool:
            ss = [control_status(a) for a in rest]
            return any(x and x["role"] == "leader" and x["commit_index"] > commit for x in ss)

        failover = timed_wait(new_leader, TIMEOUT_S, "failover", 0.01)
        return answer, formation, failover, time.monotonic() - t1
    finally:
        for a in agents:
            a.kill()
        bench.close()


def round_merge(root: Path, key: Path, r: int) -> float:
    bench = Bench.create(4)
    agents: list[AgentProc] = []
    try:
        bench.plug(0, 1)
        bench.plug(2, 3)
        agents = bench.agents(root, key, f"m{r}-")
        for a in agents:
            a.start()
        timed_wait(lambda: one_cluster(agents[:2], 2) and one_cluster(agents[2:], 2), TIMEOUT_S, "two clusters", 0.01)
        t0 = time.monotonic()
        for i in (0, 1):
            for j in (2, 3):
                bench.plug(i, j)
        timed_wait(lambda: one_cluster(agents, 4), TIMEOUT_S, "merge", 0.01)
        return time.monotonic() - t0
    finally:
        for a in agents:
            a.kill()
        bench.close()


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    require_root()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        key = root / "key"
        write_key(key, bytes(range(32)))
        ff = [round_formation_failover(root, key, r) for r in range(args.rounds)]
        merges = [round_merge(root, key, r) for r in range(args.rounds)]
    med = statistics.median
    answer, formation, failover = med(x[0] for x in ff), med(x[1] for x in ff), med(x[2] for x in ff)
    merge = med(merges)
    table(f"figure (median of {args.rounds} rounds)", "measured", "target", "baseline in the same run")
    row("5 agents in namespaces: start to one committed membership of 5", f"{formation:.2f} s", "<= 3 s",
        f"processes answering: {answer:.2f} s (protocol share {formation - answer:.2f} s)")
    row("leader SIGKILL to a new leader committing", f"{failover * 1000:.0f} ms", "<= 1000 ms",
        f"{failover * 1000 / 300:.2f}x the 300 ms max election timeout")
    row("cables plugged between two clusters to one cluster of 4", f"{merge:.2f} s", "<= 5 s",
        f"{merge / POLL_S:.2f}x the {POLL_S:.0f} s interface poll period")
    print(f"\nrounds: formation {[round(x[1], 2) for x in ff]}, failover {[round(x[2], 3) for x in ff]}, merge {[round(m, 2) for m in merges]}")
    write_json(args.json, {"rounds": args.rounds, "answer_s": [x[0] for x in ff], "formation_s": [x[1] for x in ff],
                           "failover_s": [x[2] for x in ff], "merge_s": merges, "poll_s": POLL_S, "election_max_ms": 300})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
