"""`p2pmesh links`: Thunderbolt links, and the IPv4 addresses the ring's cables need.

  p2pmesh links parse --system-profiler FILE [--networksetup FILE] [--json]
  p2pmesh links plan  [--json] [--status-file FILE] [--state-dir DIR]
  p2pmesh links apply [--yes]  [--status-file FILE] [--state-dir DIR]

`parse` reads files only (it never runs system_profiler itself), so a capture from another
Mac, or a bug report, can be checked anywhere; the parsing lives in p2pmesh.platform.thunderbolt.

`plan` reads the committed ring (from the running agent, or a saved `p2pmesh status --json`)
and prints the exact commands this Mac would run to give its ring cables their addresses
(p2pmesh.core.addressing), plus bridge warnings. It changes nothing. `apply` prints the same
plan, asks for confirmation (on a terminal, unless --yes) and runs the commands through
p2pmesh.drivers.netconfig. See docs/links.md. cli/app.py calls add_parser/run.

Exit codes: 0 success or nothing to do; 1 a command failed (or this Mac's network could not
be read); 2 unreadable or malformed input, no ring, not confirmed, or an unsafe plan.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from p2pmesh.cli.common import Refused, failed
from p2pmesh.core.addressing import (
    AddressingError,
    Assignment,
    RingView,
    bridge_warnings,
    commands_for,
    local_conflicts,
    plan_addresses,
    ring_from_status,
    unaddressed_hops,
)
from p2pmesh.drivers import netconfig
from p2pmesh.platform.thunderbolt import CaptureError, local_ports, to_json

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(subparsers: Any) -> None:
    """Add `links parse|plan|apply` to an argparse subparsers object (from add_subparsers())."""
    links = subparsers.add_parser(
        "links", help="show this Mac's ports live (no subcommand); parse captures; address the ring's cables"
    )
    links.set_defaults(run=run)
    links.add_argument("--json", action="store_true", help="with no subcommand: the live ports as JSON")
    links_sub = links.add_subparsers(dest="links_command", metavar="{parse,plan,apply}")
    parse = links_sub.add_parser("parse", help="parse saved system_profiler/networksetup captures")
    parse.add_argument(
        "--system-profiler",
        dest="system_profiler",
        type=Path,
        required=True,
        metavar="FILE",
        help="output of `system_profiler SPThunderboltDataType -json`",
    )
    parse.add_argument(
        "--networksetup",
        type=Path,
        default=None,
        metavar="FILE",
        help="output of `networksetup -listallhardwareports` (maps ports to enX)",
    )
    parse.add_argument("--json", action="store_true")
    for name, helptext in (
        ("plan", "print the commands that would give this Mac's ring cables their IPv4 addresses (changes nothing)"),
        ("apply", "print the plan, ask, then run it (adds addresses only; undone at reboot)"),
    ):
        sp = links_sub.add_parser(name, help=helptext, description=helptext)
        sp.add_argument("--status-file", type=Path, default=None, metavar="FILE",
                        help="a saved `p2pmesh status --json` (default: ask the running agent)")
        sp.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                        help="the agent's state directory, where its control socket is (default: the agent's default)")
        if name == "plan":
            sp.add_argument("--json", action="store_true")
        else:
            sp.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def run(args: argparse.Namespace) -> int:
    """Execute a `links` subcommand; prints to stdout, errors to stderr as `p2pmesh: ...`."""
    command = getattr(args, "links_command", None)
    if command is None:
        return _show(args)
    if command in ("plan", "apply"):
        return _plan_or_apply(args)
    return _parse(args)


def _show(args: argparse.Namespace) -> int:
    """The live ports of this machine, as the agent's link watcher sees them (system_profiler,
    networksetup, ifconfig on a Mac; sysfs and `ip` on Linux)."""
    import trio

    from p2pmesh.drivers.linkwatch import ToolError, detect_ports

    try:
        ports = trio.run(detect_ports)
    except (ToolError, CaptureError) as exc:
        print(f"p2pmesh: cannot read this machine's ports: {exc}", file=sys.stderr)
        return EXIT_FAILED
    rows = [
        {"interface": p.interface, "kind": p.kind, "domain_uuid": p.domain_uuid, "peer_domain_uuid": p.peer_domain_uuid,
         "up": p.up, "gbps": p.gbps, "ipv4": list(p.ipv4), "rdma": p.rdma}
        for p in ports
    ]
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    if not rows:
        print("no network ports found")
    for r in rows:
        peer = f" -> peer {r['peer_domain_uuid']}" if r["peer_domain_uuid"] else ""
        speed = f" {r['gbps']:g} Gb/s" if r["gbps"] else ""
        print(f"{r['interface']:14} {r['kind']:11} {'up' if r['up'] else 'down':4}{speed}{peer} {' '.join(r['ipv4'])}")
    return EXIT_OK


def _read(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CaptureError(f"cannot read {what} file {str(path)!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CaptureError(f"{what} file {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def _parse(args: argparse.Namespace) -> int:
    """`links parse`."""
    try:
        sp_text = _read(args.system_profiler, "system_profiler")
        ns_text = _read(args.networksetup, "networksetup") if args.networksetup is not None else None
        try:
            ports = local_ports(sp_text, ns_text)
        except CaptureError as e:
            # Name the file too: with two inputs the message alone may not say which is bad.
            raise CaptureError(f"{e} (in {str(args.system_profiler)!r}"
                               + (f" / {str(args.networksetup)!r})" if ns_text is not None else ")")) from None
    except CaptureError as e:
        print(f"p2pmesh: {e}", file=sys.stderr)
        return EXIT_USAGE
    rows = to_json(ports)
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    header = ("PORT", "IFACE", "CONNECTED", "GBPS", "PEER DOMAIN")
    table = [header] + [
        (
            r["port"],
            r["interface"] or "-",
            "yes" if r["connected"] else "no",
            "-" if r["speed_gbps"] is None else f"{r['speed_gbps']:g}",
            r["peer_domain_uuid"] or "-",
        )
        for r in rows
    ]
    # Captures may carry any text (even lone surrogates from a JSON escape); keep print safe.
    table = [tuple(c.encode("utf-8", "backslashreplace").decode("utf-8") for c in row) for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# links plan / links apply


class _Refused(Refused):
    """links plan/apply refuse mostly over their input (the status, the flags): bad usage."""

    code = EXIT_USAGE


@dataclass(frozen=True)
class _Plan:
    view: RingView
    assignments: list[Assignment]
    commands: list[list[str]]
    warnings: list[str]
    conflicts: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.view.node_id,
            "epoch": self.view.epoch,
            "assignments": [asdict(a) for a in self.assignments],
            "commands": self.commands,
            "warnings": self.warnings + self.conflicts,
        }


def _platform() -> str:
    if sys.platform == "darwin":
        return "darwin"
    if sys.platform.startswith("linux"):
        return "linux"
    raise _Refused(f"addressing links is supported on macOS and Linux, not {sys.platform}")


def _status(args: argparse.Namespace) -> Any:
    """The status object: from --status-file, else from the agent's control socket."""
    if args.status_file is not None:
        try:
            return json.loads(args.status_file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise _Refused(f"cannot read {args.status_file}: {exc.strerror or exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Refused(f"{args.status_file} is not a JSON status (save one with `p2pmesh status --json`): {exc}") from None
    # The agent owns where its state and socket live; ask it rather than restating the rule.
    from p2pmesh.agent import AgentConfig, default_state_dir
    from p2pmesh.client import Client, P2PMeshError

    state_dir = args.state_dir if args.state_dir is not None else default_state_dir()
    try:
        return Client(AgentConfig(state_dir=state_dir).socket_path).status_object()
    except P2PMeshError as exc:
        hint = ""
        if args.state_dir is None and os.environ.get("SUDO_USER") and os.geteuid() == 0:
            hint = (" (under sudo the default state directory is root's: pass --state-dir, or save "
                    "`p2pmesh status --json > ring.json` first and pass --status-file ring.json)")
        raise _Refused(f"cannot read the ring: {exc}{hint}") from None


def _gather() -> netconfig.LocalNetwork:
    import trio

    try:
        return trio.run(netconfig.gather_local)
    except OSError as exc:  # e.g. /sys unreadable: the same story as a failed ifconfig
        raise netconfig.GatherError(str(exc)) from None


def _make_plan(view: RingView, platform: str, local: netconfig.LocalNetwork | None, notes: list[str]) -> _Plan:
    assignments = plan_addresses(view.hops)
    ipv4 = local.ipv4 if local is not None else {}
    commands = commands_for(view.node_id, assignments, platform, present=ipv4)
    mine = sorted({a.interface for a in assignments if a.node_id == view.node_id})
    warnings = unaddressed_hops([h for h in view.hops if view.node_id in (h.src, h.dst)])
    if local is not None:
        warnings += bridge_warnings(local.bridges, mine, platform=platform)
    conflicts = local_conflicts(view.node_id, assignments, ipv4)
    return _Plan(view, assignments, commands, warnings + notes, conflicts)


def _print_plan(plan: _Plan, *, applying: bool) -> None:
    view = plan.view
    me = view.node_id
    print(f"ring epoch {view.epoch}: {len(view.order)} Macs; this Mac is {me[:8]}")
    by_cable: dict[str, list[Assignment]] = {}
    for a in plan.assignments:
        by_cable.setdefault(a.cable, []).append(a)
    for ends in by_cable.values():
        mine = [a for a in ends if a.node_id == me]
        theirs = [a for a in ends if a.node_id != me]
        if not mine or not theirs:
            continue
        a, b = mine[0], theirs[0]
        prefix = f"/{a.prefix}" if a.prefix is not None else ""
        state = "kept" if a.reused else "new"
        print(f"  {a.interface}: {a.address}{prefix} ({state}), cable to {b.node_id[:8]} {b.interface} {b.address}")
    if me not in view.order:
        print(f"nothing to do: this Mac is not in ring epoch {view.epoch}")
    elif not plan.commands:
        print("nothing to do: this Mac's ring cables already have their addresses")
    else:
        print("commands (they add addresses only, and last until reboot):" if applying
              else "this Mac would run (nothing is changed by `plan`; `p2pmesh links apply` runs them):")
        # Both shapes carry the address at argv[3] ("ifconfig IF inet A/30 alias", "ip addr add A/30 dev IF").
        peer_of = {a.cable: a for a in plan.assignments if a.node_id != me}
        mine_by_address = {a.address: a for a in plan.assignments if a.node_id == me}
        for argv in plan.commands:
            a = mine_by_address.get(argv[3].split("/", 1)[0])
            peer = peer_of.get(a.cable) if a is not None else None
            note = f"    # {a.interface}: cable to {peer.node_id[:8]} {peer.interface}" if a and peer else ""
            print(f"  {' '.join(argv)}{note}")
    for w in plan.warnings + plan.conflicts:
        print(f"warning: {w}")


def _confirm(count: int, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise _Refused("not changing the network without confirmation: run on a terminal, or pass --yes")
    try:
        answer = input(f"run these {count} command(s)? [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise _Refused("nothing changed")


def _apply(commands: list[list[str]]) -> int:
    import trio

    try:
        results = trio.run(netconfig.apply, commands)
    except netconfig.CommandFailed as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        for r in exc.done:
            print(f"p2pmesh: already applied: {' '.join(r.argv)}", file=sys.stderr)
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            print("p2pmesh: adding addresses needs root: try `sudo p2pmesh links apply`", file=sys.stderr)
        return EXIT_FAILED
    except netconfig.CommandRefused as exc:
        print(f"p2pmesh: {exc} (a p2pmesh bug: nothing was run)", file=sys.stderr)
        return EXIT_FAILED
    print(f"applied {len(results)} command(s); they last until this Mac restarts")
    return EXIT_OK


def _plan_or_apply(args: argparse.Namespace) -> int:
    applying = args.links_command == "apply"
    try:
        platform = _platform()
        try:
            view = ring_from_status(_status(args))
        except AddressingError as exc:
            raise _Refused(f"the status is malformed: {exc}") from None
        if view is None:
            raise _Refused("no ring is committed yet: nothing to address (see `p2pmesh status`)")
        local = None
        notes: list[str] = []
        try:
            local = _gather()
        except netconfig.GatherError as exc:
            if applying:
                raise _Refused(f"cannot read this machine's network, so not changing it: {exc}", EXIT_FAILED) from None
            notes.append(f"cannot read this machine's network ({exc}): bridges not checked, present addresses not skipped")
        try:
            plan = _make_plan(view, platform, local, notes)
        except AddressingError as exc:
            raise _Refused(f"cannot plan addresses for ring epoch {view.epoch}: {exc}") from None
        if not applying and args.json:
            print(json.dumps(plan.to_json()))
            return EXIT_OK
        _print_plan(plan, applying=applying)
        if not applying or not plan.commands:
            return EXIT_OK
        if plan.conflicts:
            raise _Refused("not applying: the plan clashes with this Mac's own addresses (see the warnings)")
        _confirm(len(plan.commands), args.yes)
    except _Refused as exc:
        return failed(exc, exc.code)
    return _apply(plan.commands)
