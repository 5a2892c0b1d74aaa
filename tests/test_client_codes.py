"""The error codes of the control protocol (core/protocol.py), end to end on the client side:

- every code has one HTTP status and one client error, and both clients (sync and async)
  raise that error for an answer carrying the code, whatever its text says;
- an answer with no code (an agent from before codes) or an unknown one (a newer agent)
  is a clear generic AgentError, never classified by its text;
- the shared limits keep their relations with the wire codec.

The agent is a scripted Unix socket here: each connection gets the next scripted lines.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import p2pmesh
from p2pmesh.core import protocol, wire
from p2pmesh.core.protocol import ERRORS, ErrorCode
from tests.fixtures.control_socket import control_sockets, scripted  # noqa: F401 (a fixture)

STATUS = {"node_id": "a" * 32, "pid": 1, "cluster_id": "c1", "role": "leader", "term": 1, "leader": "a" * 32,
          "commit_index": 3, "applied_index": 3, "healthy": True, "members": [],
          "placement": {"epoch": 1, "model": "m", "stages": [{"node_id": "a" * 32, "layers": [0, 4]}], "serving": True}}


@pytest.fixture
def agent_at(control_sockets: Any) -> Callable[[Callable[[dict[str, Any]], list[dict[str, Any]]]], Path]:
    """Start a fake agent answering each request with the lines `answer(request)` gives."""
    return lambda answer: control_sockets(scripted(answer)).path


def _refusing(op: str, refusal: dict[str, Any]) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """Answers status, and `op` with `refusal` (a generation's refusal as its only event)."""
    def answer(request: dict[str, Any]) -> list[dict[str, Any]]:
        if request["op"] == "status" and op != "status":
            return [{"ok": True, "status": STATUS}]
        return [refusal]
    return answer


def _raised_sync(path: Path, op: str) -> BaseException:
    client = p2pmesh.Client(path, quorum_timeout=1)
    with pytest.raises(p2pmesh.P2PMeshError) as info:
        if op == "generate":
            client.generate("hi").collect()
        elif op == "leave":
            client.leave(timeout=1)
        else:
            client.status()
    return info.value


def _raised_async(path: Path, op: str) -> BaseException:
    async def main() -> None:
        client = p2pmesh.AsyncClient(path, quorum_timeout=1)
        if op == "generate":
            await client.generate("hi").collect()
        elif op == "leave":
            await client.leave(timeout=1)
        else:
            await client.status()

    with pytest.raises(p2pmesh.P2PMeshError) as info:
        trio.run(main)
    return info.value


def test_every_code_has_one_http_status_and_one_client_error() -> None:
    assert set(ERRORS) == set(ErrorCode)
    public = {getattr(p2pmesh, n) for n in p2pmesh.__all__}
    for code, spec in ERRORS.items():
        assert spec.error in public, code  # a documented client error
        assert 400 <= spec.http_status < 600, code
        # The caller's fault (BadRequest) is a 400; a version mismatch is a 400 too, but the
        # client's own doing, so an AgentError; everything else is 429 or 5xx.
        assert (spec.http_status == 400) == (spec.error is p2pmesh.BadRequest or code is ErrorCode.UNKNOWN_OP), code
    # The client's and the HTTP API's verdicts agree on whose fault it is.
    assert ERRORS[ErrorCode.NOT_SERVING].error is p2pmesh.ModelNotLoaded
    assert ERRORS[ErrorCode.BUSY].http_status == 429 and ERRORS[ErrorCode.BUSY].retry_after_s
    assert ERRORS[ErrorCode.BUSY].error is p2pmesh.Busy and issubclass(p2pmesh.Busy, p2pmesh.AgentError)
    assert ERRORS[ErrorCode.AGENT_ERROR].http_status == 500


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
@pytest.mark.parametrize("op", ["status", "generate"])
def test_each_code_raises_its_client_error_in_both_clients(agent_at: Any, code: ErrorCode, op: str) -> None:
    # The text says something else on purpose: only the code may decide.
    refusal = protocol.error_answer(code, "no serving epoch: bad request, unknown op", final=True)
    path = agent_at(_refusing(op, refusal))
    for raised in (_raised_sync(path, op), _raised_async(path, op)):
        assert type(raised) is ERRORS[code].error, (code, op, raised)
        assert raised.error_code == code.value
        assert "no serving epoch: bad request, unknown op" in str(raised)


@pytest.mark.parametrize("answer", [
    {"ok": False, "error": "no serving epoch: the model is not placed", "final": True},
    {"ok": False, "error": "bad request: send one JSON object", "final": True},
    {"ok": False, "code": "a_code_from_a_newer_agent", "error": "unknown op 'status'", "final": True},
    {"ok": False},
], ids=["no-code-unavailable-text", "no-code-bad-request-text", "unknown-code", "nothing"])
@pytest.mark.parametrize("op", ["status", "generate", "leave"])
def test_an_answer_without_a_known_code_is_a_clear_generic_agent_error(agent_at: Any, answer: dict[str, Any], op: str) -> None:
    path = agent_at(_refusing(op, answer))
    for raised in (_raised_sync(path, op), _raised_async(path, op)):
        assert type(raised) is p2pmesh.AgentError and raised.error_code == ErrorCode.AGENT_ERROR
        assert str(answer.get("error", "")) in str(raised) and op in str(raised).replace("generation", "generate")


def test_a_generation_streams_the_same_through_both_clients(agent_at: Any) -> None:
    events = [{"ok": True, "id": "r1", "tokens": [1], "text": "a"}, {"ok": True, "id": "r1", "tokens": [], "text": ""},
              {"ok": True, "id": "r1", "tokens": [2, 3], "text": "bc", "final": True, "finish": "length", "ttft_ms": 42}]
    path = agent_at(lambda r: [{"ok": True, "status": STATUS}] if r["op"] == "status" else events)
    gen = p2pmesh.Client(path).generate("hi", max_tokens=3)
    assert list(gen) == ["a", "bc"] and list(gen) == []
    assert gen.result == p2pmesh.GenerationResult("r1", "abc", (1, 2, 3), "length", 0.042)

    async def main() -> tuple[list[str], p2pmesh.GenerationResult | None]:
        agen = p2pmesh.AsyncClient(path).generate("hi", max_tokens=3)
        return [p async for p in agen], agen.result

    assert trio.run(main) == (["a", "bc"], gen.result)


def test_a_stream_cut_before_its_end_is_an_agent_error_in_both_clients(agent_at: Any) -> None:
    events = [{"ok": True, "id": "r1", "tokens": [1], "text": "a"}]  # then the agent hangs up
    path = agent_at(lambda r: [{"ok": True, "status": STATUS}] if r["op"] == "status" else events)
    for raised in (_raised_sync(path, "generate"), _raised_async(path, "generate")):
        assert type(raised) is p2pmesh.AgentError and "before the generation ended" in str(raised)


def test_the_limits_are_one_set_with_their_relations() -> None:
    from p2pmesh.agent import http as http_api
    from p2pmesh.worker import protocol as worker

    assert protocol.PROMPT_TOKENS_MAX + protocol.GENERATE_TOKENS_MAX <= wire.SEQ_LEN_MAX
    assert protocol.SEED_LIMIT - 1 <= wire.INT_MAX
    # The worker re-checks the very constants the edge validated, and so does the HTTP API.
    assert (worker.MAX_TOKENS_CAP, worker.SEED_LIMIT, worker.MAX_PROMPT_TOKENS) == (
        protocol.GENERATE_TOKENS_MAX, protocol.SEED_LIMIT, protocol.PROMPT_TOKENS_MAX)
    assert (http_api.SEED_LIMIT, http_api.PROMPT_TOKENS_MAX, http_api.TEMPERATURE_MAX) == (
        protocol.SEED_LIMIT, protocol.PROMPT_TOKENS_MAX, protocol.TEMPERATURE_MAX)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", protocol.GENERATE_TOKENS_MAX + 1), ("seed", protocol.SEED_LIMIT), ("temperature", protocol.TEMPERATURE_MAX * 2),
    ("top_p", 0), ("prompt_tokens", [protocol.TOKEN_ID_LIMIT]), ("prompt_tokens", [1] * (protocol.PROMPT_TOKENS_MAX + 1)),
])
def test_the_edge_and_the_worker_refuse_the_same_values(field: str, value: Any) -> None:
    from p2pmesh.agent.runtime import _generate_params
    from p2pmesh.worker import protocol as worker

    request = {"prompt": "hi", field: value}
    with pytest.raises(protocol.RequestInvalid) as info:
        _generate_params(request)
    assert info.value.param == field
    with pytest.raises(worker.CommandError):
        worker.parse_command(json.dumps({"op": "generate", "id": "r", **request}))
    ok = {"prompt": "hi", "max_tokens": protocol.GENERATE_TOKENS_MAX, "seed": protocol.SEED_LIMIT - 1,
          "temperature": protocol.TEMPERATURE_MAX, "top_p": 1.0}
    _generate_params(ok)
    worker.parse_command(json.dumps({"op": "generate", "id": "r", **ok}))
