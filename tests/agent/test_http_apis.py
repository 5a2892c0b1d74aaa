"""The APIs tools expect besides OpenAI's completions and chat: OpenAI Responses
(/v1/responses), Anthropic Messages (/v1/messages) and Ollama (/api/chat, /api/generate,
/api/tags, /api/show), each through its real client package (openai, anthropic, ollama).

- Against a real agent: the module-scoped cluster of test_http_api.py (its fixtures: one
  in-process agent serving the tiny templated model on loopback). Each API's greedy text,
  whole and streamed, equals the agent's own `generate` output for the same rendered
  prompt and OpenAI's endpoint for the same request; usage counts equal the tokens the
  template rendered and the tokens produced; errors come in each API's own format and status.
- Against a stub agent (fast, scripted): an error mid-stream, a refusal before the first
  token, the other finish reasons, and a client hanging up, in each format.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest
import trio

from tests.agent.test_http_api import (  # noqa: F401 - module-scoped fixtures, one cluster for this module
    PROMPT,
    TEMPLATE,
    TOKEN,
    WAIT_S,
    Served,
    Stub,
    _request,
    _stub_server,
    _tokenizer,
    models,
    served,
)

N = 12
SYSTEM, USER = "be brief", "hello there"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
GREEDY = {"temperature": 0}
"""For the anthropic client, whose newer versions have no `temperature` argument (older
clients and other tools send the field, which the API takes)."""


@pytest.fixture(scope="module")
def want(served: Served) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens): the agent's own greedy generation for
    MESSAGES rendered through the template, checked against OpenAI's chat completions."""
    ids = _tokenizer(served.model).encode(f"<s>[system] {SYSTEM}\n[user] {USER}\n[assistant]", add_special_tokens=False)
    text, tokens, _ = served.generate(prompt_tokens=ids, max_tokens=N, temperature=0.0)
    assert len(tokens) == N
    r = served.client().chat.completions.create(model="any", messages=MESSAGES, max_tokens=N, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == text and r.usage is not None and r.usage.prompt_tokens == len(ids)
    return text, len(ids), len(tokens)


def _anthropic(url: str, key: str = TOKEN) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def _ollama(url: str, token: str | None = TOKEN) -> ollama.Client:
    return ollama.Client(host=url, timeout=60, headers={"Authorization": f"Bearer {token}"} if token else {})


def _post(url: str, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    status, _, answer = _request(url, "POST", path, json.dumps(body).encode(), headers)
    return status, answer


# ------------------------------------------------------------------------------------
# OpenAI Responses


def test_responses_whole_and_streamed(served: Served, want: tuple[str, int, int]) -> None:
    text, prompt_tokens, completion_tokens = want
    client = served.client()
    r = client.responses.create(model="any", instructions=SYSTEM, input=USER, max_output_tokens=N, temperature=0)
    assert r.object == "response" and r.model == str(served.model)
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"  # cut by max_output_tokens, as OpenAI says it
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    # Input items: the same conversation as a list of messages with text parts.
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}]
    assert client.responses.create(model="any", input=items, max_output_tokens=N, temperature=0).output_text == text  # type: ignore[arg-type]

    events = list(client.responses.create(model="any", instructions=SYSTEM, input=USER, max_output_tokens=N,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text and len(deltas) > 1  # really streamed
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1].response  # type: ignore[union-attr]
    assert last.output_text == text and last.usage is not None and last.usage.output_tokens == completion_tokens


def test_responses_errors_are_openais(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="any", input=[{"role": "robot", "content": "hi"}])  # type: ignore[list-item]
    assert info.value.param == "input[0].role" and "one of user" in info.value.message
    status, answer = _post(served.url, "/v1/responses", {"input": "hi", "max_output_tokens": "ten"})
    assert status == 400 and answer["error"]["param"] == "max_output_tokens" and "Expected `int | null`, got `str`" in answer["error"]["message"]
    status, answer = _post(served.url, "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]})
    assert status == 400 and answer["error"]["param"] == "tools"
    status, answer = _post(served.url, "/v1/responses", {"max_output_tokens": 3})
    assert status == 400 and answer["error"]["param"] == "input" and "input is required" in answer["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong-token-0123456789", max_retries=0).responses.create(
            model="any", input="hi")


# ------------------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_messages_whole_and_streamed(served: Served, want: tuple[str, int, int]) -> None:
    text, prompt_tokens, completion_tokens = want
    client = _anthropic(served.url)
    m = client.messages.create(model="claude-any", system=SYSTEM, messages=[{"role": "user", "content": USER}],
                               max_tokens=N, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == str(served.model)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text  # type: ignore[union-attr]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (prompt_tokens, completion_tokens)

    # Text blocks and a system given as blocks render the same conversation.
    blocks = client.messages.create(model="claude-any", system=[{"type": "text", "text": SYSTEM}], max_tokens=N,
                                    messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
                                    extra_body=GREEDY)
    assert blocks.content[0].text == text  # type: ignore[union-attr]

    with client.messages.stream(model="claude-any", system=SYSTEM, messages=[{"role": "user", "content": USER}],
                                max_tokens=N, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text and len(pieces) > 1
    assert final.content[0].text == text and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt_tokens, completion_tokens)
    raw = [e.type for e in client.messages.create(model="claude-any", messages=[{"role": "user", "content": USER}],
                                                  max_tokens=3, extra_body=GREEDY, stream=True)]
    assert raw[:2] == ["message_start", "content_block_start"] and set(raw[2:-3]) == {"content_block_delta"}
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequences(served: Served, want: tuple[str, int, int]) -> None:
    text = want[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    client = _anthropic(served.url)
    args: dict[str, Any] = dict(model="x", system=SYSTEM, messages=[{"role": "user", "content": USER}], max_tokens=N,
                                extra_body=GREEDY, stop_sequences=[stop])
    m = client.messages.create(**args)
    assert m.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**args) as stream:
        assert "".join(stream.text_stream) == text[: text.index(stop)]
        assert stream.get_final_message().stop_sequence == stop


def test_anthropic_errors_are_anthropics(served: Served) -> None:
    user = [{"role": "user", "content": "hi"}]
    status, answer = _post(served.url, "/v1/messages", {"model": "m", "messages": user})  # no max_tokens
    assert status == 400
    assert answer == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens is required"}}
    status, answer = _post(served.url, "/v1/messages", {"model": "m", "messages": user, "max_tokens": "ten"})
    assert status == 400 and answer["error"]["message"].startswith("max_tokens: Expected `int`")
    client = _anthropic(served.url)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "system", "content": "hi"}])  # type: ignore[list-item]
    body: Any = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].role" in body["error"]["message"] and "one of user, assistant" in body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        _anthropic(served.url, key="wrong-token-0123456789").messages.create(model="m", max_tokens=4, messages=user)  # type: ignore[arg-type]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # The token as a bearer header (anthropic's auth_token) is taken too.
    bearer = anthropic.Anthropic(base_url=served.url, auth_token=TOKEN, max_retries=0, timeout=60)
    assert bearer.messages.create(model="m", max_tokens=2, messages=user).usage.output_tokens == 2  # type: ignore[arg-type]
    status, _, answer = _request(served.url, "GET", "/v1/messages")
    assert status == 405 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------
