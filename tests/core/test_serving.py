"""The request router (core/serving.py): origin and head roles, resuming on a new epoch
with the tokens generated so far, stale epochs, and its bounds."""
from __future__ import annotations

import dataclasses

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Capabilities, ClusterState, InferCancel, InferRequest, InferTokens, LoadReport, Member
from p2pmesh.core.protocol import ErrorCode
from p2pmesh.core.serving import (
    BEACON_MS,
    LOAD_STALE_MS,
    REQUESTS_MAX,
    SILENT_MS,
    STALE,
    STALL_MS,
    GenerateParams,
    Router,
    WorkerCancel,
    WorkerSubmit,
)

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
    head.worker_event(3, "r1", (11,), "x", False, "", (1, 2, 3), 1, 1)
    head.worker_event(3, "r1", (12,), "y", True, "stop", (), 1, 1)
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
    origin.on_tokens(InferTokens(B, "r1", 3, (), STALE, True, "error", (), 1, 1, ErrorCode.STALE_EPOCH), 2)
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
    assert submits == [] and isinstance(messages[0][1], InferTokens) and messages[0][1].code == ErrorCode.STALE_EPOCH

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
    assert [(e.finish, e.code) for e in client] == [("error", ErrorCode.BUSY), ("error", ErrorCode.AGENT_ERROR)]
    r.tick(None, None, 0, STALL_MS - 1)
    assert r.take()[2] == []
    r.tick(None, None, 0, STALL_MS)
    _, _, client = r.take()
    assert len(client) == REQUESTS_MAX and all(e.finish == "error" and e.code == ErrorCode.NOT_SERVING for e in client)


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
    head.worker_event(3, "r1", (5,), "", False, "", (), 1, 1)  # output of the old attempt
    assert head.take()[0] == []


def _beacons(router: Router) -> list[InferTokens]:
    messages, _, _ = router.take()
    return [m for _, m in messages if isinstance(m, InferTokens) and not m.tokens and not m.done]


def test_a_request_lost_on_the_way_is_asked_again_after_silence_with_the_same_attempt() -> None:
    """The transport drops what it could not deliver when a path dies (chaos found a request
    that waited the whole stall bound for it): an origin that hears nothing asks again."""
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    [(_, first)] = _requests(origin)
    origin.tick(None, B, 3, SILENT_MS - 1)
    assert _requests(origin) == []
    origin.tick(None, B, 3, SILENT_MS)
    [(dst, again)] = _requests(origin)
    assert dst == B and again == first and origin.asked_again == 1 and origin.resumed == 0
    # Asking again is not progress: a head never heard from still ends in a clear error.
    t = SILENT_MS
    while t < STALL_MS:
        t += SILENT_MS
        origin.tick(None, B, 3, t)
    [event] = origin.take()[2]
    assert event.done and event.finish == "error" and "no progress" in event.text and event.code == ErrorCode.STALLED
    assert origin.asked_again == STALL_MS // SILENT_MS - 1


