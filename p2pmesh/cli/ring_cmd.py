"""`p2pmesh ring`: the committed ring, drawn with its cables, or rendered for MLX; and
`ring solve`, which plans a described cabling before any cable is bought (docs/ring.md).

  p2pmesh ring [--state-dir DIR | --socket PATH] [--json | --mlx-hostfile | --jaccl] [--base-port N]
  p2pmesh ring solve GRAPH.json [--json]

The ring comes from the agent's `status` (core/ring_view.py builds it); the MLX hostfile
and the JACCL device matrix from core/mlx_hostfile.py; the solver is core/ring.py.
Exit codes: 0 shown; 1 the agent is not reachable, no ring is committed, JACCL needs RDMA on
every hop, or the described cabling has no ring; 2 GRAPH.json is unreadable or not JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from p2pmesh.cli.common import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, add_target, failed, read_status


def add_parser(subparsers: Any) -> None:
    ring = subparsers.add_parser("ring", help="show the committed ring, or plan one (`ring solve`)")
    ring.set_defaults(run=run)
    add_target(ring)
    ring.add_argument("--json", action="store_true", help="print the status `ring` object")
    ring.add_argument("--mlx-hostfile", action="store_true", help="print the MLX ring hostfile (MLX_HOSTFILE) of the committed ring")
    ring.add_argument("--jaccl", action="store_true", help="print the JACCL device matrix and coordinator (RDMA rings)")
    ring.add_argument("--base-port", type=int, default=47000, help="first data-plane port (rank i uses base+i)")
    ring_sub = ring.add_subparsers(dest="ring_command", required=False)
    solve = ring_sub.add_parser("solve", help="solve a described cabling (docs/ring.md) and print the ring")
    solve.add_argument("graph", type=Path, help="GRAPH.json: {\"nodes\": [...], \"links\": [...]}")
    solve.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.ring_command == "solve":
        return _solve(args)
    status = read_status(args)
    if status is None:
        return EXIT_UNAVAILABLE
    return _show(args, status)


def _solve(args: argparse.Namespace) -> int:
    from p2pmesh.core.ring import RingError, parse_graph, solve

    try:
        data = json.loads(args.graph.read_text(encoding="utf-8"))
    except OSError as exc:
        return failed(f"cannot read {args.graph}: {exc.strerror}", EXIT_USAGE)
    except ValueError as exc:
        return failed(f"{args.graph} is not JSON: {exc}", EXIT_USAGE)
    try:
        ring = solve(*parse_graph(data))
    except RingError as exc:
        return failed(exc, EXIT_UNAVAILABLE)
    out = ring.to_json()
    if args.json:
        print(json.dumps(out))
        return EXIT_OK
    print(" -> ".join([*out["ring"], out["ring"][0]]))  # type: ignore[list-item]
    for h in ring.hops:
        mark = "" if h.kind == "thunderbolt" else "   <- slow hop"
        print(f"  {h.src} -> {h.dst}: {h.kind} {h.gbps:g} Gb/s, {h.rtt_ms:g} ms{mark}")
    print(f"bottleneck {ring.bottleneck_gbps:g} Gb/s{'' if ring.exact else ' (best found; search budget reached)'}")
    return EXIT_OK


def _show(args: argparse.Namespace, status: dict[str, Any]) -> int:
    ring = status.get("ring") or {"epoch": 0, "order": [], "hops": []}
    if not (args.mlx_hostfile or args.jaccl):
        if args.json:
            print(json.dumps(ring))
        else:
            from p2pmesh.cli import terminal

            terminal.console().print(terminal.ring_text(ring, status["node_id"]))
        return EXIT_OK
    from p2pmesh.core.addressing import AddressingError, ring_from_status
    from p2pmesh.core.mlx_hostfile import MlxConfigError, jaccl_coordinator, jaccl_devices, ring_hostfile

    try:
        view = ring_from_status(status)
        if view is None:
            return failed("no ring is committed yet", EXIT_UNAVAILABLE)
        if args.mlx_hostfile:
            print(json.dumps(ring_hostfile(view.order, view.hops, args.base_port)))
        if args.jaccl:
            devices = jaccl_devices(view.order, view.hops)
            if devices is None:
                return failed("not every hop of the ring is RDMA-capable (JACCL needs Thunderbolt 5 RDMA on every "
                              "cable)", EXIT_UNAVAILABLE)
            rank0 = next((m for m in status["members"] if m["node_id"] == view.order[0]), None)
            address = next((a.rsplit(":", 1)[0] for a in (rank0 or {}).get("addresses", []) if a.count(":") == 1), None)
            coordinator = jaccl_coordinator(view.order, view.hops, args.base_port, rank0_address=address)
            print(json.dumps({"devices": devices, "coordinator": coordinator}))
    except (AddressingError, MlxConfigError) as exc:
        return failed(exc, EXIT_UNAVAILABLE)
    return EXIT_OK
