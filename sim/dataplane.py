"""Fake MLX workers on virtual time: the data plane the core's decisions drive.

After every Ready of a node the world hands it here (as an observer, after the fsync, like
the agent acts on effects). What the agent's tasks decide is not written again here: each
simulated agent process (a node's boot generation) holds the very objects the agent's tasks
drive, and this module carries out their decisions with fake processes on virtual time:
- the fetch task's ``FetchPlanner`` (core/stage_fetch.py, as agent/tasks/fetch.py): which
  stage to fetch now, one at a time; the fake fetch takes a seeded delay (the simulated Macs
  have the model on disk) and never fails;
- the worker supervisor's ``WorkerBook`` (core/supervision.py, as agent/tasks/workers.py):
  which workers to start and stop, which are hung (a live fake process heartbeats; a head
  that makes no progress for its timeout is hung), and what each worker event means to the
  core: the fake workers emit worker/protocol.py events (``ready``, ``token``, ``done``),
  which the book turns into ``WorkerLoaded`` and ``WorkerOutput`` exactly as the agent does;
  a worker whose process exits is reported as ``WorkerCrashed`` by the book, once;
- the head's ``Effects.submits`` (``machine.advance``: ``WorkerSubmit`` and ``WorkerCancel``)
  go to the book and to its rank-0 fake worker (``observe``, the one place this module reads
  them), as the supervisor writes generate and cancel commands;
- the head worker's batching: the worker's own ``Scheduler`` (core/batching.py), run by
  sim/fake_head.py on virtual time with the epoch's batch (``WantedWorker.batch``, the
  placement's) and this data plane's queue bound; beyond them it answers ``busy``.
The fake model (sim/fake_model.py), the fake timings and the faults (a group breaks, stalls)
are the simulator's.

The fake model is a pure function of the context, so a request resumed elsewhere, or batched
with others, gets exactly the tokens of an uninterrupted run. Text prompts are tokenized by a
hash per word, reported once in ``prompt_tokens`` of the first output
(``report_prompt="text"``; "none" is what p2pmesh/worker/serve.py did before it reported
prompts, so the origin must replay the request from its prompt and skip what its client
already has; "all" also echoes prompts that arrived as tokens).

An epoch's worker *group* is modelled like an MLX pipeline over TCP:
- **broken for good** when any of its ranks' processes is gone: its Mac crashed, left, or
  rebooted (a new process cannot join a formed group), the worker was stopped, or it died
  (``kill``, the opt-in ``worker-death`` fault). The head then stops producing, silently,
  as MLX hangs on a silent peer. A worker started for a broken epoch never loads.
- **stalled** while a stage's Mac is paused (asleep) or a pipeline hop is cut: TCP keeps
  the connections, so the group continues when the Mac wakes or the link heals.
The rank-0 worker batches (continuous batching, as p2pmesh/worker/serve.py): requests join
and leave the running batch at token boundaries, prompts go in chunks between the others'
decode steps, and an iteration's virtual time grows with its batch (sim/fake_head.py, which
also checks FIFO admission, the batch bound, starvation and that a cancel frees its slot).
While its group is stalled, the iteration in flight waits; once the group is broken, it
never ends (MLX hangs on a silent peer).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import Effects, Mode, Ready
from p2pmesh.core.messages import Stage
from p2pmesh.core.serving import WorkerCancel, WorkerCommand
from p2pmesh.core.stage_fetch import FetchPlanner
from p2pmesh.core.supervision import WatchedWorker, WorkerBook
from sim.fake_head import FakeHead, StepCost, draw_cost
from sim.fake_model import tokenize
from sim.node import SimNode
from sim.world import World

FETCH_US = (10_000, 300_000)
"""Time to find a stage's files on disk (the simulated Macs have the model already)."""
LOAD_US = (200_000, 2_000_000)
STALL_POLL_US = 50_000
STALL_POLLS_MAX = 20_000
"""A stalled head re-checks its group every 50 ms, at most 1,000 s of virtual time."""
MAX_QUEUE = 64
"""Requests a head worker queues beyond its batch (the worker's --max-queue default)."""

