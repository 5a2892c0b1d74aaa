"""The request router (core/serving.py): origin and head roles, resuming on a new epoch
with the tokens generated so far, stale epochs, and its bounds."""
from __future__ import annotations

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import InferRequest, InferTokens
from p2pmesh.core.serving import REQUESTS_MAX, STALE, STALL_MS, GenerateParams, Router

A, B, C = NodeId("a" * 32), NodeId("b" * 32), NodeId("c" * 32)
PARAMS = GenerateParams("hello", (), 6, 0.0, 1.0, 0)


def _requests(router: Router) -> list[tuple[NodeId, InferRequest]]:
    messages, _, _ = router.take()
    return [(dst, m) for dst, m in messages if isinstance(m, InferRequest)]


def test_origin_sends_to_the_head_and_streams_tokens_to_its_client() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    [(dst, req)] = _requests(origin)
    assert dst == B and req.epoch == 3 and req.prompt == "hello" and req.max_tokens == 6

    head = Router(B)
    head.on_request(A, req, None)
    head.tick(None, B, 3, 1)
    _, submits, _ = head.take()
    assert [s.req for s in submits] == ["r1"] and submits[0].params.prompt == "hello"
    head.worker_event(3, "r1", (11,), "x", False, "", (1, 2, 3), 1)
    head.worker_event(3, "r1", (12,), "y", True, "stop", (), 1)
    messages, _, _ = head.take()
    assert [dst for dst, _ in messages] == [A, A]
    for _, m in messages:
        origin.on_tokens(m, 2)  # type: ignore[arg-type]
    _, _, client = origin.take()
    assert [e.tokens for e in client] == [(11,), (12,)]
    assert client[-1].done and client[-1].finish == "stop"
    assert not origin.origins and not head.served


def test_an_epoch_change_resumes_with_prompt_plus_generated_tokens() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    [(_, first)] = _requests(origin)
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (1, 2, 3), 1, 0), 1)
    origin.on_tokens(InferTokens(B, "r1", 3, (12,), "y", False, "", (), 1, 1), 2)
    origin.take()
    # B died; the cluster moved to epoch 4 whose head is C.
    origin.tick(None, C, 4, 3)
    [(dst, resumed)] = _requests(origin)
    assert dst == C and resumed.epoch == 4
    assert resumed.prompt is None and resumed.prompt_tokens == (1, 2, 3, 11, 12)
    assert resumed.max_tokens == PARAMS.max_tokens - 2
    assert origin.resumed == 1
    # A late token from the dead epoch is not counted twice.
    origin.on_tokens(InferTokens(B, "r1", 3, (99,), "z", False, "", (), 1, 2), 4)
    assert origin.take()[2] == []
    origin.on_tokens(InferTokens(C, "r1", 4, (13,), "w", True, "stop", (), 2, 0), 5)
    _, _, client = origin.take()
    assert client[0].tokens == (13,) and client[0].done


def test_a_request_sent_again_after_a_stale_answer_counts_as_resumed() -> None:
    """The head moved to a new epoch before the origin saw it and answered STALE: the origin
    sends the request again once it catches up, and that re-send is counted like any other
    (it used to be missed, so `requests_resumed` read 0 after a real resume)."""
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    origin.take()
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (1, 2, 3), 1, 0), 1)
    origin.on_tokens(InferTokens(B, "r1", 3, (), STALE, True, "error", (), 1, 1), 2)
    origin.tick(None, B, 4, 3)
    [(dst, again)] = _requests(origin)
    assert dst == B and again.epoch == 4 and again.prompt_tokens == (1, 2, 3, 11)
    assert origin.resumed == 1


def test_a_resumed_request_stops_at_the_original_length() -> None:
    origin = Router(A)
    origin.requested("r1", GenerateParams("p", (), 2, 0.0, 1.0, 0), 0)
    origin.tick(None, B, 1, 0)
    origin.take()
    origin.on_tokens(InferTokens(B, "r1", 1, (5,), "", False, "", (7,), 1, 0), 1)
    origin.on_tokens(InferTokens(B, "r1", 1, (6,), "", False, "", (), 1, 1), 2)
    _, _, client = origin.take()
    assert client[-1].done and client[-1].finish == "length"


