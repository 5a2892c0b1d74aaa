"""Typed errors: each one says whose fault it is.

- LocalProtocolError: the caller misused an API (our bug or a bad argument).
- RemoteProtocolError: a peer sent something malformed or hostile.
- StateCorrupted: a file on disk failed its checks (the disk's or a previous crash's fault).
- NotLeader: the request must go to the leader; carries a hint when one is known.
"""
from __future__ import annotations


class MeshError(Exception):
    """Base of every p2pmesh error."""

    error_code: str | None = None
    """The agent's machine-readable code (core/protocol.ErrorCode) when this error reports
    an agent's error answer, else None."""


class LocalProtocolError(MeshError):
    """The caller misused an API."""


class RemoteProtocolError(MeshError):
    """A peer sent a malformed or hostile message. The core counts it and drops it."""


class StateCorrupted(MeshError):
    """A state file failed its checksum or could not be parsed."""


class NotLeader(MeshError):
    """This node is not the leader; ``leader_hint`` is the node id it believes leads."""

    def __init__(self, leader_hint: str | None) -> None:
        super().__init__(f"not the leader (leader hint: {leader_hint})")
        self.leader_hint = leader_hint
