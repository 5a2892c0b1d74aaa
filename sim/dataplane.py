"""Fake MLX workers on virtual time: the data plane the core's decisions drive.

After every Ready of a node the world hands it here (as an observer, after the fsync, like
the agent acts on effects), and this module does what p2pmesh/workers.py does with real
processes: fetch a stage's files (``StageFilesFetched(epoch)`` after a seeded delay, as
p2pmesh/fetch.py does with real downloads), run one worker per epoch in
``dataplane.wanted_workers(state, me)``, stop the ones no longer wanted, feed
``WorkerLoaded(epoch)`` once a worker has "loaded" (a seeded delay), and hand the head's ``Effects.submits`` to its rank-0 worker, whose tokens come back
as ``WorkerOutput`` inputs.

The fake model is a pure function of the context: the next token is a hash of every token
before it (prompt plus generated), so a request resumed elsewhere with the tokens generated
so far continues exactly as an uninterrupted run would (greedy decoding). Text prompts are
tokenized by a hash per word, reported once in ``prompt_tokens`` of the first output
(``report_prompt="text"``; "none" is what p2pmesh/worker/serve.py does today, so the origin
must replay the request from its prompt and skip what its client already has; "all" also
echoes prompts that arrived as tokens).

An epoch's worker *group* is modelled like an MLX pipeline over TCP:
- **broken for good** when any of its ranks' processes is gone: its Mac crashed, left, or
  rebooted (a new process cannot join a formed group), the worker was stopped, or it died
  (``kill``, the opt-in ``worker-death`` fault). The head then stops producing, silently,
  as MLX hangs on a silent peer. A worker started for a broken epoch never loads.
- **stalled** while a stage's Mac is paused (asleep) or a pipeline hop is cut: TCP keeps
  the connections, so the group continues when the Mac wakes or the link heals.
The rank-0 worker runs one request at a time, in submit order (as p2pmesh/worker/serve.py).
"""
from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field

from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import Effects, Mode, Ready, StageFilesFetched, WorkerCrashed, WorkerLoaded, WorkerOutput
from p2pmesh.core.messages import Stage
from p2pmesh.core.serving import GenerateParams, WorkerSubmit
from sim.node import SimNode
from sim.world import World

VOCAB = 5000
EOS = 0
EOS_BELOW = 60
"""A context whose hash mod VOCAB falls below this ends the generation (finish "stop"):
about one token in 80, so some requests stop early and most run to max_tokens."""
FETCH_US = (10_000, 300_000)
"""Time to find a stage's files on disk (the simulated Macs have the model already)."""
LOAD_US = (200_000, 2_000_000)
TOKEN_US = (5_000, 25_000)
"""Per-worker time per token (drawn once per head worker), plus up to 20% jitter."""
PREFILL_US = (10_000, 60_000)
STALL_POLL_US = 50_000
STALL_POLLS_MAX = 20_000
"""A stalled head re-checks its group every 50 ms, at most 1,000 s of virtual time."""
_MASK = (1 << 64) - 1

OK, FORMING, STALLED, BROKEN = "ok", "forming", "stalled", "broken"
REPORT_PROMPT = ("text", "all", "none")


# --------------------------------------------------------------------------------------
# The fake model: a pure function of the context


