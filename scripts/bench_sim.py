#!/usr/bin/env python3
"""Benchmark the simulator and the membership figures it measures.

    .venv/bin/python scripts/bench_sim.py [--seeds 200] [--workers 2] [--out FILE] [--against REV] [--json [FILE]]

Runs one sweep of seeds x 10 simulated seconds, 5 nodes, all faults, and prints (and with
--out writes as Markdown) the figures as ratios against baselines measured in the same run:
- simulator speed vs a bare heapq event loop doing no work (the cost of a real core, the
  codec and the invariant checks per event), and virtual vs wall time;
- failover (leader crash to a new leader's first commit, 50 ms heartbeat, 150-300 ms
  election timeout, 0.1-1 ms links) vs the election timeout floor and etcd's default
  1000 ms election timeout (anchor);
- detection of a silent member (committed MarkDown) and join-to-voter times vs targets;
- a 10%-loss run with the same seeds' first few: false downs must be zero;
- with --against REV: events/s per core of this tree and of git revision REV (e.g. the
  commit before a speed-up) on the same seeds, measured interleaved in fresh processes in
  CPU time (best of --ab-rounds each), so other load on a shared machine hits both alike;
  both must run the same events to the same trace digests.
"""
from __future__ import annotations

import heapq
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row_line, table_lines, wall, write_json  # noqa: E402
from sim.network import LinkProfile  # noqa: E402
from sim.scenario import Scenario  # noqa: E402


def bare_event_loop_rate(events: int = 300_000) -> float:
    """Events/s of a heapq discrete-event loop whose handlers do nothing."""
    queue: list[tuple[int, int, int]] = []
    seq = 0
    for i in range(64):
        heapq.heappush(queue, (i, i, 0))
        seq += 1

    def loop() -> None:
        nonlocal seq
        for _ in range(events):
            t, _, _ = heapq.heappop(queue)
            seq += 1
            heapq.heappush(queue, (t + 50, seq, 0))

    return events / wall(loop)[1]