OK, FORMING, STALLED, BROKEN = "ok", "forming", "stalled", "broken"
REPORT_PROMPT = ("text", "all", "none")


# --------------------------------------------------------------------------------------
# Workers


@dataclass(slots=True)
class FakeWorker:
    node: int
    gen: int
    epoch: int
    rank: int
    stages: tuple[Stage, ...]
    started_us: int
    cost: StepCost
    watch: WatchedWorker
    """What the node's WorkerBook knows of it (the agent's supervisor, core/supervision.py)."""
    head: FakeHead | None = None
    """Rank 0's command loop (sim/fake_head.py); None on the other ranks."""
    loaded_us: int | None = None
    dead: str | None = None
    busy: bool = False
    """An iteration is in flight (or waits for a stalled group)."""
    polls: int = 0


@dataclass(slots=True)
class _Agent:
    """The decisions of one agent process (a node's boot generation): the very objects the
    agent's worker supervisor and fetch task drive (core/supervision.py, core/stage_fetch.py)."""

    gen: int
    book: WorkerBook
    planner: FetchPlanner


@dataclass(frozen=True, slots=True)
class DataPlaneStats:
    workers_started: int
    workers_loaded: int
    groups_broken: int
    submits: int
    resumed_requests: int
    busy_refusals: int
    """Requests a head worker refused busy (its batch and queue full)."""
    cancels: int
    """Requests a head worker stopped for a client that hung up."""
    batch_min: int
    batch_max: int
    """The smallest and largest batch a head worker ran with (the placements' batches)."""
    most_running: int
    """The most requests one head worker ran at once."""


_HEARTBEAT = {"event": "heartbeat"}


def _seconds(t_us: int) -> float:
    """Virtual time on the clock the agent's decisions take (seconds)."""
    return t_us / 1_000_000