def test_a_head_beacons_while_it_runs_a_request_so_a_long_prefill_is_never_asked_again() -> None:
    origin, head = Router(A), Router(B)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    [(_, req)] = _requests(origin)
    head.on_request(A, req, None)
    head.tick(None, B, 3, 0)
    [ack] = _beacons(head)  # the first tick acknowledges the request
    assert ack.seq == 0 and ack.attempt == req.attempt
    for t in range(BEACON_MS // 2, 4 * SILENT_MS, BEACON_MS // 2):  # a prefill that takes 12 s
        head.tick(None, B, 3, t)
        for beacon in _beacons(head):
            origin.on_tokens(beacon, t)
        origin.tick(None, B, 3, t)
        assert _requests(origin) == [] and origin.take()[2] == []  # no re-send, no empty client event
    # The head's worker was given the request once.
    head.worker_event(3, "r1", (11,), "x", True, "stop", (1,), req.attempt, 4 * SILENT_MS)
    for _, m in head.take()[0]:
        origin.on_tokens(m, 4 * SILENT_MS)  # type: ignore[arg-type]
    [event] = origin.take()[2]
    assert event.done and event.tokens == (11,)


def test_a_head_runs_a_copy_of_the_same_attempt_once_and_answers_it_with_a_beacon() -> None:
    head = Router(B)
    req = InferRequest(A, "r1", 3, "p", (), 4, 0.0, 1.0, 0, 1)
    head.on_request(A, req, None)
    head.tick(None, B, 3, 0)
    head.worker_event(3, "r1", (5,), "", False, "", (9,), 1, 10)
    _, submits, _ = head.take()
    assert len(submits) == 1
    head.on_request(A, req, None)  # the origin heard nothing (our frames were lost) and asks again
    head.tick(None, B, 3, 20)
    messages, submits, _ = head.take()
    assert submits == [] and [(m.seq, m.tokens) for _, m in messages] == [(1, ())]  # type: ignore[union-attr]


def test_a_beacon_ahead_of_the_stream_shows_a_lost_token_and_resumes_from_what_arrived() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    origin.take()
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (1, 2), 1, 0), 1)
    origin.on_tokens(InferTokens(B, "r1", 3, (), "", False, "", (), 1, 2), 2)  # the head sent 2; we have 1
    assert [e.tokens for e in origin.take()[2]] == [(11,)]
    origin.tick(None, B, 3, 3)
    [(dst, again)] = _requests(origin)
    assert again.attempt == 2 and again.prompt_tokens == (1, 2, 11) and origin.resumed == 1


def _served(origin: Router, head: Router, epoch: int) -> InferRequest:
    """``origin``'s one request, sent to ``head`` in ``epoch`` and handed to its worker."""
    origin.tick(None, head.me, epoch, 0)
    [(_, req)] = _requests(origin)
    head.on_request(origin.me, req, None)
    head.tick(None, head.me, epoch, 0)
    head.take()
    return req


def _deliver(head: Router, origin: Router, now_ms: int) -> None:
    messages, _, _ = head.take()
    for _, m in messages:
        origin.on_tokens(m, now_ms)  # type: ignore[arg-type]


def test_a_broken_pipeline_resumes_the_request_on_the_next_epoch_never_ends_it() -> None:
    origin, head = Router(A), Router(B)
    origin.requested("r1", PARAMS, 0)
    req = _served(origin, head, 3)
    head.worker_event(3, "r1", (11,), "x", False, "", (1, 2, 3), req.attempt, 1)
    _deliver(head, origin, 1)
    assert [e.tokens for e in origin.take()[2]] == [(11,)]
    # The tail's Mac died: the head's worker fails the request it was running.
    head.worker_event(3, "r1", (), "generation failed: [ring] connection to a peer was lost", True, "error", (), req.attempt, 2,
                      broken=True)
    assert not head.served  # the head forgets it: this epoch is over for the request
    _deliver(head, origin, 2)
    assert origin.take() == ([], [], [])  # nothing final reaches the client
    for now in (3, SILENT_MS + 3, 10 * SILENT_MS):  # nor is it sent to the broken epoch again
        origin.tick(None, B, 3, now)
        assert origin.take() == ([], [], [])
    # The cluster moves on (epoch 5, head C): the request resumes with its tokens so far.
    origin.tick(None, C, 5, 10 * SILENT_MS + 1)
    [(dst, resumed)] = _requests(origin)
    assert dst == C and resumed.epoch == 5 and resumed.prompt_tokens == (1, 2, 3, 11)
    assert resumed.max_tokens == PARAMS.max_tokens - 1 and origin.resumed == 1


def test_a_request_the_worker_refuses_ends_with_its_error() -> None:
    origin, head = Router(A), Router(B)
    origin.requested("r1", PARAMS, 0)
    req = _served(origin, head, 3)
    head.worker_event(3, "r1", (), "the prompt has 9000 tokens, more than 8192", True, "error", (), req.attempt, 1,
                      code=ErrorCode.PROMPT_REFUSED)
    _deliver(head, origin, 1)
    [event] = origin.take()[2]
    assert event.done and event.finish == "error" and "more than 8192" in event.text
    assert event.code == ErrorCode.PROMPT_REFUSED  # the client decides on the code, never the text
    assert not origin.origins and not head.served