def sweep(seeds: int, workers: int) -> dict:
    cmd = [sys.executable, "-m", "sim", "sweep", "--seeds", f"0-{seeds - 1}", "--nodes", "5",
           "--duration-s", "10", "--faults", "all", "--workers", str(workers)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["command"] = " ".join(["python", "-m", "sim", *cmd[3:]])
    return summary


_PROBE = """
import hashlib, json, sys, time
sys.path.insert(0, ".")
from sim.faults import FAULT_KINDS
from sim.scenario import run_seed
events, digest = 0, hashlib.sha256()
started = time.process_time()
for seed in range(int(sys.argv[1])):
    r = run_seed(seed, nodes=5, duration_s=10, faults=FAULT_KINDS)
    events += r.events
    digest.update(f"{r.events} {r.violation} {r.trace_digest}\\n".encode())
print(json.dumps({"events": events, "cpu_s": time.process_time() - started, "digest": digest.hexdigest()}))
"""


def speed_against(rev: str, seeds: int, rounds: int) -> dict:
    """Events/s per core here and at git revision ``rev``, interleaved, best of ``rounds``."""
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as old:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(rounds):
            for name, root in (("before", old), ("after", str(ROOT))):
                proc = subprocess.run([sys.executable, "-c", _PROBE, str(seeds)], cwd=root, capture_output=True, text=True,
                                      check=True)
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    best = {name: min(r["cpu_s"] for r in rs) for name, rs in runs.items()}
    events = {name: rs[0]["events"] for name, rs in runs.items()}
    same = len({r["digest"] for rs in runs.values() for r in rs}) == 1
    return {"rev": rev, "seeds": seeds, "rounds": rounds, "events": events["after"], "same_events_and_traces": same,
            "before_events_per_s": round(events["before"] / best["before"]),
            "after_events_per_s": round(events["after"] / best["after"]),
            "speedup": round(best["before"] / best["after"], 2)}


def false_downs(seeds: int) -> tuple[int, int]:
    """Runs with 10% loss and no faults; returns (runs, runs with a false MarkDown)."""
    bad = 0
    for seed in range(seeds):
        sc = Scenario(seed, nodes=5, duration_s=10, faults=(), profile=LinkProfile(loss=0.10))
        sc.world.checker.forbid_markdown = True
        if sc.run().violation:
            bad += 1
    return seeds, bad


def clean_join_and_detection(seeds: int, loss: float) -> tuple[list[float], list[float]]:
    """Without other faults: a sixth node appears (time until it is a voter), then a
    follower crashes (time until its MarkDown is committed)."""
    from p2pmesh.core.messages import MarkDown
    from sim.scenario import SIM_SETTINGS
    from sim.world import World

    joins: list[float] = []
    downs: list[float] = []
    for seed in range(seeds):
        w = World(seed, nodes=5, settings=SIM_SETTINGS, profile=LinkProfile(loss=loss))
        for n in w.nodes:
            w.boot(n)
        w.run_until(5_000_000, stop=w.converged)
        start = w.now_us
        node = w.add_node(boot=True)
        w.run_until(start + 10_000_000, stop=w.converged)
        joins.append((w.now_us - start) / 1000)
        leader = w.leader()
        victim = next(n for n in w.live_nodes() if n is not leader and n is not node)
        start = w.now_us
        w.crash(victim)
        marked: list[int] = []

        def seen(n: object, ready: object, effects: object, victim_id: str = victim.node_id) -> None:
            for e in ready.applied:  # type: ignore[attr-defined]
                if isinstance(e.command, MarkDown) and e.command.node_id == victim_id and not marked:
                    marked.append(w.now_us)

        w.observers.append(seen)
        w.run_until(start + 10_000_000, stop=lambda: bool(marked))
        downs.append(((marked[0] if marked else w.now_us) - start) / 1000)
    return joins, downs


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--loss-seeds", type=int, default=20)
    p.add_argument("--out", default=None, help="write a Markdown section to this file")
    p.add_argument("--against", default=None, metavar="REV", help="also compare events/s per core with git revision REV")
    p.add_argument("--ab-seeds", type=int, default=20, help="seeds per process in the --against comparison")
    p.add_argument("--ab-rounds", type=int, default=3, help="interleaved rounds in the --against comparison")
    args = p.parse_args()

    bare = bare_event_loop_rate()
    s = sweep(args.seeds, args.workers)
    loss_runs, loss_bad = false_downs(args.loss_seeds)
    joins, downs = clean_join_and_detection(args.loss_seeds, 0.0)
    joins_l, downs_l = clean_join_and_detection(args.loss_seeds, 0.10)
    per_worker = s["events_per_s"] / max(1, s["workers"])
    fo = s["failover_ms"]
    rows = [
        ("seeds x 10 s, 5 nodes, all faults", f"{s['seeds']} seeds, {s['failures']} violations", "0 violations", ""),
        ("simulator events/s (all workers)", f"{s['events_per_s']:,}", ">= 100,000", f"{s['workers']} workers"),
        ("events/s per worker vs bare heapq loop", f"{per_worker:,.0f} vs {bare:,.0f}", "", f"ratio {per_worker / bare:.3f}"),
        ("virtual time / wall time", f"{s['sim_to_wall']}x", ">= 300x", ""),
        ("failover p50 / p99 / max (ms)", f"{fo['p50']} / {fo['p99']} / {fo['max']}", "p50 <= 300, p99 <= 600",
         f"p50 = {fo['p50'] / 150:.2f}x election_min (150 ms); {fo['p50'] / 1000:.2f}x etcd default ET 1000 ms"),
        ("silent member marked down under all faults, p50 / p99 / max (ms)",
         f"{s['down_detect_ms']['p50']} / {s['down_detect_ms']['p99']} / {s['down_detect_ms']['max']}", "<= 3000",
         f"{s['down_detect_ms']['count']} detections; memberlist LAN ~5000 ms typical"),
        ("new node to voter under all faults, p50 / p99 / max (ms)",
         f"{s['join_to_voter_ms']['p50']} / {s['join_to_voter_ms']['p99']} / {s['join_to_voter_ms']['max']}", "<= 2000",
         f"{s['join_to_voter_ms']['count']} joins (faults running)"),
        ("convergence after healing, p50 / p99 / max (ms)",
         f"{s['converge_ms']['p50']} / {s['converge_ms']['p99']} / {s['converge_ms']['max']}", "<= 20000 (checked)", ""),
        ("new node to voter, no other faults, p50 / max (ms)", f"{_p(joins, 0.5)} / {_p(joins, 1.0)}", "<= 2000",
         f"with 10% loss: {_p(joins_l, 0.5)} / {_p(joins_l, 1.0)}"),
        ("silent member marked down, no other faults, p50 / max (ms)", f"{_p(downs, 0.5)} / {_p(downs, 1.0)}", "<= 3000",
         f"with 10% loss: {_p(downs_l, 0.5)} / {_p(downs_l, 1.0)}"),
        ("false downs at 10% loss", f"{loss_bad} of {loss_runs} runs", "0", ""),
    ]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"
    lines = [
        *table_lines("figure", "measured", "target", "ratio / anchor"),
        *[row_line(*r) for r in rows],
        "",
        f"Machine: {machine}. Sweep command: `{s['command']}` ({s['wall_s']} s wall).",
    ]
    ab = speed_against(args.against, args.ab_seeds, args.ab_rounds) if args.against else None
    if ab is not None:
        lines.append(
            f"Against {ab['rev']} ({ab['seeds']} seeds, {ab['events']:,} events, best of {ab['rounds']} interleaved, CPU time): "
            f"{ab['before_events_per_s']:,} -> {ab['after_events_per_s']:,} events/s per core ({ab['speedup']}x); "
            f"same events and traces: {'yes' if ab['same_events_and_traces'] else 'NO'}.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    write_json(args.json, {"sweep": s, "bare_events_per_s": round(bare), "events_per_s_per_worker": round(per_worker),
                           "loss_runs": loss_runs, "loss_false_downs": loss_bad, "join_ms": joins, "down_ms": downs,
                           "join_ms_loss": joins_l, "down_ms_loss": downs_l, "against": ab})
    same = ab is None or ab["same_events_and_traces"]
    return 0 if s["failures"] == 0 and loss_bad == 0 and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
