"""Continuous batching on rank 0: which requests run, and what the next pipeline steps are.

Owns the decisions only (no MLX, no I/O, no clock): the queue of waiting requests, the
running batch (at most `max_batch` requests, each with its own position), the decode
groups (micro-batches), and the steps to send. The worker (worker/serve.py) feeds it
requests, cancels and step results; its engine (worker/pipeline.py) runs the steps it
returns. It lives in the core, pure and deterministic, so that the simulator's fake head
worker (sim/dataplane.py) runs the very same decisions on virtual time.

One iteration of the worker's loop:
  1. `plan()`: the steps to start now, in order: RELEASE of requests that left (their KV
     caches are freed on every stage), one DECODE step per decode group that has no step in
     flight (all its requests advance by one token), then at most one PREFILL chunk (of the
     oldest request still prefilling; its last chunk is sampled: the request's first token).
  2. the engine runs them (one stage: at once; several: through the ring, in order);
  3. `complete(step, tokens)` for each finished step, oldest first: Token and Finished
     outcomes for the worker to stream.
So a newcomer's prompt is cut into chunks of at most `prefill_chunk` tokens, one chunk per
iteration, between the running requests' decode steps: a long prompt never stalls them.

A request joins a decode group (the smallest) once its prefill produced its first token,
and leaves it when it finishes (EOS, max tokens) or is cancelled; every stage mirrors the
groups from the rows each DECODE step lists (the request numbers and positions), so rank 0
is the only one deciding. Fairness: the queue is FIFO, prefill goes oldest first, and every
decoding request advances once per step of its group.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Row:
    """One request's part of a step: its number (unique in this worker), the tokens its
    caches hold before the step, the token ids it feeds, and whether its last position is
    sampled (with its own sampling parameters)."""

    no: int
    position: int
    tokens: tuple[int, ...]
    sample: bool
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """A chunk of at most ``prefill_chunk`` tokens of one request's prompt (its last chunk's
    row is sampled: the first token); `first`: its caches start empty."""

    row: Row
    first: bool


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One token for each request of a decode group, in the group's order."""

    group: int
    """The decode group's index: a group has at most one step in flight, so its requests
    advance in lockstep while the other groups' steps fill the pipeline's other stages."""
    rows: tuple[Row, ...]


@dataclass(frozen=True, slots=True)
class ReleaseStep:
    """Forget these requests' caches on every stage."""

    nos: tuple[int, ...]


Step = PrefillStep | DecodeStep | ReleaseStep


@dataclass(frozen=True, slots=True)
class Token:
    """A request's next generated token, for the worker to stream."""

    rid: str
    token: int
    first: bool
    """The request's first token (sampled at the end of its prefill): time to first token
    ends here."""


@dataclass(frozen=True, slots=True)
class Finished:
    """A request's end: ``tokens`` generated in all (an EOS token is not counted, nor
    streamed) and ``finish``: "stop" (EOS), "length" (max_new reached) or "cancelled"."""

    rid: str
    tokens: int
    finish: str


Outcome = Token | Finished


@dataclass(slots=True)
class Request:
    """A request the scheduler holds (mutable bookkeeping, never shared)."""

    rid: str
    no: int
    """Its number in this worker (``Row.no``): what the stages key its caches by, unique
    for the worker's life, while ``rid`` is the client's name for it."""
    prompt: tuple[int, ...]
    max_new: int
    sampling: Sampling
    eos: frozenset[int]
    prefilled: int = 0
    generated: int = 0
    last: int = -1
    """The last sampled token (-1: none yet): the input of its next decode step."""
    group: int | None = None
    in_flight: int = 0
    """Its steps planned but not yet completed: its slot and caches are freed only at 0,
    when no stage may still hold a row of it."""
    cancelled: bool = False
    phase: str = PREFILL

    @property
    def position(self) -> int:
        """Tokens its caches hold: the prompt's prefilled part, then one per decode step
        (the last sampled token is fed back, so it is not cached yet)."""
        return self.prefilled + max(0, self.generated - 1)


class SchedulerError(Exception):
    """A step result that does not match what was planned: a bug, never a request's fault."""


