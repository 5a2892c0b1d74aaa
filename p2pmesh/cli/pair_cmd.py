"""`p2pmesh pair [--join]`: let a new Mac into the cluster over a Thunderbolt cable after
both users check a six-digit code (p2pmesh/agent/tasks/pairing.py, docs/pairing.md).

On a Mac of the cluster: `p2pmesh pair`. On the new Mac: `p2pmesh pair --join`. Each
prints the code and asks "same code on the other Mac? [y/N]"; `--yes-if-code CODE` answers
for a script that read the code from the other Mac (tests, provisioning tools). With
--json every event is one JSON line and the answer is read as a line of stdin (y or n).
Exit codes: 0 paired; 1 the agent is not reachable, or pairing did not happen; 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from p2pmesh.agent.tasks import pairing
from p2pmesh.cli.common import add_target, socket_of

if TYPE_CHECKING:
    from p2pmesh.client import Client

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
JOIN_WAIT_S = 60.0
"""How long `pair --join` waits, after the key arrived, to see this Mac in the new cluster."""


def add_parser(subparsers: Any) -> None:
    pair = subparsers.add_parser("pair", help="let a Mac join over a Thunderbolt cable after both users check a code")
    pair.set_defaults(run=run)
    add_target(pair)
    pair.add_argument("--join", action="store_true", help="this is the new Mac: get the key from the Mac at the other end of a cable")
    pair.add_argument("--timeout", type=float, default=pairing.WINDOW_S_DEFAULT, metavar="S",
                      help="give up after this many seconds (default %(default).0f)")
    pair.add_argument("--yes-if-code", default=None, metavar="CODE",
                      help="answer yes only if the code is exactly this (six digits), instead of asking")
    pair.add_argument("--json", action="store_true", help="one JSON event per line")


def _digits(code: str) -> str:
    return "".join(ch for ch in code if ch.isdigit())


def run(args: argparse.Namespace) -> int:
    from p2pmesh import client

    if not 1 <= args.timeout <= pairing.WINDOW_S_MAX:
        print(f"p2pmesh: --timeout must be 1 to {pairing.WINDOW_S_MAX:.0f} seconds", file=sys.stderr)
        return EXIT_USAGE
    if args.yes_if_code is not None and len(_digits(args.yes_if_code)) != 6:
        print("p2pmesh: --yes-if-code takes the six digits the other Mac shows", file=sys.stderr)
        return EXIT_USAGE
    agent = client.Client(socket_of(args))
    final: dict[str, Any] = {}
    try:
        for event in agent.pair(window=args.timeout, answer=lambda e: _answer(args, e), join=args.join):
            if args.json:
                print(json.dumps(event), flush=True)
            else:
                _say(event)
            final = event
    except client.P2PMeshError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not final.get("paired"):
        if not args.json:
            print(f"p2pmesh: not paired: {final.get('error', 'the pairing ended')}", file=sys.stderr)
        return EXIT_FAILED
    if args.join:
        return _wait_to_join(agent, final, args.json)
    return EXIT_OK


def _answer(args: argparse.Namespace, event: dict[str, Any]) -> bool:
    code = str(event.get("code", ""))
    if args.yes_if_code is not None:
        return _digits(args.yes_if_code) == _digits(code)
    if not args.json:
        print("Same code on the other Mac? [y/N] ", end="", flush=True)
    line = sys.stdin.readline()
    return line.strip().lower() in ("y", "yes")


def _say(event: dict[str, Any]) -> None:
    kind = event.get("event")
    if kind == "waiting" and event.get("role") == "host":
        print(f"Pairing is open for {event.get('window_s', 0):.0f} s on this Mac's cables. "
              "On the new Mac, run: p2pmesh pair --join", flush=True)
    elif kind == "waiting":
        print("Looking for a Mac in pairing mode on this Mac's Thunderbolt cables...", flush=True)
    elif kind == "looking":
        print(f"  ({event.get('detail')})", flush=True)
    elif kind == "attempt failed":
        print(f"  a pairing attempt failed: {event.get('reason')}", flush=True)
    elif kind == "code":
        print(f"\n    {event.get('code')}    (Mac {str(event.get('peer'))[:8]})\n", flush=True)
    elif event.get("final") and event.get("paired"):
        if event.get("role") == "host":
            print(f"Paired: Mac {str(event.get('peer'))[:8]} has the cluster key and is joining.", flush=True)
        else:
            print(f"Paired with Mac {str(event.get('peer'))[:8]}: the agent restarts into its cluster...", flush=True)


def _wait_to_join(agent: Client, final: dict[str, Any], as_json: bool) -> int:
    """After the key arrived the agent restarts; wait (bounded) until it is in one cluster
    with the Mac that gave the key."""
    from p2pmesh.client import P2PMeshError

    peer = final.get("peer")
    deadline = time.monotonic() + JOIN_WAIT_S
    while time.monotonic() < deadline:
        try:
            status = agent.status_object(timeout=5.0)
        except P2PMeshError:  # restarting: no socket for a moment
            status = {}
        if peer in {m.get("node_id") for m in status.get("members", [])}:
            members = len(status.get("members", []))
            if as_json:
                print(json.dumps({"event": "joined", "members": members, "cluster_id": status.get("cluster_id")}), flush=True)
            else:
                print(f"Joined: this Mac is one of {members} in the cluster.", flush=True)
            return EXIT_OK
        time.sleep(0.5)
    print(f"p2pmesh: the key is installed, but this Mac did not join within {JOIN_WAIT_S:.0f} s; "
          "`p2pmesh status` shows where it stands", file=sys.stderr)
    return EXIT_FAILED
