"""The worker supervisor's decisions, without the processes: which MLX workers this node
starts, stops or declares hung, and what each worker event means to the core.

The agent's Supervisor (agent/tasks/workers.py) carries these out with real processes and
trio's clock; the simulator (sim/dataplane.py) carries out the very same ones with fake
workers on virtual time. Sans I/O: no processes, no clock reads (``now`` is an argument, in
seconds on the caller's clock), so both drive one ``WorkerBook`` per agent process.

The rules:
- the wanted workers are core/dataplane.wanted_workers of the committed state: one for the
  active epoch and one for a pending epoch whose files are everywhere;
- a worker no longer wanted is stopped quietly (the cluster moved on: nothing to report);
- a worker that failed here (exited, hung, could not start) is reported as
  ``WorkerCrashed`` once and never restarted: MLX cannot re-form a group with one new
  rank, so the leader moves the cluster to a new epoch instead;
- a worker silent for HEARTBEAT_TIMEOUT_S, or a head holding requests that produced
  nothing for PROGRESS_TIMEOUT_S, is hung (MLX hangs forever on a silent peer).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import ClusterState, RingHop, WorkerFault
from p2pmesh.core.node_io import WorkerCrashed, WorkerLoad, WorkerLoaded, WorkerOutput
from p2pmesh.core.protocol import WORKER_BUSY, WORKER_REQUEST_INVALID, ErrorCode
from p2pmesh.core.validate import FAULT_MESSAGE_MAX

HEARTBEAT_TIMEOUT_S = 10.0
"""A worker silent this long is hung (a worker sends one every 0.5 s, from a thread)."""
PROGRESS_TIMEOUT_S = 120.0
"""A head with a request that produced nothing for this long is hung inside MLX (a silent
peer: its heartbeat thread still runs, so heartbeats alone cannot tell). Long, because a
long prompt's prefill produces nothing for a while; a Mac that dies or sleeps is caught
much sooner by failure detection, which moves the cluster to a new epoch."""


def request_outcome(kind: str, worker_code: object) -> tuple[bool, str]:
    """(broken, client code) for a request's event from its head worker. Only the request's
    own fault ends it: request_invalid is about the prompt (worker/serve.py: the edge already
    checked every other field against the same limits, core/protocol.py), busy means the
    worker's batch and queue are full (the client may retry shortly). Any other error under a
    request (a peer is gone, or a code we do not know) is the epoch's: the core resumes it."""
    if kind != "error":
        return False, ""
    if worker_code == WORKER_BUSY:
        return False, ErrorCode.BUSY
    if worker_code == WORKER_REQUEST_INVALID:
        return False, ErrorCode.PROMPT_REFUSED
    return True, ErrorCode.PROMPT_REFUSED


def group_hops(state: ClusterState, epoch: int) -> tuple[RingHop, ...]:
    """The pipeline hops of ``epoch``'s group (the pending placement's or the active one's)."""
    return state.placement_hops if epoch == state.placement_epoch else state.active_hops


LOAD_REPEAT_S = 1.0
"""An unchanged batch is told to the core again after this long (the head's report to the
members must stay fresher than serving.LOAD_STALE_MS)."""


@dataclass(slots=True)
class WatchedWorker:
    """What the supervisor knows of one running worker; its events update it."""

    epoch: int
    rank: int
    order: tuple[NodeId, ...]
    """The epoch's members in rank order (to name the peer of a fault)."""
    last_heartbeat: float
    """When it last wrote an event (any event counts)."""
    ready: bool = False
    pending: set[str] = field(default_factory=set)
    """Requests handed to this (head) worker and not finished, as ``req@attempt``."""
    progress: float = 0.0
    """When it last produced output for a request (or was given one while idle)."""
    fault: WorkerFault | None = None
    """Why it could not form its group, when it said so before exiting."""
    load: WorkerLoad | None = None
    """Its batch as last told to the core (a head's heartbeat), and when."""
    load_at: float = 0.0

    def hung(self, now: float) -> bool:
        return now - self.last_heartbeat > HEARTBEAT_TIMEOUT_S or (
            bool(self.pending) and now - self.progress > PROGRESS_TIMEOUT_S
        )


@dataclass(frozen=True, slots=True)
class Moves:
    """What one reconciliation asks of the process side, in this order."""

    stop: tuple[WatchedWorker, ...]
    """No longer wanted: stop them, quietly."""
    hung: tuple[WatchedWorker, ...]
    """Hung: stop them; ``crashed`` reports them to the core."""
    crashed: tuple[WorkerCrashed, ...]
    start: tuple[dataplane.WantedWorker, ...]
    """Wanted and neither running nor failed here: start them (``WorkerBook.started``)."""