def test_a_broken_pipeline_still_fails_after_stall_ms_without_a_new_epoch() -> None:
    origin, head = Router(A), Router(B)
    origin.requested("r1", PARAMS, 0)
    req = _served(origin, head, 3)
    head.worker_event(3, "r1", (), "peer lost", True, "error", (), req.attempt, 1, broken=True)
    _deliver(head, origin, 1)
    origin.tick(None, B, 3, STALL_MS)
    [event] = origin.take()[2]
    assert event.done and event.finish == "error" and "stuck" in event.text and event.code == ErrorCode.STALLED


def test_the_last_event_reports_the_time_to_first_token_from_the_ask_across_a_resume() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 100)
    origin.tick(None, B, 3, 100)
    _requests(origin)
    origin.on_tokens(InferTokens(B, "r1", 3, (), "", False, "", (1, 2, 3), 1, 0), 150)  # a beacon: no token yet
    origin.on_tokens(InferTokens(B, "r1", 3, (11,), "x", False, "", (1, 2, 3), 1, 0), 340)
    origin.tick(None, C, 4, 400)  # B died: resumed on C; the first token stays the one at 340
    _, _, first = origin.take()
    origin.on_tokens(InferTokens(C, "r1", 4, (12,), "y", True, "stop", (), 2, 0), 900)
    _, _, last = origin.take()
    assert [e.ttft_ms for e in first + last] == [None, 240]  # only the last event carries it


def test_a_request_that_produced_no_token_reports_no_time_to_first_token() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    _requests(origin)
    origin.on_tokens(InferTokens(B, "r1", 3, (), "prompt too long", True, "error", (), 1, 0, ErrorCode.PROMPT_REFUSED), 5)
    [event] = origin.take()[2]
    assert event.done and event.finish == "error" and event.ttft_ms is None


def test_a_client_that_hangs_up_frees_the_heads_worker_slot() -> None:
    origin, head = Router(A), Router(B)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    [(_, req)] = _requests(origin)
    head.on_request(A, req, None)
    head.tick(None, B, 3, 1)
    head.take()  # the submit
    origin.cancelled("r1", 0)
    assert not origin.origins
    messages, _, client = origin.take()
    assert client == []  # the client is gone: nothing is told to it
    [(dst, cancel)] = messages
    assert dst == B and isinstance(cancel, InferCancel) and (cancel.epoch, cancel.attempt) == (3, 1)
    head.on_cancel(A, cancel)
    _, commands, _ = head.take()
    assert commands == [WorkerCancel(3, "r1", 1)] and not head.served
    # The worker's last words about it (finish "cancelled") go nowhere.
    head.worker_event(3, "r1", (), "", True, "cancelled", (), 1, 2)
    assert head.take() == ([], [], [])


def test_a_cancel_of_another_origins_request_or_an_old_attempt_is_ignored() -> None:
    head = Router(B)
    head.on_request(A, InferRequest(A, "r1", 3, "hi", (), 4, 0.0, 1.0, 0, 2), None)
    head.tick(None, B, 3, 0)
    head.take()
    for cancel in (InferCancel(C, "r1", 3, 2), InferCancel(A, "r1", 3, 1), InferCancel(A, "r1", 2, 2)):
        head.on_cancel(cancel.src, cancel)
    assert "r1" in head.served and head.take()[1] == []


def test_a_client_that_hangs_up_before_its_request_was_sent_costs_no_message() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.cancelled("r1", 0)
    origin.cancelled("unknown", 0)  # twice, or never asked: nothing happens
    origin.tick(None, B, 3, 0)
    assert origin.take() == ([], [], [])


def test_origin_and_head_on_one_node_cancel_through_the_loopback_rounds() -> None:
    node = Router(A)
    node.requested("r1", PARAMS, 0)
    _, [submit], _ = node.step(None, A, 3, 0)
    assert submit.req == "r1"
    node.cancelled("r1", 1)
    _, commands, client = node.step(None, A, 3, 1)
    assert commands == [WorkerCancel(3, "r1", 1)] and client == [] and not node.served


# --- the serving head's load ---------------------------------------------------------------------


