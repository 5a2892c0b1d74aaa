"""`p2pmesh plan solve SCENARIO.json`: the layer placement for a described cluster; `p2pmesh
plan model CONFIG.json`: the model block of such a scenario from a Hugging Face config.json.

Thin shells over core/placement.py and core/model_size.py (docs/placement.md): read the file,
parse it, solve with the chosen strategy (ours or the memory-proportional baseline) and
parallelism (auto: one Mac, a pipeline, tensor or hybrid, whichever is fastest), print. Exit
codes: 0 a plan (or a model block), 1 the model fits nowhere (stderr says how much memory is
missing), 2 the file is unreadable or malformed (the message names the field), or the
parallelism asked for cannot be planned from it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from p2pmesh.core.protocol import CONTEXT_TOKENS_DEFAULT

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE = 0, 1, 2
STRATEGIES = ("ours", "memory-proportional")


def add_parser(subparsers: Any) -> None:
    plan = subparsers.add_parser("plan", help="plan which Mac runs which layers (`plan solve`, `plan model`)")
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
    model = plan_sub.add_parser("model", help="size a model from its config.json, before downloading it "
                                "(the model block of a plan solve scenario)")
    model.add_argument("config", type=Path, help="a Hugging Face config.json")
    model.add_argument("--bits", type=int, default=None,
                       help="weights' quantization: 16 (bf16) or 2-8 (MLX affine, groups of 64); "
                            "default the config's own quantization, else 16")
    model.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS_DEFAULT,
                       help=f"context the KV cache is sized for (default {CONTEXT_TOKENS_DEFAULT})")
    model.add_argument("--json", action="store_true", help="print the model block as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.plan_command == "model":
        return _run_model(args)
    from p2pmesh.core.placement import (
        ParallelismError,
        PlacementError,
        memory_proportional,
        parse_current,
        parse_scenario,
        solve_placement,
    )

    data = _read_json(args.scenario)
    if data is None:
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


def _read_json(path: Path) -> Any:
    """The parsed file, or None after saying on stderr why it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"p2pmesh: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        print(f"p2pmesh: {path} is not JSON: {exc}", file=sys.stderr)
    return None


def _run_model(args: argparse.Namespace) -> int:
    from p2pmesh.core.model_size import ModelSizeError, billions, gigabytes, planner_model

    config = _read_json(args.config)
    if config is None:
        return EXIT_USAGE
    try:
        block = planner_model(config, args.bits, args.context_tokens)
    except ModelSizeError as exc:
        print(f"p2pmesh: {args.config}: {exc} (field {exc.field})", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(block))
        return EXIT_OK
    b = block
    experts = (f"{b['experts']} experts, {b['experts_per_token']} per token" if b["experts"] else "dense")
    print(f"{b['model_type'] or 'model'}: {b['layers']} layers, {experts}, {b['bits']}-bit weights")
    print(f"parameters: {billions(b['total_params'])} total, {billions(b['active_params'])} read per token")
    print(f"memory: {gigabytes(b['total_bytes'])} of weights{' (every expert)' if b['experts'] else ''}; largest layer "
          f"{gigabytes(b['layer_bytes'])}, embeddings/head {gigabytes(b['embed_bytes'])}")
    print(f"per token: {gigabytes(b['active_bytes_per_token'])} of weights read "
          f"({gigabytes(b['active_layer_bytes'])} a layer on average)")
    kv_total = b["kv_bytes_per_token_per_layer"] * b["layers"] * b["context_tokens"]
    print(f"KV cache: {b['kv_bytes_per_token_per_layer']} bytes per token per layer at {b['context_tokens']} tokens "
          f"({gigabytes(kv_total)} for one full context)")
    print("paste `--json`'s object as the \"model\" of a `p2pmesh plan solve` scenario")
    return EXIT_OK