@dataclass
class Scheduler:
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 128
    groups: int = 1
    queue: deque[Request] = field(default_factory=deque)
    active: dict[str, Request] = field(default_factory=dict)
    members: list[list[str]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    group_busy: list[bool] = field(default_factory=list)
    prefill_busy: bool = False
    _next_no: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0 or self.prefill_chunk < 1 or self.groups < 1:
            raise ValueError("max_batch, prefill_chunk and groups must be >= 1 and max_queue >= 0")
        self.members = [[] for _ in range(self.groups)]
        self.group_busy = [False] * self.groups

    # -- requests in and out --------------------------------------------------------

    def known(self, rid: str) -> bool:
        return rid in self.active or any(r.rid == rid for r in self.queue)

    def submit(self, rid: str, prompt: Sequence[int], max_new: int, sampling: Sampling, eos: frozenset[int]) -> bool:
        """Queue a request; False when the queue is full (the caller refuses it: busy)."""
        if not prompt or max_new < 1:
            raise ValueError("a request needs a prompt and max_new >= 1")
        if self.known(rid):
            raise ValueError(f"request {rid!r} is already running")
        # Busy when every slot is taken and the queue is full (requests not admitted yet
        # count as queued: admission happens at the next plan()).
        if self.running + len(self.queue) >= self.max_batch + self.max_queue:
            return False
        self.queue.append(Request(rid, self._next_no, tuple(prompt), max_new, sampling, eos))
        self._next_no += 1
        return True

    def cancel(self, rid: str) -> Finished | None:
        """End a request now (None if unknown or already ended). Its slot is free at once;
        its caches are released once no step of it is in flight."""
        for r in self.queue:
            if r.rid == rid:
                self.queue.remove(r)
                return Finished(rid, 0, "cancelled")
        r = self.active.get(rid)
        if r is None or r.cancelled:
            return None
        r.cancelled = True
        self._leave(r)
        return Finished(rid, r.generated, "cancelled")

    @property
    def idle(self) -> bool:
        """Nothing to run and nothing in flight."""
        return not self.queue and not self.active and not self.released and not self.in_flight

    @property
    def in_flight(self) -> bool:
        return self.prefill_busy or any(self.group_busy)

    @property
    def running(self) -> int:
        """Requests holding a slot (not counting cancelled ones still in flight)."""
        return sum(1 for r in self.active.values() if not r.cancelled)

    # -- planning ---------------------------------------------------------------------

    def plan(self) -> list[Step]:
        """The steps to start now (see the module comment); each is in flight until
        `complete` gets its result."""
        self._admit()
        steps: list[Step] = []
        if self.released:
            steps.append(ReleaseStep(tuple(self.released)))
            self.released = []
        for g, ids in enumerate(self.members):
            if ids and not self.group_busy[g]:
                rows = []
                for rid in ids:
                    r = self.active[rid]
                    rows.append(Row(r.no, r.position, (r.last,), True, r.sampling))
                    r.in_flight += 1
                self.group_busy[g] = True
                steps.append(DecodeStep(g, tuple(rows)))
        if not self.prefill_busy:
            r = next((r for r in self.active.values() if r.phase == PREFILL and not r.cancelled and not r.in_flight), None)
            if r is not None:
                chunk = r.prompt[r.prefilled : r.prefilled + self.prefill_chunk]
                last = r.prefilled + len(chunk) == len(r.prompt)
                steps.append(PrefillStep(Row(r.no, r.prefilled, chunk, last, r.sampling), r.prefilled == 0))
                r.in_flight += 1
                self.prefill_busy = True
        return steps

    def _admit(self) -> None:
        while self.queue and self.running < self.max_batch:
            r = self.queue.popleft()
            self.active[r.rid] = r

    # -- results ------------------------------------------------------------------------

    def complete(self, step: Step, tokens: Sequence[int]) -> list[Outcome]:
        """The result of a step: the sampled tokens, one per row that samples."""
        if isinstance(step, ReleaseStep):
            return []
        if isinstance(step, PrefillStep):
            self.prefill_busy = False
            return self._advance([step.row], tokens, decode=False)
        self.group_busy[step.group] = False
        return self._advance(list(step.rows), tokens, decode=True)

    def _advance(self, rows: list[Row], tokens: Sequence[int], decode: bool) -> list[Outcome]:
        sampled = [row for row in rows if row.sample]
        if len(tokens) != len(sampled):
            raise SchedulerError(f"{len(tokens)} tokens for {len(sampled)} sampled rows")
        by_no = {r.no: r for r in self.active.values()}
        out: list[Outcome] = []
        it = iter(tokens)
        for row in rows:
            r = by_no.get(row.no)
            if r is None:
                raise SchedulerError(f"a result for request number {row.no}, which is not running")
            r.in_flight -= 1
            tok = next(it) if row.sample else None
            if not decode:
                r.prefilled += len(row.tokens)
            if r.cancelled:
                self._forget(r)
                continue
            if tok is None:
                continue
            if tok in r.eos:
                out.append(Finished(r.rid, r.generated, "stop"))
                self._leave(r)
                self._forget(r)
                continue
            r.generated += 1
            r.last = tok
            out.append(Token(r.rid, tok, r.generated == 1))
            if r.generated >= r.max_new:
                out.append(Finished(r.rid, r.generated, "length"))
                self._leave(r)
                self._forget(r)
            elif r.phase == PREFILL:
                r.phase = DECODE
                r.group = min(range(self.groups), key=lambda g: (len(self.members[g]), g))
                self.members[r.group].append(r.rid)
        return out

    def _leave(self, r: Request) -> None:
        """Out of its decode group: the next step of that group no longer lists it."""
        if r.group is not None:
            self.members[r.group].remove(r.rid)
            r.group = None
        if not r.in_flight:
            self._forget(r)

    def _forget(self, r: Request) -> None:
        """No step of it in flight any more: free its slot and, on the stages, its caches."""
        if r.in_flight or self.active.get(r.rid) is not r:
            return
        del self.active[r.rid]
        if r.prefilled or r.generated:
            self.released.append(r.no)
