"""What a chaos run observes, the same records for real agents and the simulator
(sim/history.py collects them into a History and judges it; sim/linearizability.py judges
the reads):

- ``ReadOp``: a client's membership read: when it was invoked and when it completed, and
  either the committed membership it returned (``MemberView``), a clear error, or, when it
  was neither, what was wrong (``unclear``);
- ``Ack``: a write acknowledged to its client: a confirmed graceful leave (the leaver
  applied its own removal at ``index``);
- ``LogSample``: what one process reported as committed at one moment: its commit index
  and committed entries as (index, term, digest) over a window;
- ``Violation``: an invariant a history breaks, and how.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemberView:
    cluster: str
    index: int
    """The reader's applied index when it answered: the register's version."""
    members: frozenset[tuple[str, int, bool, bool]]
    """(node id, incarnation, voter, up) of every member."""


@dataclass(frozen=True, slots=True)
class ReadOp:
    host: int
    invoke_s: float
    complete_s: float
    view: MemberView | None = None
    error: str | None = None
    unclear: str | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    at_s: float
    cluster: str
    index: int
    removed: tuple[str, int] | None = None
    """The (node id, incarnation) whose removal was acknowledged."""


@dataclass(frozen=True, slots=True)
class LogSample:
    at_s: float
    host: int
    proc: int
    """The process (pid; in the simulator the boot generation): commit only grows within one."""
    cluster: str
    inc: int
    """The incarnation: a fresh one (a merge, a rejoin) starts a new log, from commit 0."""
    commit: int
    entries: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str
