"""The `p2pmesh` command line: the parser, built from each command module's add_parser, and
the dispatch to the module's run (set as the subparser's `run` default). Every read command
takes --json (the same objects the client API and the HTTP API are built from); the human
output is drawn with rich and is plain text in a pipe.

  p2pmesh agent [--state-dir DIR] [--listen HOST:PORT] [--interface NAME]... [--peer HOST:PORT]...
                [--cluster-key-file FILE] [--advertise HOST:PORT]... [--leave-on-exit] [--http HOST:PORT]
                [--memory-limit BYTES] [--layer-ms MS] [--model-root DIR] [--configure-links] [--copy-over-tls] [--log-level LEVEL] [--log-format text|json]
  p2pmesh status | members [--state-dir DIR | --socket PATH] [--json]
  p2pmesh ring [--json | --mlx-hostfile | --jaccl]          (the committed ring, drawn with its cables)
  p2pmesh ring solve GRAPH.json [--json]                      (plan a cabling)
  p2pmesh load MODEL [--context-tokens N] [--json]            (serve a model; a progress bar until it serves)
  p2pmesh model set NAME [--context-tokens N] | model clear   (commit a model choice and return)
  p2pmesh generate PROMPT [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--json]
  p2pmesh chat [MESSAGE] [--system TEXT] [--json]             (one message, or one per line of stdin)
  p2pmesh watch [--json] [--count N]                          (members, leader, ring, rebalancing, live)
  p2pmesh leave [--timeout S]
  p2pmesh links [--json] | links parse|plan|apply ...
  p2pmesh plan solve SCENARIO.json [--json] [--strategy ours|memory-proportional]
  p2pmesh plan model CONFIG.json [--bits B] [--context-tokens C] [--json]   (size a model before downloading it)
  p2pmesh doctor [--json] [--interface NAME]...               (checks this Mac and says what to fix)
  p2pmesh local --nodes N [--model PATH] [--netns] [--json]   (N agents on this computer)
  p2pmesh service install | uninstall | status [--json]       (start the agent at login)
  p2pmesh key show | key set KEY [--state-dir DIR]
  p2pmesh pair [--join] [--timeout S] [--yes-if-code CODE] [--json]   (a new Mac joins over a cable after a code check)

Exit codes: 0 success; 1 the agent is not reachable, failed or refused; 2 bad usage or
input; 3 the cluster is not ready (no quorum in time, no model loaded).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from p2pmesh.cli import (
    agent_cmd,
    doctor_cmd,
    key_cmd,
    leave_cmd,
    links_cmd,
    local_cmd,
    model_cmd,
    pair_cmd,
    plan_cmd,
    ring_cmd,
    service_cmd,
    status_cmd,
)

COMMAND_MODULES = (agent_cmd, status_cmd, leave_cmd, ring_cmd, doctor_cmd, links_cmd, plan_cmd, local_cmd,
                   service_cmd, model_cmd, pair_cmd, key_cmd)
"""In the order `p2pmesh --help` lists their commands."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pmesh", description="One AI computer from several Macs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run  # the command module's run (its add_parser set it)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
