"""The head's fake worker: rank 0's command loop on virtual time, batching with the very
scheduler the real worker runs (core/batching.Scheduler).

What p2pmesh/worker/serve.py's Server does with a real engine, ``FakeHead`` does with the
fake model (sim/fake_model.py) and a fake step time, answering with the same
worker/protocol.py events:
- ``submit``: a generate command. Refused with a ``busy`` error event when the batch and the
  queue are full (``Scheduler.submit`` says no), as the real worker does;
- ``cancel``: a cancel command (the client hung up): the request ends at once with finish
  "cancelled", its slot is free, its caches go at the next token boundary;
- ``start``: one iteration of the loop: the scheduler's steps (a RELEASE, one DECODE step per
  decode group, at most one PREFILL chunk) and how long they take (``StepCost``: a base cost
  per iteration, a small one per decoding row and one per prompt token of the chunk, drawn
  per worker from the seed), so b requests decoding together cost far less than b alone;
- ``finish``: the iteration's results: the fake model's token for every sampled row, given to
  the scheduler, whose outcomes become ``token`` and ``done`` events.
When an iteration ends, and whether the group is stalled or broken meanwhile, is the world's
side (sim/dataplane.py).

Checked as it runs (InvariantViolated, sim/checks.py):
- ``fifo-admission``: a request gets a slot only when no request submitted before it still
  waits in the queue;
- ``batch-bound``: never more than max_batch requests hold a slot;
- ``starved``: a request's first output (its first token, or its end) comes within the
  iterations (checked at the end of every iteration, so a request that never gets one is
  caught on time) that the work ahead of it at its submit needs when run one request at a time
  (every other request's prefill chunks left plus its tokens left) plus its own prefill
  chunks: each iteration runs a chunk or a token of that work, since admission is FIFO and
  prefill goes oldest first. In virtual time: that many of the longest iterations (full
  batch, full chunk, most jitter), plus the one in flight at its submit, plus the time the
  group was stalled;
- ``cancel-frees-slot``: a cancelled request holds no slot from the cancel on, and nothing of
  it is left in the scheduler once the iteration in flight at its cancel has ended.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from p2pmesh.core.batching import DecodeStep, Finished, Outcome, PrefillStep, ReleaseStep, Request, Row, Sampling, Scheduler, Step
from p2pmesh.core.protocol import WORKER_BUSY
from sim.checks import InvariantViolated
from sim.fake_model import EOS, context_hash, mix, next_token

PREFILL_CHUNK = 4
"""Prompt tokens per prefill step: small, so that the scenario's prompts (a few to some
dozens of tokens, more when resumed) take several chunks between the others' decode steps."""
STEP_US = (5_000, 25_000)
"""An iteration's base cost (the pipeline's pass, whatever the batch), drawn per worker."""
ROW_US = (200, 1_500)
"""The cost of one more decoding row in an iteration."""
PROMPT_TOKEN_US = (300, 2_000)
"""The cost of one prompt token of a prefill chunk."""
_GREEDY = Sampling()
_STOP = frozenset({EOS})

Event = dict[str, object]


@dataclass(frozen=True, slots=True)
class StepCost:
    """Virtual time of one iteration of a head worker's loop."""

    base_us: int
    row_us: int
    prompt_token_us: int
    jitter_us: int
    """Most jitter added to an iteration (a fifth of the base)."""

    def of(self, rows: int, prompt_tokens: int, jitter_us: int) -> int:
        return self.base_us + self.row_us * rows + self.prompt_token_us * prompt_tokens + jitter_us

    def longest(self, max_batch: int) -> int:
        """The longest iteration: every slot decoding, a full prefill chunk, the most jitter."""
        return self.of(max_batch, PREFILL_CHUNK, self.jitter_us)