class DataPlane:
    def __init__(self, world: World, rng: random.Random, *, report_prompt: str = "text", max_queue: int = MAX_QUEUE) -> None:
        if report_prompt not in REPORT_PROMPT:
            raise ValueError(f"report_prompt must be one of {REPORT_PROMPT}")
        self.world = world
        self.rng = rng
        self.max_queue = max_queue
        """Requests each head worker queues beyond its batch; more are refused busy."""
        self.report_prompt = report_prompt
        """Which prompts the head reports back as tokens in its first output: "text" (the
        ones it tokenized), "all" (also those given as tokens) or "none"."""
        self.workers: dict[int, dict[int, FakeWorker]] = {}
        """node index -> epoch -> its worker process (dead ones stay: the node's WorkerBook
        never restarts a failed epoch, as MLX cannot re-form a group with one new rank)."""
        self.agents: dict[int, _Agent] = {}
        """node index -> the decisions of its running agent process."""
        self.broken: dict[int, str] = {}
        """epoch -> why its group broke (permanent)."""
        self.loaded_ever: set[tuple[NodeId, int]] = set()
        """(node, epoch) pairs whose worker reported WorkerLoaded: the truth the activation
        check compares the core's ActivatePlacement with."""
        self.submitted: dict[str, set[int]] = {}
        """request -> epochs it was submitted to a head worker in (more than one: resumed)."""
        self.started = 0
        self.submits = 0
        self.heads: list[FakeHead] = []
        world.observers.append(self.observe)

    # ------------------------------------------------------------------------------
    # Driven by the world

    def observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        """After a Ready's fsync and advance, as the agent acts on it: its tasks see the new
        state, and its submits go to the head worker (the one place this module reads them)."""
        self.reconcile(node)
        for s in effects.submits:
            self._command(node, s)

    def reconcile(self, node: SimNode) -> None:
        """What the agent's tasks do on a new snapshot: the fetch task looks for a stage to
        fetch, the supervisor starts the workers the committed state wants and stops the
        others (core/supervision.py decides; this carries it out with fake processes)."""
        m = node.machine
        mine = self.workers.setdefault(node.index, {})
        for epoch, w in list(mine.items()):
            if w.gen != node.gen:
                # The Mac rebooted: its processes are gone with its old agent.
                self._break(epoch, f"{node.name} lost its rank-{w.rank} worker (process gone)")
                del mine[epoch]
        if m is None or m.raft is None:
            return  # no cluster state: the agent's tasks wait for one
        agent = self._agent(node)
        self._plan_fetch(node, agent)
        now = _seconds(self.world.now_us)
        for w in mine.values():
            if w.dead is None and agent.book.workers.get(w.epoch) is w.watch:
                agent.book.heard(w.watch, _HEARTBEAT, now)  # a live process heartbeats every 0.5 s
        state = m.raft.state
        moves = agent.book.reconcile(state, now)
        for watch in moves.stop:
            self._stop(node, watch.epoch, "stopped", f"{node.name} stopped its rank-{watch.rank} worker")
        for watch in moves.hung:
            self._stop(node, watch.epoch, "hung", f"{node.name} stopped its hung rank-{watch.rank} worker")
        for crash in moves.crashed:
            self.world.call(node, crash)
        for want in moves.start:
            self._start(node, agent, want)

    def kill(self, node: SimNode, epoch: int, why: str) -> None:
        """A worker dies on a live Mac (the opt-in ``worker-death`` fault)."""
        w = self.workers.get(node.index, {}).get(epoch)
        if w is not None and w.dead is None:
            w.dead = why
            self._break(epoch, f"{node.name}'s rank-{w.rank} worker died ({why})")
            self._exited(node, w)

    # ------------------------------------------------------------------------------
    # Queries

    def group_status(self, epoch: int, stages: tuple[Stage, ...]) -> str:
        """ok, forming (not every rank loaded), stalled (a Mac asleep, a hop cut) or broken."""
        if epoch in self.broken:
            return BROKEN
        w0 = self.world
        status = OK
        for s in stages:
            node = w0.by_id.get(s.node_id)
            w = self.workers.get(node.index, {}).get(epoch) if node is not None else None
            if node is None or w is None:
                status = FORMING if status == OK else status
                continue
            if not self._alive(node, w):
                self._break(epoch, f"{node.name}'s rank-{w.rank} worker is gone")
                return BROKEN
            if w.loaded_us is None:
                status = FORMING
            elif node.paused and status == OK:
                status = STALLED
        if status == OK and len(stages) > 1:
            for i, s in enumerate(stages):
                nxt = stages[(i + 1) % len(stages)].node_id
                if not (w0.net.reachable(s.node_id, nxt) and w0.net.reachable(nxt, s.node_id)):
                    return STALLED
        return status

    def stats(self) -> DataPlaneStats:
        resumed = sum(1 for epochs in self.submitted.values() if len(epochs) > 1)
        heads = self.heads
        return DataPlaneStats(
            self.started, len(self.loaded_ever), len(self.broken), self.submits, resumed,
            sum(h.busy_refusals for h in heads), sum(h.cancels for h in heads),
            min((h.max_batch for h in heads), default=0), max((h.max_batch for h in heads), default=0),
            max((h.most_running for h in heads), default=0),
        )

    # ------------------------------------------------------------------------------
    # Lifecycle

    def _alive(self, node: SimNode, w: FakeWorker) -> bool:
        return w.dead is None and node.alive and not node.left and node.gen == w.gen

    def _agent(self, node: SimNode) -> _Agent:
        agent = self.agents.get(node.index)
        if agent is None or agent.gen != node.gen:
            now = _seconds(self.world.now_us)
            agent = self.agents[node.index] = _Agent(node.gen, WorkerBook(node.node_id), FetchPlanner(node.node_id, now))
        return agent

    def _break(self, epoch: int, why: str) -> None:
        if epoch not in self.broken:
            self.broken[epoch] = why
            self.world.note(f"group epoch={epoch} broken: {why}")
            # MLX's ranks fail once a peer's process is gone ("connection to a peer was
            # lost") and exit; each live Mac's agent then reports its worker as crashed.
            for index, mine in self.workers.items():
                if epoch in mine:
                    self._exited(self.world.nodes[index], mine[epoch])

    def _exited(self, node: SimNode, w: FakeWorker) -> None:
        """The worker's process exited: its agent reports the crash (WorkerBook.exited), once."""
        agent = self.agents.get(node.index)
        if agent is None or agent.gen != w.gen or not node.alive or node.left or node.machine is None:
            return
        crash = agent.book.exited(w.watch)
        if crash is not None:
            self.world.call(node, crash)

    def _stop(self, node: SimNode, epoch: int, how: str, why: str) -> None:
        w = self.workers[node.index].pop(epoch)
        w.dead = w.dead or how
        self._break(epoch, why)
        self.world.note(f"{node.name} stops worker epoch={epoch}")

    def _plan_fetch(self, node: SimNode, agent: _Agent) -> None:
        """The fetch task: the planner's next job, done after a seeded delay (the simulated
        Macs have the model on disk), then reported; one at a time, as the task does."""
        m = node.machine
        if m is None or m.raft is None or node.paused:
            return
        state = m.raft.state if m.mode is Mode.MEMBER else None
        job = agent.planner.next_job(state, str(m.cluster), _seconds(self.world.now_us))
        if job is None:
            return

        def fetched() -> None:
            if node.alive and not node.left and node.gen == agent.gen and node.machine is not None:
                self.world.call(node, agent.planner.fetched(job))
                self._plan_fetch(node, agent)  # the task looks again at once

        self.world.at(self.world.now_us + self.rng.randint(*FETCH_US), fetched)

    def _start(self, node: SimNode, agent: _Agent, want: dataplane.WantedWorker) -> None:
        watch = agent.book.started(want, _seconds(self.world.now_us))
        w = FakeWorker(node.index, node.gen, want.epoch, want.rank, want.stages, self.world.now_us, draw_cost(self.rng), watch)
        if want.rank == 0:
            # One decode group per stage, as the worker's default (--micro-batches).
            w.head = FakeHead(want.batch, self.max_queue, len(want.stages), w.cost)
            self.heads.append(w.head)
        self.workers[node.index][want.epoch] = w
        self.started += 1
        delay = self.rng.randint(*LOAD_US)
        self.world.note(f"{node.name} starts worker epoch={want.epoch} rank={want.rank} load={delay // 1000}ms")
        self.world.at(self.world.now_us + delay, lambda: self._loaded(node, w))

    def _loaded(self, node: SimNode, w: FakeWorker) -> None:
        if self.workers.get(node.index, {}).get(w.epoch) is not w or not self._alive(node, w):
            return
        if w.epoch in self.broken:
            # Its layers load, but the group it should join is gone: it never becomes ready,
            # its ring connect gives up and it exits; the agent reports the crash.
            self._exited(node, w)
            return
        w.loaded_us = self.world.now_us
        self.loaded_ever.add((node.node_id, w.epoch))
        self.world.note(f"{node.name} worker epoch={w.epoch} loaded")
        self._emit(node, w, {"event": "ready", "rank": w.rank})  # deferred while the Mac sleeps
        if w.head is not None:
            w.head.loaded_us = w.loaded_us
            self._kick(node, w)

    def _emit(self, node: SimNode, w: FakeWorker, event: dict[str, object]) -> None:
        """A worker event (worker/protocol.py) read by its agent: the input it means to the
        core, as the agent's supervisor decodes it (WorkerBook.heard)."""
        agent = self.agents.get(node.index)
        if agent is None or agent.gen != w.gen:
            return
        got = agent.book.heard(w.watch, event, _seconds(self.world.now_us))
        if got is not None:
            self.world.call(node, got)

    # ------------------------------------------------------------------------------
    # The head: its commands, and its loop's iterations on virtual time

    def _command(self, node: SimNode, s: WorkerCommand) -> None:
        """A generate or cancel command for the epoch's head worker here, as the agent's
        Supervisor.submit writes it (agent/tasks/workers.py)."""
        if isinstance(s, WorkerCancel):
            self._cancel(node, s)
            return
        self.submits += 1
        self.submitted.setdefault(s.req, set()).add(s.epoch)
        p = s.params
        what = f"{len(p.prompt_tokens)} prompt tokens" if p.prompt_tokens else "a text prompt"
        self.world.note(f"{node.name} head epoch={s.epoch} gets {s.req}: {what}, {p.max_tokens} to generate")
        w = self._head(node, s.epoch)
        agent = self.agents.get(node.index)
        if w is None or agent is None or agent.book.submit(s.epoch, f"{s.req}@{s.attempt}", _seconds(self.world.now_us)) is None:
            # The agent's supervisor has no head worker for the epoch here: the request
            # waits with its origin for the next epoch.
            return
        assert w.head is not None
        if p.prompt_tokens:
            tokens, report = p.prompt_tokens, (p.prompt_tokens if self.report_prompt == "all" else ())
        else:
            tokens = tokenize(p.prompt or "")
            report = tokens if self.report_prompt != "none" else ()
        for event in w.head.submit(f"{s.req}@{s.attempt}", tokens, p.max_tokens, report, self.world.now_us):
            self._emit(node, w, event)
        self._kick(node, w)

    def _cancel(self, node: SimNode, s: WorkerCancel) -> None:
        w = self._head(node, s.epoch)
        agent = self.agents.get(node.index)
        if w is None or agent is None or agent.book.head(s.epoch) is None:
            return
        assert w.head is not None
        self.world.note(f"{node.name} head epoch={s.epoch} cancels {s.req}@{s.attempt}")
        for event in w.head.cancel(f"{s.req}@{s.attempt}"):
            self._emit(node, w, event)

    def _head(self, node: SimNode, epoch: int) -> FakeWorker | None:
        """The epoch's live rank-0 fake worker here, run by this node's agent process."""
        w = self.workers.get(node.index, {}).get(epoch)
        agent = self.agents.get(node.index)
        if w is None or w.head is None or w.dead is not None or agent is None or agent.gen != w.gen:
            return None
        return w

    def _kick(self, node: SimNode, w: FakeWorker) -> None:
        """Start the head's next iteration if it is free and has work."""
        if w.busy or w.loaded_us is None or w.head is None or not self._current(node, w):
            return
        took = w.head.start(self.rng)
        if took is not None:
            w.busy = True
            self.world.at(self.world.now_us + took, lambda: self._iteration_ends(node, w))

    def _current(self, node: SimNode, w: FakeWorker) -> bool:
        return self.workers.get(node.index, {}).get(w.epoch) is w and self._alive(node, w)

    def _iteration_ends(self, node: SimNode, w: FakeWorker) -> None:
        """The iteration in flight ends if the group works: its tokens and ends go out."""
        assert w.head is not None
        if not self._current(node, w):
            return
        status = self.group_status(w.epoch, w.stages)
        if status == BROKEN:
            return  # MLX hangs on a silent peer: nothing more comes out, and no error
        if status != OK:
            w.polls += 1
            if w.polls <= STALL_POLLS_MAX:
                w.head.stall(STALL_POLL_US)
                self.world.at(self.world.now_us + STALL_POLL_US, lambda: self._iteration_ends(node, w))
            return
        w.polls = 0
        w.busy = False
        for event in w.head.finish(self.world.now_us):
            self._emit(node, w, event)
        self._kick(node, w)
