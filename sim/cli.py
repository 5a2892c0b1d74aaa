"""Command line of the simulator.

  python -m sim run --seed S --nodes N --duration-s T [--faults F,...] [--trace FILE] [--plant NAME]
  python -m sim sweep --seeds A-B --nodes N --duration-s T [--faults all] [--plant NAME] [--workers K]
  python -m sim rings --seeds A-B [--nodes N]
  python -m sim serving --seeds A-B [--nodes N] [--faults F,...] [--concurrency C] [--max-queue Q] [--workers K] [--trace FILE]
  python -m sim chaos --schedule FILE | --seed S | --seeds A-B [--hosts N --minutes M]  (sim/chaos_cli.py)
  python -m sim plants
  python -m sim demo

``run`` and ``sweep`` exit 1 on any violation and print the seed and the invariant; the
last line of ``sweep`` is one JSON object with the figures (see docs/simulator.md).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from sim.faults import parse_fault_list
from sim.plants import PLANTS, machine_class_for
from sim.scenario import RunResult, run_seed


def _seed_range(text: str) -> range:
    try:
        if "-" in text:
            lo, hi = text.split("-", 1)
            r = range(int(lo), int(hi) + 1)
        else:
            r = range(int(text), int(text) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must look like 0-999 or 42, got {text!r}") from None
    if len(r) == 0:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    return r


def _faults(text: str) -> tuple[str, ...]:
    try:
        return parse_fault_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nodes(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 32:
        raise argparse.ArgumentTypeError("--nodes must be between 1 and 32")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", description="Deterministic simulator of p2pmesh's core.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one seed")
    run.add_argument("--seed", type=int, required=True)
    sweep = sub.add_parser("sweep", help="run a range of seeds")
    sweep.add_argument("--seeds", type=_seed_range, required=True, help="A-B (inclusive)")
    sweep.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    sweep.add_argument("--keep-going", action="store_true", help="with --plant: do not stop at the first violation")
    for sp in (run, sweep):
        sp.add_argument("--nodes", type=_nodes, default=5)
        sp.add_argument("--duration-s", type=float, default=10.0)
        sp.add_argument("--faults", type=_faults, default=())
        sp.add_argument("--plant", choices=sorted(PLANTS), default=None)
    run.add_argument("--trace", default=None, help="write the event trace to FILE")
    rings = sub.add_parser("rings", help="ring scenarios on virtual cabling (does the ring follow the cables?)")
    rings.add_argument("--seeds", type=_seed_range, required=True, help="A-B (inclusive)")
    rings.add_argument("--nodes", type=_nodes, default=4)
    _add_serving_parser(sub)
    from sim.chaos_cli import add_parser as add_chaos_parser

    add_chaos_parser(sub, _seed_range)
    sub.add_parser("plants", help="list the planted bugs")
    demo = sub.add_parser("demo", help="a narrated 5-node cluster")
    demo.add_argument("--seed", type=int, default=7)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plants":
        for name in sorted(PLANTS):
            print(name)
        return 0
    if args.command == "demo":
        from sim.demo import run_demo

        return run_demo(args.seed)
    if args.command == "run":
        return _run(args)
    if args.command == "rings":
        return _rings(args)
    if args.command == "serving":
        return _serving(args)
    if args.command == "chaos":
        from sim.chaos_cli import run as run_chaos

        return run_chaos(args)
    return _sweep(args)


def _rings(args: argparse.Namespace) -> int:
    from sim.ring_scenario import run_ring_seed

    started = time.perf_counter()
    failures = changes = 0
    cable: list[float] = []
    member: list[float] = []
    for seed in args.seeds:
        r = run_ring_seed(seed, nodes=args.nodes)
        changes += r.changes
        cable += r.cable_settle_ms
        member += r.member_settle_ms
        if r.violation:
            failures += 1
            print(f"seed {seed}: violated {r.violation}: {r.detail} (replay: python -m sim rings --seeds {seed} --nodes {args.nodes})")
    summary = {
        "seeds": len(args.seeds),
        "failures": failures,
        "changes": changes,
        "wall_s": round(time.perf_counter() - started, 3),
        "cable_to_ring_ms": {"p50": _pct(cable, 0.5), "p99": _pct(cable, 0.99), "max": _pct(cable, 1.0), "count": len(cable)},
        "member_to_ring_ms": {"p50": _pct(member, 0.5), "p99": _pct(member, 0.99), "max": _pct(member, 1.0), "count": len(member)},
    }
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------
# python -m sim serving: the data plane (sim/serving_scenario.py, docs/simulator.md)


def _serving_faults(text: str) -> tuple[str, ...]:
    from sim.serving_scenario import FAULT_KINDS, GAP_KINDS

    kinds = FAULT_KINDS if text == "default" else tuple(k.strip() for k in text.split(",") if k.strip())
    for k in kinds:
        if k not in FAULT_KINDS + GAP_KINDS:
            raise argparse.ArgumentTypeError(f"unknown fault {k!r}; choose from: default, {', '.join(FAULT_KINDS + GAP_KINDS)}")
    if not kinds:
        raise argparse.ArgumentTypeError("--faults needs at least one kind")
    return kinds


def _add_serving_parser(sub: Any) -> None:
    sp = sub.add_parser("serving", help="data-plane scenarios: placements, activation, requests across epochs")
    sp.add_argument("--seeds", type=_seed_range, required=True, help="A-B (inclusive)")
    sp.add_argument("--nodes", type=_nodes, default=None, help="Macs at the start (default: 3-6, drawn from the seed)")
    sp.add_argument("--faults", type=_serving_faults, default="default",
                    help="comma list of crash, pause, join, leave (the default) and the gap kinds "
                    "worker-death, short-crash, short-pause")
    sp.add_argument("--report-prompt", choices=("text", "all", "none"), default=None,
                    help="which prompts the fake head reports back as tokens (default: drawn per seed)")
    sp.add_argument("--unordered", action="store_true", help="let inference frames reorder on a link (a gap)")
    sp.add_argument("--fresh-origins", action="store_true", help="let clients ask Macs that just joined (a gap)")
    sp.add_argument("--concurrency", type=_positive, default=None,
                    help="most requests a client burst asks at once at one member (default 16; a burst asks a quarter to all of it)")
    sp.add_argument("--max-queue", type=_non_negative, default=None,
                    help="requests a head worker queues beyond its batch; more are refused busy (default: drawn per seed)")
    sp.add_argument("--workers", type=int, default=1)
    sp.add_argument("--trace", default=None, help="write the event trace of the (single) seed to FILE")


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


_ServingJob = tuple[int, int | None, tuple[str, ...], str | None, bool, bool, int | None, int | None]


def _serving_job(job: _ServingJob, trace: Any = None) -> Any:
    from sim.serving_scenario import CONCURRENCY, run_serving_seed

    seed, nodes, faults, report_prompt, unordered, fresh, concurrency, max_queue = job
    return run_serving_seed(seed, nodes=nodes, faults=faults, report_prompt=report_prompt, ordered=not unordered,
                            fresh_origins=fresh, concurrency=concurrency or CONCURRENCY, max_queue=max_queue, trace=trace)


def _serving(args: argparse.Namespace) -> int:
    from sim.serving_scenario import FAULT_KINDS

    if args.trace and len(args.seeds) != 1:
        print("--trace needs a single seed", file=sys.stderr)
        return 2
    started = time.perf_counter()
    jobs: list[_ServingJob] = [
        (s, args.nodes, args.faults, args.report_prompt, args.unordered, args.fresh_origins, args.concurrency, args.max_queue)
        for s in args.seeds
    ]
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as trace:
            results: Any = [_serving_job(jobs[0], trace)]
    elif args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers)
        results = pool.imap(_serving_job, jobs)
    else:
        results = map(_serving_job, jobs)
    failures = requests = completed = resumed = errors = orphaned = 0
    cancelled = busy = busy_gave_up = freed = most_running = 0
    batches: list[int] = []
    first_failure: dict[str, Any] | None = None
    first: list[float] = []
    back: list[float] = []
    ttft: list[float] = []
    digests: list[str] = []
    for r in results:
        requests += r.requests
        completed += r.completed
        resumed += r.resumed
        errors += r.errors
        orphaned += r.orphaned
        cancelled += r.cancelled
        busy += r.busy
        busy_gave_up += r.busy_gave_up
        freed += r.head_cancels
        most_running = max(most_running, r.most_running)
        batches += [b for b in (r.batch_min, r.batch_max) if b]
        ttft += r.ttft_ms
        back += r.back_to_serving_ms
        digests.append(r.trace_digest)
        if r.first_serving_ms is not None:
            first.append(r.first_serving_ms)
        if r.violation:
            failures += 1
            first_failure = first_failure or {"seed": r.seed, "invariant": r.violation}
            extra = "" if args.faults == FAULT_KINDS else " --faults " + ",".join(args.faults)
            extra += f" --report-prompt {args.report_prompt}" if args.report_prompt else ""
            extra += " --unordered" if args.unordered else ""
            extra += " --fresh-origins" if args.fresh_origins else ""
            extra += f" --concurrency {args.concurrency}" if args.concurrency else ""
            extra += f" --max-queue {args.max_queue}" if args.max_queue is not None else ""
            print(f"seed {r.seed}: violated {r.violation}: {r.detail} "
                  f"(replay: python -m sim serving --seeds {r.seed} --nodes {r.nodes}{extra})", flush=True)
    if args.workers > 1 and not args.trace:
        pool.close()
        pool.join()
    summary = {
        "seeds": len(args.seeds),
        "failures": failures,
        "first_failure": first_failure,
        "requests": requests,
        "completed": completed,
        "resumed_requests": resumed,
        "error_requests": errors,
        "orphaned_requests": orphaned,
        "first_serving_ms": {"p50": _pct(first, 0.5), "p99": _pct(first, 0.99), "max": _pct(first, 1.0)},
        "back_to_serving_ms": {"p50": _pct(back, 0.5), "p99": _pct(back, 0.99), "max": _pct(back, 1.0), "count": len(back)},
        "cancelled_requests": cancelled,
        "busy_refusals": busy,
        "busy_gave_up": busy_gave_up,
        "cancels_freeing_a_slot": freed,
        "ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "max": _pct(ttft, 1.0), "count": len(ttft)},
        "batch": {"min": min(batches, default=None), "max": max(batches, default=None), "most_running": most_running},
        "wall_s": round(time.perf_counter() - started, 3),
    }
    if len(digests) == 1:
        summary["trace_sha256"] = digests[0]
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


def _run(args: argparse.Namespace) -> int:
    machine_class = machine_class_for(args.plant)
    trace = open(args.trace, "w", encoding="utf-8") if args.trace else None
    try:
        result = run_seed(
            args.seed, nodes=args.nodes, duration_s=args.duration_s, faults=args.faults, machine_class=machine_class, trace=trace
        )
    finally:
        if trace is not None:
            trace.close()
    summary = {
        "seed": result.seed,
        "violation": result.violation,
        "detail": result.detail,
        "events": result.events,
        "sim_s": round(result.sim_us / 1e6, 3),
        "faults": result.faults,
        "formation_ms": result.formation_ms,
        "failover_ms": result.failover_ms,
        "converge_ms": result.converge_ms,
        "trace_sha256": result.trace_digest,
    }
    if result.violation:
        print(f"seed {result.seed}: violated {result.violation}: {result.detail}")
    print(json.dumps(summary))
    return 1 if result.violation else 0


def _one(job: tuple[int, int, float, tuple[str, ...], str | None]) -> RunResult:
    seed, nodes, duration_s, faults, plant = job
    return run_seed(seed, nodes=nodes, duration_s=duration_s, faults=faults, machine_class=machine_class_for(plant))


def _results(args: argparse.Namespace) -> Iterator[RunResult]:
    jobs = [(s, args.nodes, args.duration_s, args.faults, args.plant) for s in args.seeds]
    if args.workers <= 1:
        yield from map(_one, jobs)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.workers) as pool:
        yield from pool.imap(_one, jobs, chunksize=max(1, min(16, len(jobs) // (args.workers * 8) or 1)))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _sweep(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    stop_early = args.plant is not None and not args.keep_going
    seeds = failures = events = 0
    sim_us = 0
    failover: list[float] = []
    down: list[float] = []
    join: list[float] = []
    converge: list[float] = []
    first_failure: dict[str, Any] | None = None
    for r in _results(args):
        seeds += 1
        events += r.events
        sim_us += r.sim_us
        if r.failover_ms is not None:
            failover.append(r.failover_ms)
        if r.converge_ms is not None:
            converge.append(r.converge_ms)
        down.extend(r.down_detect_ms)
        join.extend(r.join_to_voter_ms)
        if r.violation:
            failures += 1
            print(
                f"seed {r.seed}: violated {r.violation}: {r.detail} "
                f"(replay: python -m sim run --seed {r.seed} --nodes {args.nodes} --duration-s {args.duration_s}"
                f"{' --faults ' + ','.join(args.faults) if args.faults else ''}{' --plant ' + args.plant if args.plant else ''})",
                flush=True,
            )
            if first_failure is None:
                first_failure = {"seed": r.seed, "invariant": r.violation}
            if stop_early:
                break
    wall = time.perf_counter() - started
    summary = {
        "seeds": seeds,
        "failures": failures,
        "first_failure": first_failure,
        "events": events,
        "wall_s": round(wall, 3),
        "workers": args.workers,
        "events_per_s": round(events / wall) if wall else None,
        "sim_to_wall": round(sim_us / 1e6 / wall, 1) if wall else None,
        "failover_ms": {"p50": _pct(failover, 0.5), "p99": _pct(failover, 0.99), "max": _pct(failover, 1.0)},
        "down_detect_ms": {"p50": _pct(down, 0.5), "p99": _pct(down, 0.99), "max": _pct(down, 1.0), "count": len(down)},
        "join_to_voter_ms": {"p50": _pct(join, 0.5), "p99": _pct(join, 0.99), "max": _pct(join, 1.0), "count": len(join)},
        "converge_ms": {"p50": _pct(converge, 0.5), "p99": _pct(converge, 0.99), "max": _pct(converge, 1.0)},
    }
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