# Ollama


def test_ollama_chat_whole_and_streamed(served: Served, want: tuple[str, int, int]) -> None:
    text, prompt_tokens, completion_tokens = want
    client, model = _ollama(served.url), str(served.model)
    options = {"temperature": 0, "num_predict": N}
    r = client.chat(model=model, messages=MESSAGES, stream=False, options=options)
    assert r.message.role == "assistant" and r.message.content == text and r.model == model
    assert r.done and r.done_reason == "length"
    assert (r.prompt_eval_count, r.eval_count) == (prompt_tokens, completion_tokens)
    assert r.total_duration and r.eval_duration and r.prompt_eval_duration
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration - 1
    parts = list(client.chat(model=model + ":latest", messages=MESSAGES, stream=True, options=options))
    assert "".join(p.message.content or "" for p in parts) == text and len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == completion_tokens and parts[-1].prompt_eval_count == prompt_tokens
    # No messages: Ollama's way to load a model, answered at once.
    assert client.chat(model=model, messages=[], stream=False).done_reason == "load"


def test_ollama_generate_raw_and_templated(served: Served, want: tuple[str, int, int]) -> None:
    client, model = _ollama(served.url), str(served.model)
    completion = served.client().completions.create(model="any", prompt=PROMPT, max_tokens=N, temperature=0)
    raw = client.generate(model=model, prompt=PROMPT, raw=True, stream=False, options={"temperature": 0, "num_predict": N})
    assert raw.response == completion.choices[0].text
    assert completion.usage is not None and raw.prompt_eval_count == completion.usage.prompt_tokens
    assert raw.eval_count == N and raw.done_reason == "length"
    streamed = list(client.generate(model=model, prompt=PROMPT, raw=True, stream=True,
                                    options={"temperature": 0, "num_predict": N}))
    assert "".join(p.response or "" for p in streamed) == raw.response and streamed[-1].done
    # Not raw: the prompt is the user's turn of the chat template, the system before it.
    templated = client.generate(model=model, system=SYSTEM, prompt=USER, stream=False,
                                options={"temperature": 0, "num_predict": N})
    assert (templated.response, templated.prompt_eval_count, templated.eval_count) == want


