"""The continuous-batching scheduler (core/batching.py) alone: no MLX, a fake model.

The fake "model" answers every sampled row with a token derived from (request number,
position), so each request's stream is known in advance whatever the batch does."""
from __future__ import annotations

import pytest

from p2pmesh.core.batching import (
    DecodeStep,
    Finished,
    PrefillStep,
    ReleaseStep,
    Sampling,
    Scheduler,
    SchedulerError,
    Step,
    Token,
)

EOS = 999


def fake_tokens(step: Step) -> list[int]:
    rows = [step.row] if isinstance(step, PrefillStep) else list(step.rows) if isinstance(step, DecodeStep) else []
    return [100 * r.no + r.position + len(r.tokens) for r in rows if r.sample]


def run(s: Scheduler, steps_seen: list[Step] | None = None, limit: int = 10_000) -> list[Token | Finished]:
    out: list[Token | Finished] = []
    for _ in range(limit):
        if s.idle:
            return out
        steps = s.plan()
        assert steps, "a scheduler with work must plan a step"
        if steps_seen is not None:
            steps_seen.extend(steps)
        for step in steps:
            out += s.complete(step, fake_tokens(step))
    raise AssertionError("did not finish")


def test_requests_run_together_each_with_its_own_positions_and_limits() -> None:
    s = Scheduler(max_batch=4, max_queue=4, prefill_chunk=4)
    for i, (n, m) in enumerate([(3, 12), (9, 10), (1, 1), (6, 8)]):
        assert s.submit(f"r{i}", list(range(1, n + 1)), m, Sampling(), frozenset({EOS}))
    steps: list[Step] = []
    out = run(s, steps)
    for i, (n, m) in enumerate([(3, 12), (9, 10), (1, 1), (6, 8)]):
        toks = [o.token for o in out if isinstance(o, Token) and o.rid == f"r{i}"]
        # The first token comes from the prefill (position n), then one per decode step.
        assert toks == [100 * i + n + k for k in range(m)]
        assert Finished(f"r{i}", m, "length") in out
    decode_sizes = [len(st.rows) for st in steps if isinstance(st, DecodeStep)]
    assert max(decode_sizes) >= 3  # they did decode as a batch
    released = sorted(no for st in steps if isinstance(st, ReleaseStep) for no in st.nos)
    assert released == [0, 1, 2, 3]  # every request's caches are freed on the stages


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps() -> None:
    s = Scheduler(max_batch=4, max_queue=0, prefill_chunk=8)
    s.submit("short", [1, 2], 30, Sampling(), frozenset())
    run_until = s.plan()
    for step in run_until:
        s.complete(step, fake_tokens(step))
    s.submit("long", list(range(1, 41)), 2, Sampling(), frozenset())  # 5 chunks of 8
    kinds = []
    while "long" not in [o.rid for o in kinds if isinstance(o, Token)]:
        for step in s.plan():
            kinds += s.complete(step, fake_tokens(step)) if isinstance(step, DecodeStep) else []
            if isinstance(step, PrefillStep):
                kinds.append(Token("chunk", step.row.position, False))
                s.complete(step, fake_tokens(step))
                if step.row.sample:
                    kinds.append(Token("long", 0, True))
    seq = [o.rid for o in kinds]
    # Every chunk of the long prompt is preceded by a token of the short request.
    assert seq.count("chunk") == 5
    for i, rid in enumerate(seq):
        if rid == "chunk":
            assert seq[i - 1] == "short", seq


def test_the_queue_is_bounded_and_fifo() -> None:
    s = Scheduler(max_batch=2, max_queue=1, prefill_chunk=8)
    assert s.submit("a", [1], 3, Sampling(), frozenset())
    assert s.submit("b", [1], 3, Sampling(), frozenset())
    s.plan()  # a and b take the two slots (b waits for its prefill)
    assert s.submit("c", [1], 3, Sampling(), frozenset())
    assert not s.submit("d", [1], 3, Sampling(), frozenset())  # busy
    with pytest.raises(ValueError, match="already running"):
        s.submit("a", [1], 3, Sampling(), frozenset())


def test_cancel_frees_the_slot_at_once_and_the_caches_when_nothing_is_in_flight() -> None:
    s = Scheduler(max_batch=1, max_queue=2, prefill_chunk=2)
    s.submit("a", [1, 2, 3, 4, 5], 10, Sampling(), frozenset())
    s.submit("b", [1], 2, Sampling(), frozenset())
    s.submit("q", [1], 2, Sampling(), frozenset())
    (step,) = s.plan()  # a's first chunk, in flight
    assert isinstance(step, PrefillStep) and step.row.no == 0
    assert s.cancel("q") == Finished("q", 0, "cancelled")  # from the queue
    assert s.cancel("a") == Finished("a", 0, "cancelled")
    assert s.cancel("a") is None and s.cancel("nobody") is None
    assert s.running == 0
    # The chunk in flight completes; its result is dropped and its caches released.
    assert s.complete(step, fake_tokens(step)) == []
    steps = s.plan()
    assert isinstance(steps[0], ReleaseStep) and steps[0].nos == (0,)
    assert isinstance(steps[1], PrefillStep) and steps[1].row.no == 1  # b got the slot
    for st in steps:
        s.complete(st, fake_tokens(st))
    out = run(s)
    assert Finished("b", 2, "length") in out and all(o.rid == "b" for o in out)


def test_eos_ends_a_request_without_streaming_it() -> None:
    s = Scheduler(max_batch=2, max_queue=0, prefill_chunk=8)
    s.submit("a", [1, 2], 10, Sampling(), frozenset({3}))  # what the first decode step samples
    out = run(s)
    assert out == [Token("a", 2, True), Finished("a", 1, "stop")]


def test_decode_groups_share_the_requests_and_results_must_match() -> None:
    s = Scheduler(max_batch=8, max_queue=0, prefill_chunk=8, groups=2)
    for i in range(4):
        s.submit(f"r{i}", [1, 2], 6, Sampling(), frozenset())
    steps: list[Step] = []
    run(s, steps)
    groups = {st.group: {r.no for r in st.rows} for st in steps if isinstance(st, DecodeStep) and len(st.rows) == 2}
    assert groups == {0: {0, 2}, 1: {1, 3}}
    s.submit("x", [1], 3, Sampling(), frozenset())
    (step,) = s.plan()
    with pytest.raises(SchedulerError):
        s.complete(step, [1, 2])