def _members(*ids: NodeId) -> ClusterState:
    return ClusterState("c", tuple(Member(n, 1, True, True, (), Capabilities(0, "m")) for n in ids), 1, ids, ())


def test_the_head_reports_its_batch_and_tokens_per_second_to_every_member() -> None:
    head = Router(B)
    state = _members(A, B, C)
    head.worker_load(3, 2, 1, 100, 1_000)
    messages, _, _ = head.step(state, B, 3, 1_000)
    assert sorted(dst for dst, _ in messages) == [A, C]  # every member but itself
    assert {m for _, m in messages} == {LoadReport(B, 3, 2, 1, 0.0)}  # one sample: no rate yet
    head.worker_load(3, 3, 0, 300, 2_000)
    head.worker_load(3, 3, 0, 700, 3_000)
    report = head.load_now(3, 3_000)
    assert report is not None and (report.running, report.queued, report.tokens_per_s) == (3, 0, 300.0)
    # The rate is over the last RATE_WINDOW_MS only, and a new worker's counter starts again.
    for t in range(4_000, 12_001, 1_000):
        head.worker_load(3, 3, 0, 700 + (t - 3_000) // 10, t)
    assert head.load_now(3, 12_000).tokens_per_s == 100.0  # type: ignore[union-attr]
    head.worker_load(4, 1, 0, 5, 12_500)
    assert head.load_now(4, 12_500).tokens_per_s == 0.0  # type: ignore[union-attr]
    assert head.load_now(3, 12_500) is None  # an older epoch's report says nothing


def test_a_member_keeps_the_heads_report_only_while_it_is_fresh() -> None:
    origin, head = Router(A), Router(B)
    state = _members(A, B)
    head.worker_load(3, 1, 0, 10, 0)
    [(_, report)] = head.step(state, B, 3, 0)[0]
    origin.on_message(B, report, state, 100)
    assert origin.load_now(3, 100) == report
    assert origin.load_now(3, 100 + LOAD_STALE_MS + 1) is None
    origin.on_message(C, LoadReport(B, 3, 9, 9, 1.0), state, 200)  # forged by another member: ignored
    assert origin.load_now(3, 200) == report
    not_head = Router(C)
    not_head.worker_load(3, 1, 0, 10, 0)  # a stale worker of a node no longer the head says nothing to others
    assert not_head.step(state, B, 3, 0)[0] == []


def test_a_lost_cancel_is_sent_again_when_the_head_speaks_of_the_request() -> None:
    origin = Router(A)
    origin.requested("r1", PARAMS, 0)
    origin.tick(None, B, 3, 0)
    _requests(origin)
    origin.cancelled("r1", 100)
    [(_, cancel)] = origin.take()[0]  # lost on the way
    # The head still streams: a token, then beacons; each answered with the cancel again,
    # at most once per BEACON_MS.
    origin.on_tokens(InferTokens(B, "r1", 3, (7,), "x", False, "", (1,), 1, 0), 200)
    assert origin.take()[0] == []  # too soon after the first
    origin.on_tokens(InferTokens(B, "r1", 3, (), "", False, "", (), 1, 1), 100 + BEACON_MS)
    assert origin.take() == ([(B, cancel)], [], [])  # and nothing reaches the gone client
    origin.on_tokens(InferTokens(B, "r1", 3, (), "", True, "cancelled", (), 1, 1), 2_000 + BEACON_MS)
    assert origin.take() == ([], [], []) and "r1" not in origin.hung_up  # its end: forgotten


def test_a_new_attempt_frees_the_slot_of_the_one_it_replaces() -> None:
    head = Router(B)
    first = InferRequest(A, "r1", 3, "hi", (), 4, 0.0, 1.0, 0, 1)
    head.on_request(A, first, None)
    head.tick(None, B, 3, 0)
    assert [type(c) for c in head.take()[1]] == [WorkerSubmit]
    head.on_request(A, dataclasses.replace(first, attempt=2), None)  # the origin lost a frame: again
    head.tick(None, B, 3, 1)
    commands = head.take()[1]
    assert commands[0] == WorkerCancel(3, "r1", 1) and isinstance(commands[1], WorkerSubmit) and commands[1].attempt == 2