def test_ollama_tags_and_show(served: Served) -> None:
    client, model = _ollama(served.url), str(served.model)
    listed = client.list().models
    assert [m.model for m in listed] == [model]
    assert listed[0].size is not None and listed[0].size > 0 and listed[0].digest
    assert listed[0].details is not None and listed[0].details.family == "llama"
    shown = client.show(model)
    assert shown.template == TEMPLATE and shown.capabilities == ["completion"]
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.block_count"] == 4 and shown.modelinfo["llama.embedding_length"] == 64
    with pytest.raises(ollama.ResponseError) as info:
        client.show("no-such-model")
    assert info.value.status_code == 404 and "no-such-model" in info.value.error


def test_ollama_errors_are_ollamas(served: Served) -> None:
    client, model = _ollama(served.url), str(served.model)

    def refused(call: Callable[[], Any]) -> ollama.ResponseError:
        with pytest.raises(ollama.ResponseError) as info:
            call()
        return info.value

    e = refused(lambda: client.chat(model="llama3:8b", messages=MESSAGES, stream=False))
    assert e.status_code == 404 and "llama3:8b" in e.error and "not found" in e.error
    e = refused(lambda: client.chat(model=model, messages=[{"role": "robot", "content": "hi"}], stream=False))
    assert e.status_code == 400 and "messages[0].role" in e.error and "one of system, user" in e.error
    e = refused(lambda: list(client.chat(model=model, messages=MESSAGES, options={"temperature": "hot"})))
    assert e.status_code == 400 and "options.temperature" in e.error
    e = refused(lambda: _ollama(served.url, token="wrong-token-0123456789").chat(model=model, messages=MESSAGES))
    assert e.status_code == 401 and "token" in e.error
    status, answer = _post(served.url, "/api/generate", {"prompt": "hi"})
    assert (status, answer) == (400, {"error": "model is required"})
    status, answer = _post(served.url, "/api/chat", {"model": model, "messages": MESSAGES, "format": "json"})
    assert status == 400 and "format" in answer["error"]
    status, _, answer = _request(served.url, "GET", "/api/nothing")
    assert status == 404 and set(answer) == {"error"}


# ------------------------------------------------------------------------------------
# Stub agent: the stream's other endings, in each format


def _urls(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic, ollama.Client]:
    return (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S),
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=WAIT_S),
            ollama.Client(host=url, timeout=WAIT_S))


