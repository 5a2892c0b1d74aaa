"""`python -m sim chaos`: play chaos schedules (sim/chaos_schedule.py) in the simulator.

  python -m sim chaos --schedule FILE [--trace FILE] [--plant NAME]
  python -m sim chaos --seed S --hosts N --minutes M [--spares K] [--save FILE] [--trace FILE]
  python -m sim chaos --seeds A-B --hosts N --minutes M [--spares K] [--workers K] [--plant NAME]

One schedule prints its summary, its steps, then one JSON object (``verdict`` is the list
of violated invariants, empty on a pass: the same vocabulary scripts/chaos.py prints for a
real run of the same schedule). A range prints a line per failing seed with the command
that replays it and ends with one JSON summary. Exit 1 on any violation, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from sim.chaos_schedule import KINDS, ChaosSchedule, ScheduleError, draw


def add_parser(sub: Any, seed_range: Any) -> None:
    p = sub.add_parser("chaos", help="chaos schedules: the faults scripts/chaos.py performs on real agents")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--schedule", type=Path, help="a schedule saved by scripts/chaos.py or --save")
    which.add_argument("--seed", type=int, help="draw the schedule of this seed")
    which.add_argument("--seeds", type=seed_range, help="A-B: draw and play each seed's schedule")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--minutes", type=float, default=0.75)
    p.add_argument("--save", type=Path, default=None, help="with --seed: write the schedule to FILE")
    p.add_argument("--trace", default=None, help="write the event trace of the (single) schedule to FILE")
    p.add_argument("--plant", default=None, help="a planted bug (python -m sim plants)")
    p.add_argument("--workers", type=int, default=1)


def run(args: argparse.Namespace) -> int:
    from sim.plants import PLANTS

    if args.plant is not None and args.plant not in PLANTS:
        print(f"unknown plant {args.plant!r}; see python -m sim plants", file=sys.stderr)
        return 2
    try:
        if args.seeds is not None:
            return _sweep(args)
        if args.schedule is not None:
            schedule = ChaosSchedule.from_json(args.schedule.read_text(encoding="utf-8"))
        else:
            schedule = draw(args.seed, hosts=args.hosts, minutes=args.minutes, spares=args.spares)
    except (ScheduleError, OSError) as exc:
        print(f"python -m sim chaos: {exc}", file=sys.stderr)
        return 2
    if args.save is not None:
        args.save.write_text(schedule.to_json(), encoding="utf-8")
    print(schedule.summary())
    for step in schedule.steps:
        print("  " + step.describe())
    out = _play(schedule, args.plant, args.trace)
    for v in out["violations"]:
        print(f"seed {schedule.seed}: violated {v['invariant']}: {v['detail']}")
    print(json.dumps(out))
    return 1 if out["verdict"] else 0


def _play(schedule: ChaosSchedule, plant: str | None, trace_path: str | None = None) -> dict[str, Any]:
    from sim.chaos_scenario import run_chaos
    from sim.plants import machine_class_for

    started = time.perf_counter()
    trace = open(trace_path, "w", encoding="utf-8") if trace_path else None
    try:
        r = run_chaos(schedule, machine_class=machine_class_for(plant), trace=trace)
    finally:
        if trace is not None:
            trace.close()
    return {
        "seed": schedule.seed,
        "verdict": list(r.verdict.names),
        "violations": [{"invariant": v.invariant, "detail": v.detail} for v in r.verdict.violations],
        "steps": schedule.counts(),
        "skipped": r.skipped,
        "history": r.history.counts(),
        "formation_s": r.formation_s,
        "converge_s": r.converge_s,
        "events": r.events,
        "wall_s": round(time.perf_counter() - started, 3),
        "trace_sha256": r.trace_digest,
    }


def _job(job: tuple[int, int, int, float, str | None]) -> dict[str, Any]:
    seed, hosts, spares, minutes, plant = job
    return _play(draw(seed, hosts=hosts, minutes=minutes, spares=spares), plant)


def _sweep(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    jobs = [(s, args.hosts, args.spares, args.minutes, args.plant) for s in args.seeds]
    draw(jobs[0][0], hosts=args.hosts, minutes=args.minutes, spares=args.spares)  # bad sizes fail before forking
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers)
        results: Any = pool.imap(_job, jobs)
    else:
        results = map(_job, jobs)
    failures = 0
    first: dict[str, Any] | None = None
    steps = dict.fromkeys(KINDS, 0)
    totals: dict[str, int] = {}
    converge: list[float] = []
    skipped = 0
    for out in results:
        for k, n in out["steps"].items():
            steps[k] += n
        for k, n in out["history"].items():
            totals[k] = totals.get(k, 0) + n
        skipped += len(out["skipped"])
        if out["converge_s"] is not None:
            converge.append(out["converge_s"])
        if out["verdict"]:
            failures += 1
            first = first or {"seed": out["seed"], "verdict": out["verdict"]}
            detail = out["violations"][0]["detail"]
            extra = f" --plant {args.plant}" if args.plant else ""
            print(f"seed {out['seed']}: violated {', '.join(out['verdict'])}: {detail} (replay: python -m sim chaos "
                  f"--seed {out['seed']} --hosts {args.hosts} --spares {args.spares} --minutes {args.minutes}{extra})",
                  flush=True)
    if args.workers > 1:
        pool.close()
        pool.join()
    converge.sort()
    summary = {
        "seeds": len(jobs),
        "failures": failures,
        "first_failure": first,
        "faults": steps,
        "faults_skipped": skipped,
        **totals,
        "converge_s": {"p50": _pct(converge, 0.5), "p99": _pct(converge, 0.99), "max": _pct(converge, 1.0)},
        "wall_s": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


def _pct(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
