"""The client's typed errors: each says whose fault it is and what to do.

The errors an agent's answer maps to are defined with their codes in core/protocol.py (one
table: code -> HTTP status -> client error) and re-exported here; AgentNotRunning is the
client's own (no agent answered at all), and so is AgentTimeout (the client's own bound
passed without a word from the agent).
"""
from __future__ import annotations

from pathlib import Path

from p2pmesh.core.errors import MeshError
from p2pmesh.core.protocol import (
    AgentError,
    BadRequest,
    Busy,
    ModelCannotLoad,
    ModelDoesNotFit,
    ModelNotLoaded,
    ModelRefused,
    NoQuorum,
)

P2PMeshError = MeshError
"""The base of every error p2pmesh raises (the same class as p2pmesh.core.errors.MeshError,
so one `except P2PMeshError` also catches the embedded agent's errors, e.g. StateCorrupted)."""


class AgentNotRunning(P2PMeshError):
    """No agent answers at the socket (nothing started, or a stopped agent's stale socket).
    The environment's to fix: start `p2pmesh agent`, or point the client at the right one."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class AgentTimeout(AgentError):
    """The agent sent nothing within the client's bound (an idle stream, an unanswered
    request): the client gave up, so whether the agent carried the request out is unknown.
    Not an error the agent reported (those have ``error_code``); this one has None."""


__all__ = [
    "AgentError",
    "AgentNotRunning",
    "AgentTimeout",
    "BadRequest",
    "Busy",
    "ModelCannotLoad",
    "ModelDoesNotFit",
    "ModelNotLoaded",
    "ModelRefused",
    "NoQuorum",
    "P2PMeshError",
]
