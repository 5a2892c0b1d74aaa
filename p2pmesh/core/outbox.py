"""The Ready/advance handshake: what the machine has handed out, and what is on the disk.

Every input yields one ``Ready`` (consensus output, core/node_io.py). The driver makes its
durable part durable, sends its messages, then calls ``Machine.advance(ready)``: the core
records what the driver's disk now holds (the hard state, the last log index: ``Status``'s
``durable_index``) and releases the Ready's ``Effects``, which may be observed only once it
is durable. This is etcd-io/raft's Ready and Advance, with one difference: where etcd
panics on a misuse, this raises ``ReadyError`` with a machine-readable ``code``.

Two kinds of driver:
- **strict** (the agent, the core tests): one Ready at a time. Calling ``handle`` again
  while a Ready that carries anything is not advanced raises ``NOT_ADVANCED``.
- **pipelined** (the simulator): the node keeps handling inputs while its disk syncs, as
  etcd's asynchronous storage writes. Readies with a durable part are advanced in the order
  they were made; one with none (messages, reads, effects only) as soon as it was made,
  since nothing of it waits for the disk. Anything else raises ``OUT_OF_ORDER``.

A Ready with nothing in it and no effects is never held: advancing it returns no effects.
"""
from __future__ import annotations

from enum import StrEnum

from p2pmesh.core.errors import LocalProtocolError
from p2pmesh.core.ids import ClusterId
from p2pmesh.core.node_io import NO_EFFECTS, ClusterEvent, Effects, NodeHardState, PersistedState, Ready
from p2pmesh.core.serving import ClientEvent, WorkerSubmit


class ReadyCode(StrEnum):
    NOT_ADVANCED = "ready_not_advanced"
    """handle() was called while a strict driver still holds an un-advanced Ready."""
    OUT_OF_ORDER = "ready_out_of_order"
    """A Ready with a durable part was advanced before an earlier one with a durable part."""
    UNKNOWN = "ready_unknown"
    """The Ready was advanced already, or another machine made it."""


class ReadyError(LocalProtocolError):
    """A driver broke the Ready/advance handshake (our bug: the driver's, never a peer's)."""

    def __init__(self, code: ReadyCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Outbox:
    """The effects being collected for the next Ready, the Readies handed out and not yet
    advanced (oldest first), and what the driver has reported durable."""

    __slots__ = ("events", "submits", "client", "pipelined", "_held", "durable_hard", "durable_index")

    def __init__(self, *, pipelined: bool, persisted: PersistedState | None) -> None:
        self.events: list[ClusterEvent] = []
        self.submits: list[WorkerSubmit] = []
        self.client: list[ClientEvent] = []
        self.pipelined = pipelined
        self._held: list[tuple[Ready, Effects]] = []
        self.durable_hard: NodeHardState | None = None
        self.durable_index = 0
        if persisted is not None:  # what a driver hands back at boot is on its disk
            self.durable_hard = persisted.hard
            last = persisted.entries[-1].index if persisted.entries else 0
            self.durable_index = max(last, persisted.snapshot.index) if persisted.hard.cluster is not None else 0

    def check_free(self) -> None:
        """Called before every input: a strict driver must have advanced the last Ready."""
        if self._held and not self.pipelined:
            raise ReadyError(ReadyCode.NOT_ADVANCED, "handle() called before the last Ready was advanced")

    def hand_out(self, ready: Ready) -> Ready:
        """Pair ``ready`` with the effects collected since the last one, and hold them."""
        effects = NO_EFFECTS
        if self.events or self.submits or self.client:
            effects = Effects(tuple(self.events), tuple(self.submits), tuple(self.client))
            self.events, self.submits, self.client = [], [], []
        elif ready.empty():
            return ready  # (the most common Ready: nothing to hold)
        self._held.append((ready, effects))
        return ready

    def effects_of(self, ready: Ready) -> Effects:
        """What ``advance(ready)`` will return, without advancing (see Machine.effects_of)."""
        for i in range(len(self._held) - 1, -1, -1):  # (the newest, as a rule)
            if self._held[i][0] is ready:
                return self._held[i][1]
        return NO_EFFECTS

    def advance(self, ready: Ready) -> Effects:
        held = self._held
        at = next((i for i, (r, _) in enumerate(held) if r is ready), -1)
        if at < 0:
            if ready.empty():
                return NO_EFFECTS  # never held: nothing to record or release
            raise ReadyError(ReadyCode.UNKNOWN, "advance() of a Ready that was advanced already or is not this machine's")
        durable = ready.durable_part()
        if durable and any(r.durable_part() for r, _ in held[:at]):
            raise ReadyError(ReadyCode.OUT_OF_ORDER, "advance() of a Ready with a durable part before an earlier one")
        effects = held.pop(at)[1]
        if durable:
            self._record(ready)
        return effects

    def _record(self, ready: Ready) -> None:
        """The driver's disk now holds ``ready``'s durable part, applied as it must be
        applied (hard state, then snapshot, then the log suffix)."""
        last = self.durable_index
        if ready.hard is not None:
            if self.durable_hard is None or (ready.hard.cluster, ready.hard.inc) != (self.durable_hard.cluster, self.durable_hard.inc):
                last = 0  # another log (a fresh incarnation, or none): nothing of it durable yet
            self.durable_hard = ready.hard
        if ready.log_truncate_from is not None:
            last = min(last, ready.log_truncate_from - 1)
        if ready.log_entries:
            last = ready.log_entries[-1].index
        if ready.snapshot is not None:
            last = max(last, ready.snapshot.index)  # the snapshot covers what it dropped
        self.durable_index = last

    def durable_index_of(self, cluster: ClusterId | None, inc: int) -> int:
        """The durable last index of the log of (cluster, incarnation): 0 while the disk
        holds another one (the switch to a new log is not durable yet)."""
        hard = self.durable_hard
        if cluster is None or hard is None or (hard.cluster, hard.inc) != (cluster, inc):
            return 0
        return self.durable_index