def _mix(h: int, token: int) -> int:
    h = ((h ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK
    return h ^ (h >> 31)


def context_hash(tokens: tuple[int, ...] | list[int]) -> int:
    h = 0x243F6A8885A308D3
    for t in tokens:
        h = _mix(h, t)
    return h


def next_token(h: int) -> int:
    """The greedy next token after a context whose hash is ``h`` (EOS ends it)."""
    t = h % VOCAB
    return EOS if t < EOS_BELOW else t


def tokenize(prompt: str) -> tuple[int, ...]:
    """A fake tokenizer: one token per word (never EOS), stable across processes."""
    out = []
    for word in prompt.split():
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        out.append(EOS_BELOW + int.from_bytes(digest, "big") % (VOCAB - EOS_BELOW))
    return tuple(out)


def expected_output(prompt_tokens: tuple[int, ...], max_tokens: int) -> tuple[tuple[int, ...], str]:
    """What an uninterrupted greedy run gives: the tokens and the finish reason."""
    h = context_hash(prompt_tokens)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(h)
        if t == EOS:
            return tuple(out), "stop"
        out.append(t)
        h = _mix(h, t)
    return tuple(out), "length"


# --------------------------------------------------------------------------------------
# Workers


@dataclass(slots=True)
class _Job:
    req: str
    h: int
    """Hash of the context so far (prompt plus generated)."""
    left: int
    report_prompt: tuple[int, ...]
    attempt: int = 0
    first: bool = True
    polls: int = 0


@dataclass(slots=True)
class FakeWorker:
    node: int
    gen: int
    epoch: int
    rank: int
    stages: tuple[Stage, ...]
    started_us: int
    token_us: int
    loaded_us: int | None = None
    dead: str | None = None
    queue: deque[_Job] = field(default_factory=deque)
    busy: bool = False


@dataclass(frozen=True, slots=True)
class DataPlaneStats:
    workers_started: int
    workers_loaded: int
    groups_broken: int
    submits: int
    resumed_requests: int


class DataPlane:
    def __init__(self, world: World, rng: random.Random, *, report_prompt: str = "text") -> None:
        if report_prompt not in REPORT_PROMPT:
            raise ValueError(f"report_prompt must be one of {REPORT_PROMPT}")
        self.world = world
        self.rng = rng
        self.report_prompt = report_prompt
        """Which prompts the head reports back as tokens in its first output: "text" (the
        ones it tokenized), "all" (also those given as tokens) or "none"."""
        self.workers: dict[int, dict[int, FakeWorker]] = {}
        """node index -> epoch -> its worker (dead ones stay until unwanted, as the agent's
        Supervisor keeps failed epochs: it never restarts a rank of a formed group)."""
        self.broken: dict[int, str] = {}
        """epoch -> why its group broke (permanent)."""
        self.loaded_ever: set[tuple[NodeId, int]] = set()
        """(node, epoch) pairs whose worker reported WorkerLoaded: the truth the activation
        check compares the core's ActivatePlacement with."""
        self.submitted: dict[str, set[int]] = {}
        """request -> epochs it was submitted to a head worker in (more than one: resumed)."""
        self.started = 0
        self.submits = 0
        self.fetching: set[tuple[int, int, int]] = set()
        """(node index, process generation, epoch) whose stage files are being fetched."""
        world.observers.append(self.observe)

    # ------------------------------------------------------------------------------
    # Driven by the world

    def observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        self.reconcile(node)
        for s in effects.submits:
            self._submit(node, s)

    def reconcile(self, node: SimNode) -> None:
        """Start the workers the node's committed state wants, stop the others."""
        m = node.machine
        mine = self.workers.setdefault(node.index, {})
        wanted: dict[int, dataplane.WantedWorker] = {}
        if m is not None and m.raft is not None and m.mode is Mode.MEMBER and node.alive and not node.left:
            wanted = {w.epoch: w for w in dataplane.wanted_workers(m.raft.state, node.node_id)}
            fetch = dataplane.fetch_wanted(m.raft.state, node.node_id)
            if fetch is not None and (node.index, node.gen, fetch[0]) not in self.fetching:
                self._fetch(node, fetch[0])
        for epoch, w in list(mine.items()):
            if w.gen != node.gen:
                self._break(epoch, f"{node.name} lost its rank-{w.rank} worker (process gone)")
                del mine[epoch]
            elif epoch not in wanted:
                w.dead = w.dead or "stopped"
                self._break(epoch, f"{node.name} stopped its rank-{w.rank} worker")
                self.world.note(f"{node.name} stops worker epoch={epoch}")
                del mine[epoch]
        for epoch, want in wanted.items():
            if epoch not in mine:
                self._start(node, want)

    def kill(self, node: SimNode, epoch: int, why: str) -> None:
        """A worker dies on a live Mac (the opt-in ``worker-death`` fault)."""
        w = self.workers.get(node.index, {}).get(epoch)
        if w is not None and w.dead is None:
            w.dead = why
            self._break(epoch, f"{node.name}'s rank-{w.rank} worker died ({why})")

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
        return DataPlaneStats(self.started, len(self.loaded_ever), len(self.broken), self.submits, resumed)

    # ------------------------------------------------------------------------------
    # Lifecycle

    def _alive(self, node: SimNode, w: FakeWorker) -> bool:
        return w.dead is None and node.alive and not node.left and node.gen == w.gen

    def _break(self, epoch: int, why: str) -> None:
        if epoch not in self.broken:
            self.broken[epoch] = why
            self.world.note(f"group epoch={epoch} broken: {why}")
            # MLX's ranks fail once a peer's process is gone ("connection to a peer was
            # lost"); each live Mac's agent then reports its worker of the epoch as crashed.
            for index, mine in self.workers.items():
                if epoch in mine:
                    self._report_crash(self.world.nodes[index], epoch)

    def _report_crash(self, node: SimNode, epoch: int) -> None:
        if node.alive and not node.left and node.machine is not None:
            self.world.call(node, WorkerCrashed(epoch))

    def _fetch(self, node: SimNode, epoch: int) -> None:
        key = (node.index, node.gen, epoch)
        self.fetching = {k for k in self.fetching if k[2] >= epoch - 2} | {key}
        gen = node.gen

        def fetched() -> None:
            if node.alive and not node.left and node.gen == gen and node.machine is not None:
                self.world.call(node, StageFilesFetched(epoch))

        self.world.at(self.world.now_us + self.rng.randint(*FETCH_US), fetched)

    def _start(self, node: SimNode, want: dataplane.WantedWorker) -> None:
        w = FakeWorker(
            node.index, node.gen, want.epoch, want.rank, want.stages, self.world.now_us, self.rng.randint(*TOKEN_US)
        )
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
            # its ring connect gives up, and the agent reports the crash.
            self._report_crash(node, w.epoch)
            return
        w.loaded_us = self.world.now_us
        self.loaded_ever.add((node.node_id, w.epoch))
        self.world.note(f"{node.name} worker epoch={w.epoch} loaded")
        self.world.call(node, WorkerLoaded(w.epoch))  # deferred while the Mac sleeps
        if w.queue and not w.busy:
            self._schedule(node, w, self.rng.randint(*PREFILL_US))

    # ------------------------------------------------------------------------------
    # The head: one request at a time

    def _submit(self, node: SimNode, s: WorkerSubmit) -> None:
        self.submits += 1
        self.submitted.setdefault(s.req, set()).add(s.epoch)
        p = s.params
        what = f"{len(p.prompt_tokens)} prompt tokens" if p.prompt_tokens else "a text prompt"
        self.world.note(f"{node.name} head epoch={s.epoch} gets {s.req}: {what}, {p.max_tokens} to generate")
        w = self.workers.get(node.index, {}).get(s.epoch)
        if w is None or w.rank != 0 or w.dead is not None:
            # What the agent's Supervisor does when it has no head worker for the epoch: the
            # request waits with its origin for the next epoch.
            return
        w.queue.append(self._job(s.req, s.params, s.attempt))
        if not w.busy and w.loaded_us is not None:
            self._schedule(node, w, self.rng.randint(*PREFILL_US))

    def _job(self, req: str, p: GenerateParams, attempt: int) -> _Job:
        if p.prompt_tokens:
            tokens, report = p.prompt_tokens, (p.prompt_tokens if self.report_prompt == "all" else ())
        else:
            tokens = tokenize(p.prompt or "")
            report = tokens if self.report_prompt != "none" else ()
        return _Job(req, context_hash(tokens), p.max_tokens, report, attempt)

    def _schedule(self, node: SimNode, w: FakeWorker, delay_us: int) -> None:
        w.busy = True
        self.world.at(self.world.now_us + delay_us, lambda: self._step(node, w))

    def _step(self, node: SimNode, w: FakeWorker) -> None:
        """Produce one token of the request at the head of the queue (if the group works)."""
        w.busy = False
        if self.workers.get(node.index, {}).get(w.epoch) is not w or not self._alive(node, w) or not w.queue:
            return
        status = self.group_status(w.epoch, w.stages)
        job = w.queue[0]
        if status == BROKEN:
            return  # MLX hangs on a silent peer: nothing more comes out, and no error
        if status != OK:
            job.polls += 1
            if job.polls <= STALL_POLLS_MAX:
                self._schedule(node, w, STALL_POLL_US)
            return
        tok = next_token(job.h) if job.left > 0 else None
        prompt, job.first = (job.report_prompt if job.first else ()), False
        epoch = w.epoch
        if tok is None:  # nothing left to generate (a resume asks only for the rest)
            self.world.call(node, WorkerOutput(epoch, job.req, (), "", True, "length", prompt, job.attempt))
            w.queue.popleft()
        elif tok == EOS:
            self.world.call(node, WorkerOutput(epoch, job.req, (), "", True, "stop", prompt, job.attempt))
            w.queue.popleft()
        else:
            job.h = _mix(job.h, tok)
            job.left -= 1
            self.world.call(node, WorkerOutput(epoch, job.req, (tok,), f"t{tok} ", False, "", prompt, job.attempt))
            if job.left <= 0:
                self.world.call(node, WorkerOutput(epoch, job.req, (), "", True, "length", (), job.attempt))
                w.queue.popleft()
        if w.queue:
            jitter = self.rng.randint(0, w.token_us // 5)
            self._schedule(node, w, w.token_us + jitter)
