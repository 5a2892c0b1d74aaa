"""The simulator's fake head worker (sim/fake_head.py) alone: it batches with the worker's
own scheduler (core/batching.py), its tokens are the fake model's, batching is faster in
aggregate than one request at a time, and its checks catch a scheduler that breaks FIFO
admission, starves a request or keeps a cancelled one's slot."""
from __future__ import annotations

import random
from collections import defaultdict

import pytest

from p2pmesh.core.batching import Request, Scheduler
from p2pmesh.core.protocol import WORKER_BUSY
from sim.checks import InvariantViolated
from sim.fake_head import PREFILL_CHUNK, FakeHead, StepCost
from sim.fake_model import expected_output, tokenize

COST = StepCost(base_us=10_000, row_us=500, prompt_token_us=1_000, jitter_us=0)


def _prompt(i: int, words: int = 6) -> tuple[int, ...]:
    return tokenize(" ".join(f"p{i}w{j}" for j in range(words)))


def _run(head: FakeHead, now_us: int = 0, iterations: int = 10_000) -> tuple[int, list[dict[str, object]]]:
    """Run the head's loop until it is idle: (the virtual time at the end, its events)."""
    rng = random.Random(1)
    events: list[dict[str, object]] = []
    for _ in range(iterations):
        took = head.start(rng)
        if took is None:
            return now_us, events
        now_us += took
        events += head.finish(now_us)
    raise AssertionError("the head did not become idle")


def _streams(events: list[dict[str, object]]) -> dict[str, tuple[list[int], str]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, str] = {}
    for e in events:
        if e["event"] == "token":
            tokens[str(e["id"])].append(int(e["token"]))  # type: ignore[call-overload]
        elif e["event"] == "done":
            finish[str(e["id"])] = str(e["finish"])
    return {rid: (tokens[rid], f) for rid, f in finish.items()}


def test_batched_requests_get_their_own_tokens_and_finish_far_sooner() -> None:
    prompts = {f"r{i}@1": _prompt(i) for i in range(8)}
    took = {}
    for batch in (1, 8):
        head = FakeHead(batch, 64, 2, COST)
        for rid, prompt in prompts.items():
            assert head.submit(rid, prompt, 30, (), 0) == []
        took[batch], events = _run(head)
        streams = _streams(events)
        assert set(streams) == set(prompts)
        for rid, prompt in prompts.items():
            want, finish = expected_output(prompt, 30)
            assert streams[rid] == (list(want), finish), rid
        assert head.most_running == batch
    assert took[8] * 3 < took[1], took  # one step for eight rows costs little more than for one


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps() -> None:
    head = FakeHead(4, 4, 1, COST)
    short, long = _prompt(1, 2), _prompt(2, 10 * PREFILL_CHUNK)
    head.submit("short@1", short, 40, (), 0)
    events: list[dict[str, object]] = []
    rng = random.Random(0)
    now = 0
    while not any(e["event"] == "token" for e in events):  # the short one decodes
        now += head.start(rng) or 0
        events += head.finish(now)
    head.submit("long@1", long, 5, (), now)
    per_iteration = []
    while not any(e.get("id") == "long@1" and e["event"] == "token" for e in events):
        now += head.start(rng) or 0
        got = head.finish(now)
        events += got
        per_iteration.append(sum(1 for e in got if e.get("id") == "short@1" and e["event"] == "token"))
    # Ten chunks of the long prompt, each next to one decode step of the short request.
    assert per_iteration == [1] * 10


def test_beyond_the_batch_and_the_queue_it_answers_busy() -> None:
    head = FakeHead(2, 1, 1, COST)
    answers = [head.submit(f"r{i}@1", _prompt(i), 5, (), 0) for i in range(4)]
    assert answers[:3] == [[], [], []]
    (refusal,) = answers[3]
    assert refusal["event"] == "error" and refusal["code"] == WORKER_BUSY and refusal["id"] == "r3@1"
    assert head.busy_refusals == 1
    _, events = _run(head)
    assert set(_streams(events)) == {"r0@1", "r1@1", "r2@1"}


def test_a_cancel_ends_the_request_at_once_and_its_slot_goes_to_the_queued_one() -> None:
    head = FakeHead(1, 1, 1, COST)
    head.submit("a@1", _prompt(1), 40, (), 0)
    head.submit("b@1", _prompt(2), 3, (), 0)
    rng = random.Random(0)
    now = head.start(rng) or 0
    assert head.sched.running == 1 and "b@1" in {r.rid for r in head.sched.queue}
    (done,) = head.cancel("a@1")  # while its step is in flight
    assert done == {"event": "done", "id": "a@1", "tokens": 0, "finish": "cancelled"}
    assert head.cancel("a@1") == [] and head.cancels == 1
    head.finish(now)
    assert not head.sched.known("a@1")
    end, events = _run(head, now)
    assert set(_streams(events)) == {"b@1"}


# ------------------------------------------------------------------------------------------
# Planted bugs: a scheduler that breaks a promise, and the check that catches it


class _LifoScheduler(Scheduler):
    """Admits the newest request first."""

    def _admit(self) -> None:
        while self.queue and self.running < self.max_batch:
            r = self.queue.pop()
            self.active[r.rid] = r


class _SlotKeepingScheduler(Scheduler):
    """Keeps a cancelled request in the batch until it would have ended."""

    def _forget(self, r: Request) -> None:
        if not r.cancelled:
            super()._forget(r)


class _NewestPrefillScheduler(Scheduler):
    """Prefills the newest request first: an old long prompt waits while newcomers go by."""

    def plan(self):  # type: ignore[no-untyped-def]
        self._admit()
        self.active = dict(sorted(self.active.items(), key=lambda item: -item[1].no))
        return super().plan()


def _planted(scheduler: type[Scheduler], batch: int, queue: int) -> FakeHead:
    head = FakeHead(batch, queue, 1, COST)
    head.sched = scheduler(batch, queue, PREFILL_CHUNK, 1)
    return head


def test_a_scheduler_admitting_out_of_order_is_caught() -> None:
    head = _planted(_LifoScheduler, 1, 8)
    for i in range(3):
        head.submit(f"r{i}@1", _prompt(i), 2, (), 0)
    with pytest.raises(InvariantViolated) as e:
        _run(head)
    assert e.value.invariant == "fifo-admission"


def test_a_scheduler_keeping_a_cancelled_slot_is_caught() -> None:
    head = _planted(_SlotKeepingScheduler, 2, 2)
    head.submit("a@1", _prompt(1), 20, (), 0)
    rng = random.Random(0)
    now = head.start(rng) or 0
    head.cancel("a@1")
    with pytest.raises(InvariantViolated) as e:
        head.finish(now)
    assert e.value.invariant == "cancel-frees-slot"


def test_a_scheduler_starving_an_old_prompt_is_caught() -> None:
    head = _planted(_NewestPrefillScheduler, 8, 8)
    rng = random.Random(0)
    now = 0
    head.submit("old@1", _prompt(0, 40), 1, (), now)
    with pytest.raises(InvariantViolated) as e:
        for i in range(200):  # a newcomer with a long prompt every iteration
            head.submit(f"new{i}@1", _prompt(i + 1, 40), 1, (), now)
            now += head.start(rng) or 0
            head.finish(now)
    assert e.value.invariant == "starved"
