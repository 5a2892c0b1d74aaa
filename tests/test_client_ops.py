"""The client operations the CLI uses besides the typed ones (p2pmesh/client/plans.py):
the status as the agent's JSON object, the model op once (`set_model`), pairing's
conversation, and the low level the tools and tests use for raw ops (`call`, `stream`),
each through both clients (sync and async) against a scripted control socket that speaks
the protocol line by line (drivers/control.py is the real one)."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

import p2pmesh
from p2pmesh.core.protocol import ErrorCode, error_answer
from tests.fixtures.control_socket import control_sockets  # noqa: F401 (a fixture)

def both(path: Path, call: Callable[[Any], Any], acall: Callable[[Any], Any]) -> list[Any]:
    """The result of `call(Client)` and of `await acall(AsyncClient)`, or the error each raised."""
    out: list[Any] = []
    try:
        out.append(call(p2pmesh.Client(path)))
    except p2pmesh.P2PMeshError as exc:
        out.append(exc)

    async def main() -> Any:
        try:
            return await acall(p2pmesh.AsyncClient(path))
        except p2pmesh.P2PMeshError as exc:
            return exc

    out.append(trio.run(main))
    return out


STATUS = {"node_id": "a" * 32, "role": "leader", "an_agent_field_the_client_does_not_type": [1, 2]}


def test_status_object_is_the_agents_json_as_sent(control_sockets: Any) -> None:
    agent = control_sockets(lambda r, read, send: send({"ok": True, "status": STATUS}))
    assert both(agent.path, lambda c: c.status_object(), lambda c: c.status_object(timeout=2)) == [STATUS, STATUS]
    assert agent.requests == [{"op": "status"}] * 2
    shapeless = control_sockets(lambda r, read, send: send({"ok": True, "status": [1]}))
    for raised in both(shapeless.path, lambda c: c.status_object(), lambda c: c.status_object()):
        assert type(raised) is p2pmesh.AgentError and "no status object" in str(raised)


def test_set_model_asks_once_and_says_what_was_accepted(control_sockets: Any, tmp_path: Path) -> None:
    described = {"name": "", "layers": 4, "layer_bytes": 1000, "context_tokens": 256}

    def talk(r: dict[str, Any], read: Any, send: Any) -> None:
        if r["name"] is None:
            send({"ok": True, "model": None})
        elif r["name"] == "org/broken":
            send(error_answer(ErrorCode.MODEL_INVALID, "not a model we run"))
        else:
            send({"ok": True, "model": {**described, "name": r["name"]}})

    agent = control_sockets(talk)
    model = tmp_path / "m"
    model.mkdir()
    info = p2pmesh.ModelInfo(str(model.resolve()), 4, 1000, 256)
    assert both(agent.path, lambda c: c.set_model(model, context_tokens=256),
                lambda c: c.set_model(model, context_tokens=256)) == [info, info]
    # A local directory goes as an absolute path (the agent may run elsewhere).
    assert agent.requests[0] == {"op": "model", "name": str(model.resolve()), "context_tokens": 256}
    assert both(agent.path, lambda c: c.set_model(None), lambda c: c.set_model(None)) == [None, None]
    for raised in both(agent.path, lambda c: c.set_model("org/broken"), lambda c: c.set_model("org/broken")):
        assert type(raised) is p2pmesh.BadRequest and raised.error_code == "model_invalid"
        assert "not a model we run" in str(raised)


def _pairing(r: dict[str, Any], read: Any, send: Any) -> None:
    """The agent's side of a pairing (drivers/control._pair): events, a question, the end."""
    assert r == {"op": "pair", "join": True, "timeout_s": 5}
    send({"ok": True, "event": "waiting", "role": "guest"})
    send({"ok": True, "event": "code", "code": "123456", "question": "do both Macs show this code?"})
    answer = read()
    send({"ok": True, "paired": bool(answer and answer.get("same_code") is True), "final": True, "peer": "b" * 32})


def test_pair_emits_each_event_and_answers_the_question(control_sockets: Any) -> None:
    agent = control_sockets(_pairing)
    asked: list[str] = []

    def answer(yes: bool) -> Callable[[dict[str, Any]], bool]:
        def decide(event: dict[str, Any]) -> bool:
            asked.append(event["code"])
            return yes
        return decide

    async def collect(c: p2pmesh.AsyncClient, yes: bool) -> list[dict[str, Any]]:
        return [e async for e in c.pair(window=5, answer=answer(yes), join=True)]

    for yes in (True, False):
        got = both(agent.path, lambda c: list(c.pair(window=5, answer=answer(yes), join=True)),
                   lambda c: collect(c, yes))
        for events in got:
            assert [e.get("event") for e in events] == ["waiting", "code", None]
            assert events[-1]["final"] is True and events[-1]["paired"] is yes
    assert asked == ["123456"] * 4
    assert agent.answers == [{"same_code": True}] * 2 + [{"same_code": False}] * 2