@pytest.mark.trio
async def test_the_finish_by_end_of_sequence_in_each_format(models: tuple[Path, Path]) -> None:
    model = str(models[0])
    stub = Stub({"model": model, "serving": True}, [{"tokens": [7, 8], "text": "hi!"}, {"final": True, "finish": "stop"}])
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)

        def ask() -> tuple[Any, ...]:
            oai, claude, local = _urls(url)
            r = oai.responses.create(model="x", input="hello")
            events = list(oai.responses.create(model="x", input="hello", stream=True))
            m = claude.messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "hello"}])
            o = local.chat(model=model, messages=[{"role": "user", "content": "hello"}], stream=False)
            return r, events, m, o

        r, events, m, o = await trio.to_thread.run_sync(ask)
        nursery.cancel_scope.cancel()
    assert r.status == "completed" and r.incomplete_details is None and r.output_text == "hi!"
    assert events[-1].type == "response.completed"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == 2
    assert o.done_reason == "stop" and o.message.content == "hi!" and o.eval_count == 2
    # The plain model has no template: the documented fallback, as for chat completions.
    assert stub.requests[0]["prompt"] == "user: hello\nassistant:"


@pytest.mark.trio
async def test_errors_before_and_during_a_stream_in_each_format(models: tuple[Path, Path]) -> None:
    model = str(models[0])
    boom = {"ok": False, "final": True, "finish": "error", "text": "generation failed: boom", "error": "generation failed: boom"}
    stub = Stub({"model": model, "serving": True}, [{"tokens": [1], "text": "a"}, boom])
    user = [{"role": "user", "content": "p"}]
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)

        def mid_stream() -> tuple[list[str], list[str], list[str]]:
            oai, claude, local = _urls(url)
            kinds = [e.type for e in oai.responses.create(model="x", input="p", stream=True)]
            got: list[str] = []
            with pytest.raises(anthropic.APIStatusError, match="boom"):
                with claude.messages.stream(model="x", max_tokens=5, messages=user) as s:  # type: ignore[arg-type]
                    for text in s.text_stream:
                        got.append(text)
            pieces: list[str] = []
            with pytest.raises(ollama.ResponseError, match="boom"):
                for p in local.chat(model=model, messages=user, stream=True):
                    pieces.append(p.message.content or "")
            return kinds, got, pieces

        kinds, got, pieces = await trio.to_thread.run_sync(mid_stream)
        assert kinds[-2:] == ["error", "response.failed"] and "response.output_text.delta" in kinds
        assert got == ["a"] and pieces == ["a"]
        # Refused by the cluster before any token: a real status, in each API's error body.
        stub.script = [{"ok": False, "final": True, "finish": "error", "text": "no serving epoch", "code": "not_serving"}]
        status, answer = await trio.to_thread.run_sync(
            lambda: _post(url, "/v1/messages", {"model": "x", "max_tokens": 3, "messages": user, "stream": True}))
        assert status == 503 and answer["error"] == {"type": "overloaded_error", "message": "no serving epoch"}
        status, answer = await trio.to_thread.run_sync(lambda: _post(url, "/api/chat", {"model": model, "messages": user}))
        assert (status, answer) == (503, {"error": "no serving epoch"})
        stub.placement = None
        status, answer = await trio.to_thread.run_sync(lambda: _post(url, "/v1/responses", {"input": "p"}))
        assert status == 503 and answer["error"]["code"] == "no_model"
        nursery.cancel_scope.cancel()


@pytest.mark.trio
@pytest.mark.parametrize("api", ["ollama", "anthropic"])
async def test_hanging_up_closes_the_agents_iterator_ndjson_or_sse(models: tuple[Path, Path], api: str) -> None:
    model = str(models[0])
    stub = Stub({"model": model, "serving": True}, forever=True)
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)
        _, claude, local = _urls(url)

        def read_two_and_hang_up() -> list[Any]:
            opened: Any = (local.generate(model=model, prompt="p", raw=True, stream=True, options={"num_predict": -1})
                           if api == "ollama" else
                           claude.messages.create(model="x", max_tokens=8000, stream=True,
                                                  messages=[{"role": "user", "content": "p"}]))
            first_two = [next(opened), next(opened)]
            opened.close()
            return first_two

        first_two = await trio.to_thread.run_sync(read_two_and_hang_up)
        with trio.fail_after(WAIT_S):
            await stub.closed.wait()  # the agent's generate iterator was closed: the request is dropped
        nursery.cancel_scope.cancel()
    assert len(first_two) == 2 and stub.requests[0]["max_tokens"] == (8192 if api == "ollama" else 8000)


