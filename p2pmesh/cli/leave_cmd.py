"""`p2pmesh leave [--timeout S]`: this Mac leaves the cluster gracefully (a stage it holds
drains first), through the client API.

Exit codes: 0 the agent stopped (with or without the others' confirmation, said in words);
1 the agent is not reachable or refused.
"""
from __future__ import annotations

import argparse
from typing import Any

from p2pmesh.cli.common import EXIT_OK, EXIT_UNAVAILABLE, add_target, failed, socket_of


def add_parser(subparsers: Any) -> None:
    sp = subparsers.add_parser("leave", help="leave the cluster gracefully")
    sp.set_defaults(run=run)
    add_target(sp)
    sp.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the cluster to confirm")


def run(args: argparse.Namespace) -> int:
    from p2pmesh import client

    path, _ = client.locate_socket(socket_of(args))
    try:
        with client.connect(path) as agent:
            left = agent.leave(timeout=args.timeout)
    except client.P2PMeshError as exc:
        return failed(exc, EXIT_UNAVAILABLE)
    print("left the cluster (the others confirmed it)" if left else
          "stopped without the cluster's confirmation (no leader answered in time); the others mark this Mac down")
    return EXIT_OK
