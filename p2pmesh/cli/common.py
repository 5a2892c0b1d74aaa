"""What every command shares: the exit codes, the options that name the agent to ask
(--state-dir, --socket) and the state directory, and reading that agent's status.

Exit codes (README): 0 done; 1 the agent is not reachable, failed or refused; 2 bad usage or
input; 3 the cluster is not ready (no quorum in time, no model loaded). A command may give
1 a narrower meaning of its own (plan: the model fits nowhere), said in its module.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, EXIT_NOT_READY = 0, 1, 2, 3
STATUS_TIMEOUT_S = 30.0
"""How long status, members and ring wait for the agent's answer (it answers in
milliseconds; a loaded machine may take longer)."""


def add_state_dir(sp: argparse.ArgumentParser) -> None:
    """--state-dir for commands that own the directory (agent, key): the default is filled in."""
    from p2pmesh.agent import default_state_dir

    sp.add_argument("--state-dir", type=Path, default=default_state_dir(), help="default: %(default)s")


def add_target(sp: argparse.ArgumentParser) -> None:
    """Which agent to ask: --socket, else --state-dir's socket, else $P2PMESH_SOCKET, else the
    default state directory's (the client API's rule)."""
    from p2pmesh.agent import default_state_dir

    sp.add_argument("--state-dir", type=Path, default=None, help=f"the agent's state directory (default: {default_state_dir()})")
    sp.add_argument("--socket", type=Path, default=None, help="the agent's control socket (default: in the state directory)")


def socket_of(args: argparse.Namespace) -> Path | None:
    """The agent to ask, from --socket/--state-dir (None: the client API's default rule)."""
    if getattr(args, "socket", None) is not None:
        return args.socket
    if getattr(args, "state_dir", None) is not None:
        return args.state_dir / "agent.sock"
    return None


class Refused(Exception):
    """Stop a command with this message and exit code (the message says whose fault it is):
    raised where the command finds the problem, said once where the command catches it."""

    code = EXIT_UNAVAILABLE
    """The exit code when the raiser names none (a command's subclass may set its own)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


def failed(message: object, code: int) -> int:
    """Say what went wrong on stderr, the CLI's way (`p2pmesh: ...`), and return `code`."""
    print(f"p2pmesh: {message}", file=sys.stderr)
    return code


def read_status(args: argparse.Namespace) -> dict[str, Any] | None:
    """The asked agent's `status` object, or None once the reason it could not be read was
    said on stderr (exit EXIT_UNAVAILABLE)."""
    from p2pmesh import client

    try:
        return client.Client(socket_of(args)).status_object(timeout=STATUS_TIMEOUT_S)
    except client.P2PMeshError as exc:
        failed(exc, EXIT_UNAVAILABLE)
        return None
