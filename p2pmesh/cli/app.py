"""The `p2pmesh` command line. Every read command takes --json (the same objects the
client API and the HTTP API are built from); the human output is drawn with rich and is
plain text in a pipe.

  p2pmesh agent [--state-dir DIR] [--listen HOST:PORT] [--interface NAME]... [--peer HOST:PORT]...
                [--cluster-key-file FILE] [--advertise HOST:PORT]... [--leave-on-exit] [--http HOST:PORT]
                [--memory-limit BYTES] [--layer-ms MS] [--model-root DIR] [--configure-links] [--log-level LEVEL] [--log-format text|json]
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
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2


def _positive_ms(text: str) -> float:
    """A time per layer in milliseconds: finite and above zero."""
    from p2pmesh.core.validate import LAYER_MS_MAX

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value < LAYER_MS_MAX):
        raise argparse.ArgumentTypeError(f"must be above 0 and below {LAYER_MS_MAX:g} ms, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    from p2pmesh.agent import default_state_dir

    p = argparse.ArgumentParser(prog="p2pmesh", description="One AI computer from several Macs.")
    sub = p.add_subparsers(dest="command", required=True)

    def state_dir(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--state-dir", type=Path, default=default_state_dir(), help="default: %(default)s")

    def target(sp: argparse.ArgumentParser) -> None:
        """Which agent to ask: --socket, else --state-dir's socket, else $P2PMESH_SOCKET,
        else the default state directory's (the client API's rule)."""
        sp.add_argument("--state-dir", type=Path, default=None, help=f"the agent's state directory (default: {default_state_dir()})")
        sp.add_argument("--socket", type=Path, default=None, help="the agent's control socket (default: in the state directory)")

    agent = sub.add_parser("agent", help="run the agent (the same on every Mac, no options needed)")
    state_dir(agent)
    agent.add_argument("--listen", action="append", default=[], help="HOST:PORT to accept peers on (repeatable; default :7741, every IPv4 and IPv6 address)")
    agent.add_argument("--no-mdns", action="store_true", help="do not advertise or browse with zeroconf (static peers only)")
    agent.add_argument("--interface", action="append", default=[], help="network interface to use (repeatable)")
    agent.add_argument("--peer", action="append", default=[], help="static peer HOST:PORT where multicast is blocked")
    agent.add_argument("--advertise", action="append", default=[], help="HOST:PORT peers should dial (default: --listen)")
    agent.add_argument("--cluster-key-file", type=Path, default=None)
    agent.add_argument("--leave-on-exit", action="store_true", help="leave the cluster gracefully on SIGINT/SIGTERM")
    agent.add_argument(
        "--configure-links",
        action="store_true",
        help="add the data-plane IPv4 addresses `p2pmesh links plan` prints (never done without this flag)",
    )
    agent.add_argument("--memory-limit", type=int, default=None, metavar="BYTES",
                       help="offer at most this much memory for model layers (default: what the Mac allows)")
    agent.add_argument("--layer-ms", type=_positive_ms, default=None, metavar="MS",
                       help="report this time per layer instead of the measured one (a Mac that is "
                            "busy with other work while it measures, or whose timing you know)")
    agent.add_argument("--data-port", type=int, default=47000, help="first port of the data-plane workers")
    agent.add_argument("--model-root", type=Path, default=None, metavar="DIR",
                       help="look up model names that are relative paths here (a model only this Mac has is "
                            "copied to the others over the cluster's links)")
    agent.add_argument("--http", default="127.0.0.1:7780", metavar="HOST:PORT",
                       help="serve the OpenAI-compatible HTTP API here (default %(default)s; docs/http.md)")
    agent.add_argument("--http-token", default=None, metavar="TOKEN",
                       help="require this bearer token on every HTTP request (default: $P2PMESH_HTTP_TOKEN); "
                            "needed for a non-loopback --http")
    agent.add_argument("--no-http", action="store_true", help="do not serve the HTTP API")
    agent.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    agent.add_argument("--log-format", default="text", choices=["text", "json"])

    for name, helptext in (("status", "show this agent's view of the cluster"),
                           ("members", "list the cluster's members (leader, voters, learners, up or down)"),
                           ("leave", "leave the cluster gracefully")):
        sp = sub.add_parser(name, help=helptext)
        target(sp)
        if name != "leave":
            sp.add_argument("--json", action="store_true")
        else:
            sp.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the cluster to confirm")

    ring = sub.add_parser("ring", help="show the committed ring, or plan one (`ring solve`)")
    target(ring)
    ring.add_argument("--json", action="store_true", help="print the status `ring` object")
    ring.add_argument("--mlx-hostfile", action="store_true", help="print the MLX ring hostfile (MLX_HOSTFILE) of the committed ring")
    ring.add_argument("--jaccl", action="store_true", help="print the JACCL device matrix and coordinator (RDMA rings)")
    ring.add_argument("--base-port", type=int, default=47000, help="first data-plane port (rank i uses base+i)")
    ring_sub = ring.add_subparsers(dest="ring_command", required=False)
    solve = ring_sub.add_parser("solve", help="solve a described cabling (docs/ring.md) and print the ring")
    solve.add_argument("graph", type=Path, help="GRAPH.json: {\"nodes\": [...], \"links\": [...]}")
    solve.add_argument("--json", action="store_true")

    from p2pmesh.cli import doctor_cmd, links_cmd, local_cmd, plan_cmd, service_cmd

    doctor_cmd.add_parser(sub)
    links_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    local_cmd.add_parser(sub)
    service_cmd.add_parser(sub)

    from p2pmesh.cli import model_cmd, pair_cmd

    model_cmd.add_parsers(sub, target)
    pair_cmd.add_parser(sub, target)

    key = sub.add_parser("key", help="show or install the cluster key")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    show = key_sub.add_parser("show", help="print the cluster key (install it on another Mac with `key set`)")
    state_dir(show)
    setk = key_sub.add_parser("set", help="install a cluster key before starting the agent")
    setk.add_argument("key")
    state_dir(setk)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "agent":
        return _agent(args)
    if args.command in ("status", "members", "leave"):
        return _ask(args)
    if args.command == "ring":
        return _ring_solve(args) if args.ring_command == "solve" else _ask(args)
    if args.command == "links":
        from p2pmesh.cli import links_cmd

        return links_cmd.run(args)
    if args.command in ("load", "model", "generate", "chat", "watch"):
        from p2pmesh.cli import model_cmd

        return model_cmd.run(args, _socket(args))
    if args.command == "pair":
        from p2pmesh.cli import pair_cmd

        return pair_cmd.run(args, _socket(args))
    if args.command == "local":
        from p2pmesh.cli import local_cmd

        return local_cmd.run(args)
    if args.command == "plan":
        from p2pmesh.cli import plan_cmd

        return plan_cmd.run(args)
    if args.command == "doctor":
        from p2pmesh.cli import doctor_cmd

        return doctor_cmd.run(args)
    if args.command == "service":
        from p2pmesh.cli import service_cmd

        return service_cmd.run(args)
    return _key(args)


def _ring_solve(args: argparse.Namespace) -> int:
    from p2pmesh.core.ring import RingError, parse_graph, solve

    try:
        data = json.loads(args.graph.read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"p2pmesh: cannot read {args.graph}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"p2pmesh: {args.graph} is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        ring = solve(*parse_graph(data))
    except RingError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
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


def _agent(args: argparse.Namespace) -> int:
    import trio

    from p2pmesh.agent import AgentConfig, configure_logging, run_agent
    from p2pmesh.core.errors import StateCorrupted
    from p2pmesh.drivers.keys import KeyError_

    from p2pmesh import http_api

    configure_logging(args.log_level, args.log_format)
    try:
        http = None if args.no_http else http_api.endpoint(args.http, args.http_token or os.environ.get(http_api.TOKEN_ENV))
    except http_api.HttpConfigError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = AgentConfig(
        state_dir=args.state_dir,
        # Every family: the agent advertises its interfaces' IPv6 link-local addresses too.
        listen=tuple(args.listen) or AgentConfig.listen,
        mdns=not args.no_mdns,
        peers=tuple(args.peer),
        interfaces=tuple(args.interface),
        cluster_key_file=args.cluster_key_file,
        advertise=tuple(args.advertise),
        leave_on_exit=args.leave_on_exit,
        configure_links=args.configure_links,
        memory_limit_bytes=args.memory_limit,
        layer_ms=args.layer_ms,
        data_port_base=args.data_port,
        model_root=args.model_root,
        http=http,
    )
    try:
        return trio.run(run_agent, config)
    except StateCorrupted as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyError_, ValueError) as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"p2pmesh: cannot start the agent: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BaseExceptionGroup as group:  # a failure inside the agent's nurseries
        found = http_api.find_config_error(group)
        if found is None:
            raise
        print(f"p2pmesh: {found}", file=sys.stderr)
        return EXIT_UNAVAILABLE


def _socket(args: argparse.Namespace) -> Path | None:
    """The agent to ask, from --socket/--state-dir (None: the client API's default rule)."""
    if getattr(args, "socket", None) is not None:
        return args.socket
    if getattr(args, "state_dir", None) is not None:
        return args.state_dir / "agent.sock"
    return None


def _ask(args: argparse.Namespace) -> int:
    from p2pmesh.client import locate_socket
    from p2pmesh.drivers.control import ControlError, request

    path, _ = locate_socket(_socket(args))
    if args.command == "leave":
        return _leave(path, args.timeout)
    try:
        answer = request(path, "status", timeout_s=30.0)
    except ControlError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    status = answer["status"]
    if args.command == "ring":
        return _ring_show(args, status)
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


def _leave(path: Path, timeout_s: float) -> int:
    from p2pmesh import client

    try:
        with client.connect(path) as agent:
            left = agent.leave(timeout=timeout_s)
    except client.P2PMeshError as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print("left the cluster (the others confirmed it)" if left else
          "stopped without the cluster's confirmation (no leader answered in time); the others mark this Mac down")
    return EXIT_OK


def _ring_show(args: argparse.Namespace, status: dict[str, Any]) -> int:
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
            print("p2pmesh: no ring is committed yet", file=sys.stderr)
            return EXIT_UNAVAILABLE
        if args.mlx_hostfile:
            print(json.dumps(ring_hostfile(view.order, view.hops, args.base_port)))
        if args.jaccl:
            devices = jaccl_devices(view.order, view.hops)
            if devices is None:
                print("p2pmesh: not every hop of the ring is RDMA-capable (JACCL needs Thunderbolt 5 RDMA on every cable)", file=sys.stderr)
                return EXIT_UNAVAILABLE
            rank0 = next((m for m in status["members"] if m["node_id"] == view.order[0]), None)
            address = next((a.rsplit(":", 1)[0] for a in (rank0 or {}).get("addresses", []) if a.count(":") == 1), None)
            coordinator = jaccl_coordinator(view.order, view.hops, args.base_port, rank0_address=address)
            print(json.dumps({"devices": devices, "coordinator": coordinator}))
    except (AddressingError, MlxConfigError) as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return EXIT_OK


def _key(args: argparse.Namespace) -> int:
    from p2pmesh.drivers import keys

    path = args.state_dir / keys.KEY_FILE
    if args.key_command == "show":
        if not path.exists():
            print(f"p2pmesh: no cluster key in {args.state_dir} yet; start the agent once, or install one with `p2pmesh key set`", file=sys.stderr)
            return EXIT_UNAVAILABLE
        try:
            print(keys.format_key(keys.read_key(path)))
        except keys.KeyError_ as exc:
            print(f"p2pmesh: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return EXIT_OK
    try:
        key = keys.parse_key(args.key)
    except keys.KeyError_ as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_USAGE
    keys.write_key(path, key)
    print(f"cluster key installed in {path}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
