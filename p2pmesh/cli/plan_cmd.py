"""`p2pmesh plan solve SCENARIO.json`: the layer placement for a described cluster.

A thin shell over core/placement.py (docs/placement.md): read the file, parse it, solve with
the chosen strategy (ours or the memory-proportional baseline) and parallelism (auto: one
Mac, a pipeline, tensor or hybrid, whichever is fastest), print. Exit codes: 0 a plan, 1 the
model fits nowhere (stderr says how much memory is missing), 2 the file is unreadable or
malformed, or the parallelism asked for cannot be planned from it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE = 0, 1, 2
STRATEGIES = ("ours", "memory-proportional")


def add_parser(subparsers: Any) -> None:
    plan = subparsers.add_parser("plan", help="plan which Mac runs which layers (`plan solve`)")
    plan.set_defaults(run=run)
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    solve = plan_sub.add_parser("solve", help="place a model's layers on a described cluster (docs/placement.md)")
    solve.add_argument("scenario", type=Path, help='SCENARIO.json: {"model": {...}, "nodes": [...], "links": [...]}')
    solve.add_argument("--json", action="store_true", help="print one JSON object")
    solve.add_argument("--strategy", choices=STRATEGIES, default="ours",
                       help="ours (default) or the memory-proportional baseline other systems use")
    solve.add_argument("--objective", choices=("latency", "throughput"), default="latency",
                       help="latency: fastest single stream (default); throughput: fastest slowest stage")
    solve.add_argument("--parallelism", choices=("auto", "pipeline", "tensor", "hybrid"), default="auto",
                       help="auto: the fastest of one Mac, a pipeline, tensor and hybrid (default); "
                            "or only that kind (tensor and hybrid need the model's shape)")


def run(args: argparse.Namespace) -> int:
    from p2pmesh.core.placement import (
        ParallelismError,
        PlacementError,
        memory_proportional,
        parse_current,
        parse_scenario,
        solve_placement,
    )

    try:
        data = json.loads(args.scenario.read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"p2pmesh: cannot read {args.scenario}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        print(f"p2pmesh: {args.scenario} is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        model, nodes, links = parse_scenario(data)
        current, margin = parse_current(data)
    except ValueError as exc:
        print(f"p2pmesh: {args.scenario}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.strategy == "ours":
            plan = solve_placement(model, nodes, links, objective=args.objective, current=current, margin=margin,
                                   parallelism=args.parallelism)
        else:
            plan = memory_proportional(model, nodes, links)
    except ParallelismError as exc:
        print(f"p2pmesh: {args.scenario}: {exc} ({exc.code})", file=sys.stderr)
        return EXIT_USAGE
    except PlacementError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_NO_FIT
    except ValueError as exc:  # e.g. a current plan naming a Mac twice: the input's fault
        print(f"p2pmesh: {args.scenario}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = {"strategy": args.strategy, "objective": args.objective if args.strategy == "ours" else "memory", **plan.to_json()}
    if args.json:
        print(json.dumps(out))
        return EXIT_OK
    _print_plan(plan, [n.node_id for n in nodes])
    return EXIT_OK


def _print_plan(plan: Any, node_ids: list[str]) -> None:
    groups = plan.layout
    if all(len(g.node_ids) == 1 for g in groups):
        width = max(len(s.node_id) for s in plan.stages)
        for k, s in enumerate(plan.stages, 1):
            print(f"stage {k}: {s.node_id:<{width}}  layers {s.start}-{s.end - 1} ({s.layers} layers)")
    else:
        for k, g in enumerate(groups, 1):
            print(f"stage {k}: {' + '.join(g.node_ids)}  layers {g.start}-{g.end - 1} ({g.layers} layers"
                  + (")" if len(g.node_ids) == 1 else ", tensor-parallel)"))
            for nid, sh in zip(g.node_ids, g.shares):
                print(f"  {nid}: {sh.heads} heads ({sh.kv_heads} KV), {sh.columns} MLP columns")
    used = {n for g in groups for n in g.node_ids}
    idle = [n for n in node_ids if n not in used]
    if idle:
        print(f"no layers: {', '.join(idle)}")
    print(f"parallelism: {plan.parallelism}")
    print(f"predicted time per token: {plan.tpot_ms:.3f} ms ({1000 / plan.tpot_ms:.1f} tokens/s single stream); "
          f"slowest stage {plan.bottleneck_ms:.3f} ms")