def draw_cost(rng: random.Random) -> StepCost:
    base = rng.randint(*STEP_US)
    return StepCost(base, rng.randint(*ROW_US), rng.randint(*PROMPT_TOKEN_US), base // 5)


@dataclass(slots=True)
class _Job:
    """A request the fake head holds: the fake model's state and what its bound is."""

    ident: str
    no: int
    """The scheduler's number for it."""
    h: int
    """Hash of the context so far (prompt plus generated)."""
    report_prompt: tuple[int, ...]
    submitted_us: int
    iteration: int
    """Iterations started before its submit."""
    bound: int
    """Iterations within which its first output must come (see the module comment)."""
    stalled_us: int
    """The head's stalled time at its submit."""
    first: bool = True


def _chunks(tokens: int) -> int:
    return -(-tokens // PREFILL_CHUNK)


def _work(r: Request) -> int:
    """Iterations ``r`` still needs alone: its prefill chunks left and its tokens left."""
    return _chunks(len(r.prompt) - r.prefilled) + r.max_new - r.generated


class FakeHead:
    """Rank 0 of one fake worker group: its scheduler, the fake model, its bookkeeping."""

    def __init__(self, max_batch: int, max_queue: int, groups: int, cost: StepCost) -> None:
        self.sched = Scheduler(max_batch, max_queue, PREFILL_CHUNK, groups)
        self.cost = cost
        self.jobs: dict[str, _Job] = {}
        """ident (req@attempt) -> its job, while the scheduler holds it."""
        self.waiting: dict[str, _Job] = {}
        """The jobs with no output yet (their first output's bound is checked)."""
        self.nos: dict[int, str] = {}
        """The scheduler's request number -> ident."""
        self.in_flight: list[Step] = []
        self.iterations = 0
        """Iterations started."""
        self.stalled_us = 0
        """Virtual time an iteration waited for a stalled group (a Mac asleep, a hop cut)."""
        self.loaded_us = 0
        self.cancelled: set[str] = set()
        """Cancelled requests, to check once the iteration in flight has ended."""
        self.busy_refusals = 0
        self.cancels = 0
        """Cancels of requests it held (queued or running)."""
        self.most_running = 0

    @property
    def max_batch(self) -> int:
        return self.sched.max_batch

    @property
    def idle(self) -> bool:
        return self.sched.idle and not self.in_flight

    # -- commands -----------------------------------------------------------------------

    def submit(self, ident: str, prompt: tuple[int, ...], max_tokens: int, report: tuple[int, ...], now_us: int) -> list[Event]:
        """A generate command; the events it answers at once (a refusal, or the end of a
        request that asks for nothing more)."""
        first: Event = {"prompt_tokens": list(report)} if report else {}
        if max_tokens < 1:  # a resume that asks only for the rest, and nothing is left
            return [{"event": "done", "id": ident, "tokens": 0, "finish": "length", **first}]
        s = self.sched
        ahead = sum(_work(r) for r in (*s.active.values(), *s.queue) if not r.cancelled)
        if not s.submit(ident, prompt, max_tokens, _GREEDY, _STOP):
            self.busy_refusals += 1
            return [{"event": "error", "id": ident, "code": WORKER_BUSY,
                     "message": f"{s.running} requests running and {len(s.queue)} queued: the worker is full, try again later"}]
        no = s.queue[-1].no
        self.nos[no] = ident
        job = _Job(ident, no, context_hash(prompt), report, now_us, self.iterations, ahead + _chunks(len(prompt)), self.stalled_us)
        self.jobs[ident] = self.waiting[ident] = job
        return []

    def cancel(self, ident: str) -> list[Event]:
        """A cancel command: the request's end (finish "cancelled"), or nothing when it is
        not held (already ended, or refused)."""
        finished = self.sched.cancel(ident)
        if finished is None:
            return []
        held = self.sched.active.get(ident)
        if held is not None and not held.cancelled:
            raise InvariantViolated("cancel-frees-slot", f"{ident} still holds a slot after its cancel")
        self.cancels += 1
        self.cancelled.add(ident)
        return [self._end(finished)]

    # -- the loop -----------------------------------------------------------------------

    def start(self, rng: random.Random) -> int | None:
        """Start an iteration: its duration in virtual µs, or None when there is nothing to run."""
        if self.in_flight or self.sched.idle:
            return None
        s = self.sched
        before = set(s.active)
        steps = s.plan()
        waiting = min((r.no for r in s.queue), default=None)
        for rid, r in s.active.items():
            if rid not in before and waiting is not None and r.no > waiting:
                raise InvariantViolated("fifo-admission", f"{rid} got a slot while {self.nos.get(waiting)}, submitted before it, waits")
        if s.running > s.max_batch:
            raise InvariantViolated("batch-bound", f"{s.running} requests hold a slot in a batch of {s.max_batch}")
        self.most_running = max(self.most_running, s.running)
        if not steps:
            return None
        self.in_flight = steps
        self.iterations += 1
        rows = sum(len(st.rows) for st in steps if isinstance(st, DecodeStep))
        prompt = sum(len(st.row.tokens) for st in steps if isinstance(st, PrefillStep))
        return self.cost.of(rows, prompt, rng.randint(0, self.cost.jitter_us))

    def stall(self, us: int) -> None:
        """The iteration in flight waited ``us`` for a stalled group."""
        self.stalled_us += us

    def finish(self, now_us: int) -> list[Event]:
        """End the iteration in flight: its outcomes as events, in order."""
        events: list[Event] = []
        steps, self.in_flight = self.in_flight, []
        for step in steps:
            for outcome in self.sched.complete(step, self._sample(step)):
                events.append(self._event(outcome))
        for job in self.waiting.values():
            self._check_bound(job, now_us)
        for ident in self.cancelled:
            if self.sched.known(ident):
                raise InvariantViolated("cancel-frees-slot", f"{ident} is still in the scheduler an iteration after its cancel")
        self.cancelled.clear()
        return events

    def _sample(self, step: Step) -> list[int]:
        """The fake model's token for every row that samples (a cancelled request's row still
        gets one: the scheduler drops it, as the real worker's sampled row is dropped)."""
        if isinstance(step, ReleaseStep):
            return []
        rows: Sequence[Row] = (step.row,) if isinstance(step, PrefillStep) else step.rows
        out = []
        for row in rows:
            if row.sample:
                job = self.jobs.get(self.nos.get(row.no, ""))
                out.append(next_token(job.h) if job is not None else EOS)
        return out

    def _event(self, outcome: Outcome) -> Event:
        job = self.jobs[outcome.rid]
        self.waiting.pop(outcome.rid, None)  # its first output: within the bound, checked until now
        if isinstance(outcome, Finished):
            return self._end(outcome)
        job.h = mix(job.h, outcome.token)
        event: Event = {"event": "token", "id": outcome.rid, "token": outcome.token, "text": f"t{outcome.token} "}
        if job.report_prompt and job.first:
            event["prompt_tokens"] = list(job.report_prompt)
        job.first = False
        return event

    def _end(self, f: Finished) -> Event:
        job = self.jobs.pop(f.rid)
        self.waiting.pop(f.rid, None)
        del self.nos[job.no]
        event: Event = {"event": "done", "id": f.rid, "tokens": f.tokens, "finish": f.finish}
        if job.report_prompt and job.first:
            event["prompt_tokens"] = list(job.report_prompt)
        return event

    def _check_bound(self, job: _Job, now_us: int) -> None:
        """At the end of an iteration: ``job`` has no output yet, and must still be in time."""
        waited = self.iterations - job.iteration
        if waited >= job.bound:
            raise InvariantViolated("starved", f"{job.ident}: no output after {waited} iterations, the most that the "
                                    f"work ahead of it and its own prefill ({job.bound}) take one request at a time")
        since = max(job.submitted_us, self.loaded_us)
        took = now_us - since - (self.stalled_us - job.stalled_us)
        limit = (job.bound + 1) * self.cost.longest(self.max_batch)
        if took >= limit:
            raise InvariantViolated("starved", f"{job.ident}: no output {took} µs after its submit (not counting stalls), "
                                    f"{job.bound + 1} of the longest iterations")
