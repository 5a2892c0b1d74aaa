"""The client operations the CLI uses besides the typed ones (p2pmesh/client/plans.py):
the status as the agent's JSON object, the model op once (`set_model`), and pairing's
conversation, each through both clients (sync and async) against a scripted control socket
that speaks the protocol line by line (drivers/control.py is the real one)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
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
