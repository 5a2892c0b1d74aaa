"""The HTTP API's request schema (p2pmesh/agent/http/schema.py) through the real ASGI app,
in-process, with a stub agent that serves a model: every bad field is a 400 whose `param`
is the field's path; unknown fields are ignored except inside response_format; the body's
size, top-level type and nested messages; and what a valid body becomes (the request the
agent receives). Fast: no agent process, no model, no tokenizer."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from p2pmesh.agent.http import HttpApi, HttpLimits, Loaded, Tokenizers, parse_chat, parse_completion
from p2pmesh.agent.http.schema import MESSAGES_MAX
from p2pmesh.core import protocol
from tests.fixtures.asgi import post

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY_BYTES_MAX = 1 << 18  # room for more than MESSAGES_MAX messages
USER = {"role": "user", "content": "hi"}


class _Agent:
    """Serves one model; records each generate request and answers two tokens."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def status(self) -> dict[str, Any]:
        return {"node_id": "ab" * 16, "role": "leader", "healthy": True, "placement": {"model": "m", "serving": True}}

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        yield {"ok": True, "id": "r1", "tokens": [5], "text": "hi"}
        yield {"ok": True, "id": "r1", "tokens": [6], "text": "!", "final": True, "finish": "length"}


class _NoTokenizers(Tokenizers):
    async def get(self, name: str) -> Loaded:
        return Loaded(None)


def _call(path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any], _Agent]:
    agent = _Agent()
    app = HttpApi(agent, token=None, limits=HttpLimits(max_body_bytes=BODY_BYTES_MAX))
    app.tokenizers = _NoTokenizers()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = trio.run(post, app, path, raw)
    assert app.active == 0
    return status, json.loads(answer), agent


