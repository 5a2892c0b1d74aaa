"""`p2pmesh status` and `p2pmesh members`: this agent's view of the cluster.

  p2pmesh status  [--state-dir DIR | --socket PATH] [--json]   (members, ring, placement)
  p2pmesh members [--state-dir DIR | --socket PATH] [--json]   (leader, term, members)

Both read the agent's `status` over its control socket; --json prints the object itself
(members: its leader, term and members), the human form is drawn by terminal.py.
Exit codes: 0 shown; 1 the agent is not reachable.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from p2pmesh.cli.common import EXIT_OK, EXIT_UNAVAILABLE, add_target, read_status


def add_parser(subparsers: Any) -> None:
    for name, helptext in (("status", "show this agent's view of the cluster"),
                           ("members", "list the cluster's members (leader, voters, learners, up or down)")):
        sp = subparsers.add_parser(name, help=helptext)
        sp.set_defaults(run=run)
        add_target(sp)
        sp.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    status = read_status(args)
    if status is None:
        return EXIT_UNAVAILABLE
    from p2pmesh.cli import terminal

    if args.command == "members":
        if args.json:
            print(json.dumps({"leader": status["leader"], "term": status["term"], "members": status["members"]}))
        else:
            terminal.console().print(terminal.members_table(status))
        return EXIT_OK
    if args.json:
        print(json.dumps(status))
    else:
        terminal.console().print(terminal.status_view(status))
    return EXIT_OK
