"""The I/O side of data-plane addressing: read this Mac's bridges and IPv4 addresses, and run
the commands core/addressing.py planned.

Only two programs ever run from here, ifconfig and ip, with no shell, each bounded by a
timeout. ``apply`` also checks every argv against the exact shapes the planner produces
(add one address) before running any of them: defence in depth, so a bug upstream can never
turn into "ifconfig bridge0 down" or any other change the user did not agree to.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from p2pmesh.core.addressing import (
    parse_ifconfig_bridge_members,
    parse_ifconfig_ipv4,
    parse_ip_addr_ipv4,
)

ALLOWED_PROGRAMS = frozenset({"ifconfig", "ip"})
# Where the real ifconfig/ip live; a PATH pointing elsewhere must not pick what runs as root.
TRUSTED_DIRS = frozenset({"/sbin", "/usr/sbin", "/bin", "/usr/bin"})
GATHER_TIMEOUT_S = 10.0
OUTPUT_BYTES_MAX = 4 * 1024 * 1024
SYS_CLASS_NET = Path("/sys/class/net")
BRIDGES_MAX = 1024
_IFACE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}"
_CIDR = r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}/\d{1,2}"
# The only argv shapes apply() runs: add one IPv4 address to one interface.
_ALLOWED_SHAPES = (
    re.compile(rf"ifconfig\x00{_IFACE}\x00inet\x00{_CIDR}\x00alias"),
    re.compile(rf"ip\x00addr\x00add\x00{_CIDR}\x00dev\x00{_IFACE}"),
)


class NetconfigError(Exception):
    """Base of this module's errors."""


class CommandRefused(NetconfigError):
    """An argv is not one p2pmesh may run (our bug upstream: nothing was run)."""


class CommandFailed(NetconfigError):
    """A command ran and failed, or timed out; the ones before it were applied."""

    def __init__(self, argv: list[str], returncode: int | None, stderr: str, done: list[CommandResult]) -> None:
        what = "timed out" if returncode is None else f"exited {returncode}"
        detail = f": {stderr.strip()}" if stderr.strip() else ""
        super().__init__(f"`{' '.join(argv)}` {what}{detail}")
        self.argv, self.returncode, self.stderr, self.done = argv, returncode, stderr, done


class GatherError(NetconfigError):
    """This machine's network state could not be read (the OS's fault, or a missing tool)."""


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class LocalNetwork:
    """What this machine looks like right now: bridges with their members, IPv4 addresses."""

    bridges: dict[str, list[str]]
    ipv4: dict[str, tuple[str, ...]]


def check_argv(argv: list[str]) -> str:
    """The absolute program path to run for ``argv``, or CommandRefused saying why not."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise CommandRefused(f"not a command: {argv!r}")
    if argv[0] not in ALLOWED_PROGRAMS:
        raise CommandRefused(f"refusing to run {argv[0]!r}: p2pmesh only runs {', '.join(sorted(ALLOWED_PROGRAMS))}")
    if not any(shape.fullmatch("\x00".join(argv)) for shape in _ALLOWED_SHAPES):
        raise CommandRefused(f"refusing to run `{' '.join(argv)}`: p2pmesh only ever adds an address")
    return _resolve(argv[0])


def _resolve(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise CommandRefused(f"{program} is not installed (looked in PATH)")
    real = os.path.realpath(path)
    if os.path.dirname(path) not in TRUSTED_DIRS and os.path.dirname(real) not in TRUSTED_DIRS:
        raise CommandRefused(f"refusing {path}: {program} must come from {', '.join(sorted(TRUSTED_DIRS))}")
    return path


async def _run(argv: list[str], program: str, timeout_s: float) -> tuple[int | None, str, str]:
    """Run without a shell; returncode None means it timed out (and was killed)."""
    with trio.move_on_after(timeout_s):
        done = await trio.run_process([program, *argv[1:]], capture_stdout=True, capture_stderr=True,
                                      check=False, stdin=b"")
        out = done.stdout[:OUTPUT_BYTES_MAX].decode("utf-8", "replace")
        err = done.stderr[:OUTPUT_BYTES_MAX].decode("utf-8", "replace")
        return done.returncode, out, err
    return None, "", ""


async def apply(commands: list[list[str]], *, timeout_s: float = 10) -> list[CommandResult]:
    """Run each argv in order, stopping at the first failure (CommandFailed names it and
    carries the results of those already applied). Every argv is checked before the first
    one runs, so a refused list changes nothing."""
    programs = [check_argv(argv) for argv in commands]
    results: list[CommandResult] = []
    for argv, program in zip(commands, programs):
        try:
            code, out, err = await _run(argv, program, timeout_s)
        except OSError as exc:
            raise CommandFailed(argv, -1, f"cannot start it: {exc}", list(results)) from None
        if code != 0:
            raise CommandFailed(argv, code, err, list(results))
        results.append(CommandResult(tuple(argv), code, out, err))
    return results


async def _read_only(argv: list[str], timeout_s: float) -> str:
    try:
        program = _resolve(argv[0])
    except CommandRefused as exc:
        raise GatherError(str(exc)) from None
    try:
        code, out, err = await _run(argv, program, timeout_s)
    except OSError as exc:
        raise GatherError(f"cannot run {argv[0]}: {exc}") from None
    if code != 0:
        what = "timed out" if code is None else f"exited {code}: {err.strip()}"
        raise GatherError(f"`{' '.join(argv)}` {what}")
    return out


def _linux_bridges(root: Path = SYS_CLASS_NET) -> dict[str, list[str]]:
    """/sys/class/net/<bridge>/brif/ lists a bridge's ports (Linux has no ifconfig member lines)."""
    bridges: dict[str, list[str]] = {}
    try:
        names = sorted(os.listdir(root))[:BRIDGES_MAX * 4]
    except OSError as exc:
        raise GatherError(f"cannot list {root}: {exc.strerror}") from None
    for name in names:
        brif = root / name / "brif"
        if brif.is_dir() and len(bridges) < BRIDGES_MAX:
            try:
                bridges[name] = sorted(os.listdir(brif))
            except OSError:
                continue  # the bridge vanished while we looked
    return bridges


async def gather_local(*, timeout_s: float = GATHER_TIMEOUT_S) -> LocalNetwork:
    """This machine's bridges and IPv4 addresses (macOS: one `ifconfig`; Linux: /sys and
    `ip -4 -o addr show`). Read-only."""
    if sys.platform == "darwin":
        text = await _read_only(["ifconfig"], timeout_s)
        return LocalNetwork(parse_ifconfig_bridge_members(text), parse_ifconfig_ipv4(text))
    if sys.platform.startswith("linux"):
        text = await _read_only(["ip", "-4", "-o", "addr", "show"], timeout_s)
        return LocalNetwork(_linux_bridges(), parse_ip_addr_ipv4(text))
    raise GatherError(f"reading the network on {sys.platform} is not supported (macOS and Linux are)")


async def gather_bridges(*, timeout_s: float = GATHER_TIMEOUT_S) -> dict[str, list[str]]:
    """Bridge -> member interfaces on this machine."""
    if sys.platform.startswith("linux"):
        return _linux_bridges()
    return (await gather_local(timeout_s=timeout_s)).bridges