def test_a_head_that_moved_on_answers_stale_and_the_origin_waits_for_its_own_view() -> None:
    head = Router(B)
    head.on_request(A, InferRequest(A, "r1", 3, "p", (), 4, 0.0, 1.0, 0, 1), None)
    head.tick(None, C, 4, 0)  # epoch 4 is active here already, and B is not its head
    messages, submits, _ = head.take()
    assert submits == [] and isinstance(messages[0][1], InferTokens) and messages[0][1].text == STALE

    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    origin.take()
    origin.on_tokens(messages[0][1], 1)
    origin.tick(None, B, 3, 2)  # our state still says epoch 3: do not hammer B
    assert _requests(origin) == []
    origin.tick(None, C, 4, 3)
    [(dst, req)] = _requests(origin)
    assert dst == C and req.epoch == 4


def test_a_request_for_an_epoch_the_head_has_not_applied_yet_waits() -> None:
    head = Router(B)
    head.on_request(A, InferRequest(A, "r1", 5, "p", (), 4, 0.0, 1.0, 0), None)
    head.tick(None, B, 4, 0)
    assert head.take()[1] == []
    head.tick(None, B, 5, 1)
    assert [s.req for s in head.take()[1]] == ["r1"]


def test_bounds_duplicate_ids_and_no_serving_epoch() -> None:
    r = Router(A)
    for i in range(REQUESTS_MAX):
        r.requested(f"r{i}", PARAMS, 0)
    r.requested("one-too-many", PARAMS, 0)
    r.requested("r0", PARAMS, 0)
    _, _, client = r.take()
    assert [e.finish for e in client] == ["error", "error"]
    r.tick(None, None, 0, STALL_MS - 1)
    assert r.take()[2] == []
    r.tick(None, None, 0, STALL_MS)
    _, _, client = r.take()
    assert len(client) == REQUESTS_MAX and all(e.finish == "error" for e in client)


def test_without_the_prompt_tokens_a_resume_replays_and_skips_what_the_client_has() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    origin.take()
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (), 1, 0), 1)  # no prompt tokens reported
    origin.take()
    origin.tick(None, C, 4, 2)
    [(_, again)] = _requests(origin)
    assert again.prompt == "hello" and again.max_tokens == PARAMS.max_tokens
    origin.on_tokens(InferTokens(C, "r1", 4, (11,), "x", False, "", (), 2, 0), 3)  # the replayed first token
    assert origin.take()[2] == []
    origin.on_tokens(InferTokens(C, "r1", 4, (12,), "y", False, "", (), 2, 1), 4)
    assert [e.tokens for e in origin.take()[2]] == [(12,)]


def test_a_lost_frame_is_detected_by_its_sequence_number_and_the_request_sent_again() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    origin.take()
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (1, 2), 1, 0), 1)
    origin.on_tokens(InferTokens(B, "r1", 3, (13,), "z", False, "", (), 1, 2), 2)  # seq 1 never came
    assert [e.tokens for e in origin.take()[2]] == [(11,)]
    origin.tick(None, B, 3, 3)
    [(dst, again)] = _requests(origin)
    assert dst == B and again.attempt == 2 and again.prompt_tokens == (1, 2, 11)
    # Late frames of the abandoned attempt are ignored; the new attempt streams from seq 0.
    origin.on_tokens(InferTokens(B, "r1", 3, (12,), "y", False, "", (), 1, 1), 4)
    origin.on_tokens(InferTokens(B, "r1", 3, (12,), "y", False, "", (), 2, 0), 5)
    assert [e.tokens for e in origin.take()[2]] == [(12,)]


def test_a_head_keeps_only_the_newest_attempt() -> None:
    head = Router(B)
    head.on_request(A, InferRequest(A, "r1", 3, "p", (), 4, 0.0, 1.0, 0, 2), None)
    head.on_request(A, InferRequest(A, "r1", 3, "p", (), 4, 0.0, 1.0, 0, 1), None)  # a late copy
    head.tick(None, B, 3, 0)
    [submit] = head.take()[1]
    assert submit.attempt == 2
    head.worker_event(3, "r1", (5,), "", False, "", (), 1)  # output of the old attempt
    assert head.take()[0] == []