class WorkerBook:
    """The workers of one agent process: running (``workers``) and failed (``failed``)."""

    def __init__(self, me: NodeId) -> None:
        self.me = me
        self.workers: dict[int, WatchedWorker] = {}
        """epoch -> its running worker."""
        self.failed: set[int] = set()
        """Epochs whose worker failed here: not restarted (the group cannot re-form with
        one new rank); the leader moves the cluster to a new epoch instead."""

    def reconcile(self, state: ClusterState, now: float) -> Moves:
        """Compare the running workers with the ones the committed state wants."""
        wanted = {w.epoch: w for w in dataplane.wanted_workers(state, self.me)}
        stop: list[WatchedWorker] = []
        hung: list[WatchedWorker] = []
        for epoch, w in list(self.workers.items()):
            if epoch not in wanted:
                del self.workers[epoch]
                stop.append(w)
            elif w.hung(now):
                del self.workers[epoch]
                self.failed.add(epoch)
                hung.append(w)
        start = tuple(want for epoch, want in wanted.items() if epoch not in self.workers and epoch not in self.failed)
        return Moves(tuple(stop), tuple(hung), tuple(WorkerCrashed(w.epoch) for w in hung), start)

    def started(self, want: dataplane.WantedWorker, now: float) -> WatchedWorker:
        """The process of ``want`` is running: watch it."""
        w = WatchedWorker(want.epoch, want.rank, tuple(s.node_id for s in want.stages), now)
        self.workers[want.epoch] = w
        return w

    def could_not_start(self, epoch: int) -> WorkerCrashed:
        """Its process could not be started (its group's hops lack what the backend needs)."""
        self.failed.add(epoch)
        return WorkerCrashed(epoch)

    def exited(self, w: WatchedWorker) -> WorkerCrashed | None:
        """Its process exited: a crash to report, unless it had been stopped (or declared hung)."""
        if self.workers.get(w.epoch) is not w:
            return None
        del self.workers[w.epoch]
        self.failed.add(w.epoch)
        return WorkerCrashed(w.epoch, w.fault)

    def head(self, epoch: int) -> WatchedWorker | None:
        """The epoch's head worker here (rank 0), None when this node runs none."""
        w = self.workers.get(epoch)
        return w if w is not None and w.rank == 0 else None

    def submit(self, epoch: int, ident: str, now: float) -> WatchedWorker | None:
        """A request ``ident`` (``req@attempt``) goes to the epoch's head worker here: the
        head, now holding it; None when this node runs no head of that epoch (it is gone,
        reported as WorkerCrashed: the request waits with its origin for the next epoch)."""
        w = self.head(epoch)
        if w is None:
            return None
        if not w.pending:
            w.progress = now
        w.pending.add(ident)
        return w

    def heard(self, w: WatchedWorker, event: Mapping[str, Any],
              now: float) -> WorkerLoaded | WorkerOutput | WorkerLoad | None:
        """A worker's event (worker/protocol.py; ``event["event"]`` is its kind): the input
        it means to the core, if any. Any event proves the worker alive."""
        w.last_heartbeat = now
        kind = event["event"]
        if kind == "ready":
            w.ready = True
            return WorkerLoaded(w.epoch)
        if kind in ("token", "done", "error") and event.get("id") is not None:
            ident = str(event["id"])
            req, _, attempt = ident.rpartition("@")
            done = kind != "token"
            w.progress = now
            if done:
                w.pending.discard(ident)
            tokens = (int(event["token"]),) if kind == "token" else ()
            finish = str(event.get("finish") or ("error" if kind == "error" else ""))
            text = str(event.get("text") or event.get("message") or "")
            prompt = tuple(int(t) for t in event.get("prompt_tokens") or ())
            broken, code = request_outcome(kind, event.get("code"))
            return WorkerOutput(w.epoch, req, tokens, text, done, finish, prompt,
                                int(attempt) if attempt.isdigit() else 0, broken, code)
        if kind == "heartbeat" and w.rank == 0:
            return self._load(w, event, now)
        if kind == "error":
            # An error with no request before it is ready: why it cannot form its group.
            w.fault = self._fault(w, event) if not w.ready else None
        return None

    def _load(self, w: WatchedWorker, event: Mapping[str, Any], now: float) -> WorkerLoad | None:
        """A head's heartbeat as the core hears it: its batch when it changed, and at least
        every LOAD_REPEAT_S while it serves (so the cluster's view never goes stale); None
        for a heartbeat without a well-formed load (an older worker)."""
        numbers = [event.get(k) for k in ("running", "queued", "tokens")]
        if not all(type(n) is int and 0 <= n < 1 << 62 for n in numbers):
            return None
        load = WorkerLoad(w.epoch, *numbers)
        if load == w.load and now - w.load_at < LOAD_REPEAT_S:
            return None
        w.load, w.load_at = load, now
        return load

    def _fault(self, w: WatchedWorker, event: Mapping[str, Any]) -> WorkerFault | None:
        """The worker's fault (worker/protocol.py error) with the rank at fault named by its
        node id, or None when it sent none or a malformed one."""
        f = event.get("fault")
        if not isinstance(f, dict):
            return None
        code, rank, address, port = f.get("code"), f.get("rank"), f.get("address"), f.get("port")
        if not (isinstance(code, str) and isinstance(address, str) and type(rank) is int and type(port) is int
                and 0 <= rank < len(w.order) and 0 <= port <= 65535 and len(code) <= 64 and len(address) <= 256):
            return None
        message = str(event.get("message") or "")[:FAULT_MESSAGE_MAX]
        return WorkerFault(code, w.order[rank], address, port, self.me, w.epoch, message)