def test_a_pairing_the_agent_cuts_or_refuses_is_a_typed_error(control_sockets: Any) -> None:
    def cut(r: dict[str, Any], read: Any, send: Any) -> None:
        send({"ok": True, "event": "waiting", "role": "host"})  # then it hangs up

    def old_agent(r: dict[str, Any], read: Any, send: Any) -> None:
        send(error_answer(ErrorCode.UNKNOWN_OP, "unknown op 'pair'"))

    async def collect(c: p2pmesh.AsyncClient) -> list[dict[str, Any]]:
        return [e async for e in c.pair(window=5, answer=lambda e: True)]

    for talk, kind, words in ((cut, p2pmesh.AgentError, "before its end"), (old_agent, p2pmesh.AgentError, "same version")):
        path = control_sockets(talk).path
        for raised in both(path, lambda c: list(c.pair(window=5, answer=lambda e: True)), collect):
            assert type(raised) is kind and words in str(raised), raised


def test_call_sends_any_op_and_returns_the_answer_as_sent(control_sockets: Any) -> None:
    page = {"ok": True, "cluster_id": "c" * 32, "commit": 3, "entries": [[1, 1, "ab"], [2, 1, "cd"]]}

    def talk(r: dict[str, Any], read: Any, send: Any) -> None:
        if r.get("after", 0) < 0:
            send(error_answer(ErrorCode.BAD_REQUEST, "log: after and count_max must be non-negative integers"))
        elif r["op"] == "members":
            send(error_answer(ErrorCode.NO_QUORUM, "no leader confirmed the read within 5 s; retry"))
        else:
            send(page)

    agent = control_sockets(talk)
    assert both(agent.path, lambda c: c.call("log", after=0, count_max=2),
                lambda c: c.call("log", timeout=2, after=0, count_max=2)) == [page, page]
    assert agent.requests == [{"op": "log", "after": 0, "count_max": 2}] * 2  # `timeout` is the client's, not a field
    for raised in both(agent.path, lambda c: c.call("log", after=-1), lambda c: c.call("log", after=-1)):
        assert type(raised) is p2pmesh.BadRequest and raised.error_code == "bad_request" and "non-negative" in str(raised)
    for raised in both(agent.path, lambda c: c.call("members"), lambda c: c.call("members")):
        assert type(raised) is p2pmesh.NoQuorum and raised.error_code == "no_quorum"


def _tokens(r: dict[str, Any], read: Any, send: Any) -> None:
    """A token-id generation (no prompt text): the events as the agent streams them."""
    if r["prompt_tokens"] == [1, 99999]:
        send({"ok": False, "final": True, "finish": "error", "code": "prompt_refused",
              "error": "token 99999 is outside the model's vocabulary"})
        return
    send({"ok": True, "id": "r1", "tokens": [7], "text": "a"})
    send({"ok": True, "id": "r1", "tokens": [8], "text": "b", "final": True, "finish": "length"})


def test_stream_yields_the_raw_events_and_raises_an_error_event_by_its_code(control_sockets: Any) -> None:
    agent = control_sockets(_tokens)

    async def collect(c: p2pmesh.AsyncClient, tokens: list[int]) -> list[dict[str, Any]]:
        return [e async for e in c.stream("generate", idle_timeout=5, prompt_tokens=tokens, max_tokens=2)]

    for events in both(agent.path, lambda c: list(c.stream("generate", prompt_tokens=[1, 2], max_tokens=2)),
                       lambda c: collect(c, [1, 2])):
        assert [e["tokens"] for e in events] == [[7], [8]] and events[-1]["final"] is True
    assert agent.requests == [{"op": "generate", "prompt_tokens": [1, 2], "max_tokens": 2}] * 2
    for raised in both(agent.path, lambda c: list(c.stream("generate", prompt_tokens=[1, 99999])),
                       lambda c: collect(c, [1, 99999])):
        assert type(raised) is p2pmesh.BadRequest and raised.error_code == "prompt_refused"
        assert "outside the model's vocabulary" in str(raised)


def test_an_agent_that_goes_silent_is_an_agent_timeout_not_an_answer(control_sockets: Any) -> None:
    """The client's own bound passing is AgentTimeout (the request's fate unknown), which a
    tool can tell from any error the agent reported (those carry a code)."""
    def silent(r: dict[str, Any], read: Any, send: Any) -> None:
        if r["op"] == "generate":
            send({"ok": True, "id": "r1", "tokens": [7], "text": "a"})
        time.sleep(1.0)  # then nothing within the client's bound

    agent = control_sockets(silent)

    async def collect(c: p2pmesh.AsyncClient) -> list[dict[str, Any]]:
        return [e async for e in c.stream("generate", idle_timeout=0.3, prompt="x")]

    for raised in both(agent.path, lambda c: list(c.stream("generate", idle_timeout=0.3, prompt="x")), collect):
        assert type(raised) is p2pmesh.AgentTimeout and raised.error_code is None, raised
        assert isinstance(raised, p2pmesh.AgentError) and "0.3 s" in str(raised)
    for raised in both(agent.path, lambda c: c.call("status", timeout=0.3), lambda c: c.call("status", timeout=0.3)):
        assert type(raised) is p2pmesh.AgentTimeout, raised
