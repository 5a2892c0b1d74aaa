"""The agent's ports: what its tasks get instead of the Agent.

- ``ClusterView``: a read-only view of what this node may act on: the committed cluster
  state and this node's own facts, as an immutable ``Snapshot``. The runtime publishes a new
  snapshot only **after** the Ready that produced it has its durable part on disk (the leader
  counts its own entries as soon as it appends them, so the live machine can run ahead of
  the persistence contract: a task reading it could act on an entry a crash would forget).
  ``await view.changed(since)`` wakes a task when there is something new; no polling.
- ``Inbox``: the send side of the core's one bounded channel; the only way a task speaks
  to the core (inputs are past-tense facts: core/node_io.py).
- ``HubDownloads``: which files other Macs are downloading from Hugging Face now (their
  fresh transfer reports), and ``await changed()`` when that changes, for the one task that
  asks before downloading (hub_share.py). Kept out of the view: reports change twice a
  second, and the view's waiters would wake on each.
- Each task's own configuration is a frozen dataclass beside the task (tasks/*.py), holding
  just what it needs.

Only agent/runtime.py writes to a view (``ViewPublisher``); no task imports the runtime.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, LinkProbe, Measure, MeasureFailed, PortInfo
from p2pmesh.core.node_io import Input, Mode, Status


@dataclass(frozen=True, slots=True)
class Snapshot:
    """This node as of the last Ready whose durable part is saved."""

    version: int
    """Counts published snapshots; a new one differs from the one before."""
    node_id: NodeId
    status: Status | None = None
    """Role, term, leader, commit and applied index, health; None while the agent starts."""
    state: ClusterState | None = None
    """The applied cluster state (committed and on disk); None outside a cluster."""
    ports: tuple[PortInfo, ...] = ()
    """This Mac's ports as last observed (a local fact; the committed record may lag)."""
    probes: tuple[LinkProbe, ...] = ()
    measure: Measure | MeasureFailed | None = None
    """This Mac's last measurement of the model, or why it cannot load it."""
    requests_resumed: int = 0
    requests_asked_again: int = 0

    @property
    def cluster(self) -> ClusterId | None:
        return self.status.cluster if self.status is not None else None

    @property
    def member_state(self) -> ClusterState | None:
        """The cluster state while this node is a member (not while it joins or has left)."""
        return self.state if self.status is not None and self.status.mode is Mode.MEMBER else None

    def same_as(self, other: Snapshot) -> bool:
        """Nothing a task reads differs (states compare by identity: the core replaces its
        state on every applied command, so an unchanged object is an unchanged state)."""
        return (self.state is other.state and self.status == other.status and self.ports == other.ports
                and self.probes == other.probes and self.measure == other.measure
                and self.requests_resumed == other.requests_resumed
                and self.requests_asked_again == other.requests_asked_again)


class ClusterView:
    """Read side: ``current`` and ``await changed(since)``. Made by a ViewPublisher."""

    def __init__(self, first: Snapshot) -> None:
        self._current = first
        self._next = trio.Event()
        """Set, and replaced, when a new snapshot is published."""

    @property
    def current(self) -> Snapshot:
        return self._current

    async def changed(self, since: int, *, timeout_s: float = math.inf) -> Snapshot:
        """The current snapshot once its version is past ``since``, or after ``timeout_s``
        whatever it is (for tasks that also watch the outside world on a period)."""
        with trio.move_on_after(timeout_s):
            while self._current.version <= since:
                await self._next.wait()
        return self._current


class ViewPublisher:
    """Write side, held by the runtime alone."""

    def __init__(self, node_id: NodeId) -> None:
        self.view = ClusterView(Snapshot(0, node_id))

    def publish(self, snapshot: Snapshot) -> bool:
        """Publish ``snapshot`` (its version is replaced) unless nothing in it changed;
        returns whether it was published."""
        view = self.view
        if snapshot.same_as(view.current):
            return False
        view._current = Snapshot(view.current.version + 1, snapshot.node_id, snapshot.status, snapshot.state,
                                 snapshot.ports, snapshot.probes, snapshot.measure, snapshot.requests_resumed,
                                 snapshot.requests_asked_again)
        woken, view._next = view._next, trio.Event()
        woken.set()
        return True


class HubDownloads:
    """The members' fresh transfer reports as files downloading from the hub
    (core/transfers.hub_downloads): ``now()``, and ``await changed()`` once they differ
    from what was last seen (the runtime calls ``refresh`` when reports arrive; a report
    that goes stale changes nothing until the next refresh, hence the waiter's timeout)."""

    def __init__(self, read: Callable[[], Mapping[str, NodeId]] = dict) -> None:
        self._read = read
        self._seen: Mapping[str, NodeId] = {}
        self._next = trio.Event()

    def now(self) -> Mapping[str, NodeId]:
        """The files ("model: file") other Macs are downloading from the hub, and who."""
        return self._read()

    def refresh(self) -> None:
        """Runtime side: the reports changed; wake the waiters if the files did."""
        current = self._read()
        if current != self._seen:
            self._seen = dict(current)
            woken, self._next = self._next, trio.Event()
            woken.set()

    async def changed(self, *, timeout_s: float) -> None:
        """Return when the files downloading elsewhere change, or after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            await self._next.wait()


class Inbox:
    """The send side of the core's bounded inbox."""

    def __init__(self, send: trio.MemorySendChannel[Input]) -> None:
        self._send = send

    async def put(self, event: Input) -> None:
        """Wait for room (backpressure on the task, never on the core)."""
        await self._send.send(event)

    def put_nowait(self, event: Input) -> bool:
        """Put without waiting; False when the inbox is full."""
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            return False
        return True