# ------------------------------------------------------------------------------------
# In-process (no agent process, no tokenizer): bodies that are not JSON or too large, in each
# API's format, and what a valid body becomes


class _Agent:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def status(self) -> dict[str, Any]:
        return {"placement": {"model": "m", "serving": True}}

    async def generate(self, request: dict[str, Any]) -> Any:
        self.requests.append(request)
        yield {"ok": True, "tokens": [5], "text": "ok", "final": True, "finish": "length"}


def _in_process(path: str, body: bytes, **limits: Any) -> tuple[int, Any, list[dict[str, Any]]]:
    from p2pmesh.agent.http import HttpApi, HttpLimits, Loaded, Tokenizers
    from tests.fixtures.asgi import post

    class NoTokenizers(Tokenizers):
        async def get(self, name: str) -> Loaded:
            return Loaded(None)

    agent = _Agent()
    app = HttpApi(agent, token=None, limits=HttpLimits(**limits))
    app.tokenizers = NoTokenizers()
    status, answer = trio.run(post, app, path, body)
    assert app.active == 0
    return status, json.loads(answer), agent.requests


def test_bad_bodies_get_each_apis_error_format() -> None:
    for path in ("/v1/messages", "/api/chat", "/v1/responses"):
        status, answer, requests = _in_process(path, b"{not json")
        assert status == 400 and requests == [] and "not valid JSON" in json.dumps(answer)
        if path == "/v1/messages":
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        elif path == "/api/chat":
            assert set(answer) == {"error"} and answer["error"].startswith("the body is not valid JSON")
        else:
            assert answer["error"]["param"] is None and answer["error"]["type"] == "invalid_request_error"
    status, answer, _ = _in_process("/v1/messages", b"x" * 200, max_body_bytes=100)
    assert status == 413 and answer["error"]["type"] == "request_too_large"
    status, answer, _ = _in_process("/api/generate", b"x" * 200, max_body_bytes=100)
    assert status == 413 and "larger than the limit" in answer["error"]


def test_what_each_api_asks_the_agent_for() -> None:
    body = {"model": "m", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["END"],
            "system": "s", "messages": [{"role": "user", "content": "u"}], "metadata": {"user_id": "ignored"}}
    status, answer, requests = _in_process("/v1/messages", json.dumps(body).encode())
    assert status == 200 and answer["content"] == [{"type": "text", "text": "ok"}]
    assert answer["usage"] == {"input_tokens": None, "output_tokens": 1}  # no tokenizer: no prompt count
    assert requests[0]["prompt"] == "system: s\nuser: u\nassistant:"
    assert (requests[0]["max_tokens"], requests[0]["temperature"], requests[0]["top_p"]) == (7, 0.5, 0.9)
    ollama_body = {"model": "m:latest", "prompt": "p", "raw": True, "stream": False,
                   "options": {"num_predict": 5, "seed": 3, "temperature": 0, "num_ctx": 4096}}
    status, answer, requests = _in_process("/api/generate", json.dumps(ollama_body).encode())
    assert status == 200 and answer["response"] == "ok" and answer["done_reason"] == "length"
    assert (requests[0]["prompt"], requests[0]["max_tokens"], requests[0]["seed"]) == ("p", 5, 3)
    responses_body = {"input": "hi", "max_output_tokens": 9, "store": False, "reasoning": {"effort": "low"}}
    status, answer, requests = _in_process("/v1/responses", json.dumps(responses_body).encode())
    assert status == 200 and answer["output"][0]["content"][0]["text"] == "ok" and requests[0]["max_tokens"] == 9