def _refused(path: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
    """The error object of a 400, after checking that nothing reached the agent."""
    status, answer, agent = _call(path, body)
    assert status == 400, answer
    assert agent.requests == []
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return dict(error)


# ------------------------------------------------------------------------------------
# Each bad field: 400, param is its path, code invalid_value


_BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    (COMPLETIONS, {"prompt": 3}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),  # one prompt per request (_one_prompt)
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 2, -1]}, "prompt[2]"),
    (COMPLETIONS, {"prompt": [protocol.TOKEN_ID_LIMIT]}, "prompt[0]"),
    (COMPLETIONS, {"prompt": [1.5]}, "prompt[0]"),
    (COMPLETIONS, {"prompt": [True]}, "prompt[0]"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": protocol.GENERATE_TOKENS_MAX + 1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": protocol.TEMPERATURE_MAX * 1.01}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, "seed"),
    (COMPLETIONS, {"prompt": "x", "seed": protocol.SEED_LIMIT}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "stream_options": []}, "stream_options"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (COMPLETIONS, {"prompt": "x", "stop": ""}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 5}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", 1]}, "stop[1]"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", "b" * 257]}, "stop[1]"),
    (COMPLETIONS, {"prompt": "x", "model": 3}, "model"),
    (COMPLETIONS, {"prompt": "x", "n": 2}, "n"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format.type"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 3}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "suffix": "end"}, "suffix"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
    (CHAT, {"messages": [USER], "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": [USER], "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": [USER], "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), _BAD_FIELDS, ids=[f"{p}:{b}" for _, b, p in _BAD_FIELDS])
def test_each_bad_field_is_a_400_naming_it(path: str, body: dict[str, Any], param: str) -> None:
    error = _refused(path, body)
    assert error["param"] == param and error["code"] == "invalid_value", error
    assert param in error["message"], error


# ------------------------------------------------------------------------------------
# Nested message errors


_BAD_MESSAGES: list[tuple[Any, str]] = [
    (None, "messages"),
    ([], "messages"),
    ("hi", "messages"),
    ([USER] * (MESSAGES_MAX + 1), "messages"),
    ([USER, 3], "messages[1]"),
    ([USER, {"content": "x"}], "messages[1].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([USER, {"role": "user", "content": 5}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
     "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
]


@pytest.mark.parametrize(("messages", "param"), _BAD_MESSAGES, ids=[p for _, p in _BAD_MESSAGES])
def test_a_bad_message_is_named_by_its_path(messages: Any, param: str) -> None:
    error = _refused(CHAT, {"messages": messages})
    assert error["param"] == param and error["code"] == "invalid_value", error


def test_a_bad_role_says_which_roles_there_are() -> None:
    error = _refused(CHAT, {"messages": [{"role": "wizard", "content": "x"}]})
    assert all(role in error["message"] for role in ("system", "developer", "user", "assistant", "tool")), error


# ------------------------------------------------------------------------------------
# The body itself: its JSON, its top-level type, its size


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("raw", [b"[1, 2]", b"null", b'"prompt"', b"3", b"true"])
def test_a_body_that_is_not_an_object_is_a_400_without_param(path: str, raw: bytes) -> None:
    error = _refused(path, raw)
    assert error["param"] is None and "JSON object" in error["message"], error


@pytest.mark.parametrize("raw", [b"", b"  \n", b"{not json", b'{"prompt": "x"} trailing', b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "\xff"}', b'{"prompt": "x", "z": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"])
def test_a_body_that_is_not_json_is_a_400_without_param(raw: bytes) -> None:
    error = _refused(COMPLETIONS, raw)
    assert error["param"] is None and "JSON" in error["message"], error


def test_a_body_over_the_limit_is_413() -> None:
    body = json.dumps({"prompt": "x" * BODY_BYTES_MAX}).encode()
    status, answer, agent = _call(COMPLETIONS, body)
    assert status == 413 and answer["error"]["code"] == "request_too_large" and agent.requests == []
    # Just under the limit is parsed as usual.
    status, _, agent = _call(COMPLETIONS, {"prompt": "x" * (BODY_BYTES_MAX - 64)})
    assert status == 200 and len(agent.requests) == 1


def test_a_utf8_bom_and_utf16_bodies_are_still_taken() -> None:
    """json.loads took them (RFC 8259 allows ignoring a BOM); the schema keeps taking them."""
    body = {"prompt": "héllo", "max_tokens": 3, "temperature": 0}
    for raw in (b"\xef\xbb\xbf" + json.dumps(body).encode(), json.dumps(body, ensure_ascii=False).encode("utf-16")):
        status, _, agent = _call(COMPLETIONS, raw)
        assert status == 200 and agent.requests[0]["prompt"] == "héllo", raw[:20]


# ------------------------------------------------------------------------------------
# Unknown fields: ignored, except inside response_format


def test_unknown_fields_are_ignored() -> None:
    """OpenAI clients send fields this server does not use (user, metadata, a message's
    name, a part's cache_control): they change nothing."""
    status, _, agent = _call(COMPLETIONS, {"prompt": "x", "max_tokens": 3, "temperature": 0, "user": "u1",
                                           "metadata": {"a": [1, {"b": None}]}, "some_future_field": 2**80})
    assert status == 200 and agent.requests[0]["max_tokens"] == 3
    status, _, agent = _call(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                                "cache_control": {}}], "name": "ann"}],
                                    "user": "u1", "stream_options": {"include_usage": False, "later": 1},
                                    "parallel_tool_calls": False})
    assert status == 200 and len(agent.requests) == 1


def test_features_that_are_off_are_accepted() -> None:
    off = {"n": 1, "best_of": 1, "echo": False, "logprobs": 0, "top_logprobs": 0, "logit_bias": {}, "tools": [],
           "functions": [], "tool_choice": "auto", "function_call": "none", "presence_penalty": 0,
           "frequency_penalty": 0.0, "response_format": {"type": "text"}, "suffix": None}
    status, answer, agent = _call(COMPLETIONS, {"prompt": "x", **off})
    assert status == 200 and len(agent.requests) == 1, answer


def test_response_format_refuses_unknown_fields() -> None:
    """Anything beyond {"type": "text"} would change the answer: refused, as before."""
    error = _refused(COMPLETIONS, {"prompt": "x", "response_format": {"type": "text", "json_schema": {}}})
    assert error["param"] == "response_format.json_schema", error
    error = _refused(COMPLETIONS, {"prompt": "x", "response_format": {}})
    assert error["param"] == "response_format.type" and "required" in error["message"], error


# ------------------------------------------------------------------------------------
# What a valid body becomes


def test_a_valid_completion_reaches_the_agent_as_given() -> None:
    status, answer, agent = _call(COMPLETIONS, {"prompt": ["once"], "max_tokens": 7, "temperature": 3,
                                                "top_p": 0.5, "seed": 9, "stop": "\n"})
    assert status == 200 and answer["choices"][0]["text"] == "hi!"
    assert agent.requests == [{"prompt": "once", "prompt_tokens": None, "max_tokens": 7, "temperature": 3.0,
                               "top_p": 0.5, "seed": 9}]
    status, _, agent = _call(COMPLETIONS, {"prompt": [1, 2, 3]})
    assert status == 200 and agent.requests[0]["prompt_tokens"] == [1, 2, 3] and agent.requests[0]["max_tokens"] == 16


def test_parsed_values() -> None:
    c = parse_completion(b'{"prompt": "x", "stop": ["a", "b"], "stream": true, "stream_options": {"include_usage": true}}')
    assert (c.prompt, c.options.stop, c.options.stream, c.options.include_usage) == ("x", ("a", "b"), True, True)
    assert 0 <= c.options.seed < protocol.SEED_LIMIT  # drawn when not given
    r = parse_chat(json.dumps({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None}],
                               "max_tokens": 5, "max_completion_tokens": 9}).encode())
    assert [(m.role, m.content) for m in r.messages] == [("system", "ab"), ("assistant", "")]
    assert r.options.max_tokens == 9 and r.options.stop == ()
    assert parse_chat(b'{"messages": [{"role": "user"}]}').options.max_tokens == 1024
