"""The OpenAI-compatible HTTP API (p2pmesh/agent/http/) with the real `openai` package as the
client.

- Against a real agent: one in-process Agent (a one-member cluster serving a tiny MLX model
  made by scripts/make_tiny_model.py, with a chat template added) and the API served on
  loopback next to it. Greedy completions, streamed or not, equal what the agent's own
  `generate` op (what `p2pmesh generate` uses) returns; chat goes through the model's
  template; /v1/models, /v1/cluster, /health; a client hanging up mid-stream; the 4xx
  answers with raw HTTP.
- Against a stub agent (fast, scripted): 503 without a serving model, the chat fallback for a
  model without a template, errors mid-stream, the body timeout.
- Pure: configuration checks (a non-loopback bind needs a token), the stop scanner, the
  mapping of generation errors.
"""
from __future__ import annotations

import http.client
import json
import queue
import random
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from p2pmesh.agent.http import (
    HttpBindError,
    HttpConfigError,
    HttpLimits,
    InsecureBind,
    StopScanner,
    endpoint,
    fallback_chat_prompt,
    find_config_error,
    generation_error,
    parse_address,
    serve_http,
)
from p2pmesh.core.protocol import ERRORS
from tests.agent.harness import free_port, make_model

TOKEN = "test-token-0123456789abcdef"
PROMPT = "the quick brown fox"
LONG_PROMPT = "lorem ipsum dolor sit amet"
CONTEXT = 512
SERVE_TIMEOUT_S = 60
WAIT_S = 10
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


# ------------------------------------------------------------------------------------
# Models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(plain, templated): the same tiny llama, without and with a chat template."""
    base = tmp_path_factory.mktemp("models")
    plain = make_model(base / "tiny-plain", family="llama", layers=4, hidden=64, seed=3)
    templated = base / "tiny-chat"
    shutil.copytree(plain, templated)
    cfg_path = templated / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return plain, templated


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ------------------------------------------------------------------------------------
# A real agent in a background trio thread, shared by the module's tests


@dataclass
class Served:
    agent: Any
    trio_token: trio.lowlevel.TrioToken
    url: str
    """The API with a token (and a small concurrency bound)."""
    open_url: str
    """The same agent's API on loopback without a token."""
    model: Path
    stop: Callable[[], None] = field(default=lambda: None)

    def run(self, afn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(afn, *args, trio_token=self.trio_token)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.trio_token)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)

    def generate(self, **request: Any) -> tuple[str, list[int], dict[str, Any]]:
        """The agent's own generate op (what `p2pmesh generate` streams): text, tokens, last event."""
        return self.run(_collect, self.agent, request)


async def _collect(agent: Any, request: dict[str, Any]) -> tuple[str, list[int], dict[str, Any]]:
    text, tokens, last = "", [], {}
    with trio.fail_after(60):
        async for event in agent.generate(request):
            assert event["ok"], event
            text += event["text"]
            tokens += event["tokens"]
            last = event
    return text, tokens, last


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, models: tuple[Path, Path]) -> Iterator[Served]:
    from p2pmesh.agent import Agent, AgentConfig

    model = models[1]
    state = tmp_path_factory.mktemp("agent")
    config = AgentConfig(state_dir=state, listen=(f"127.0.0.2:{free_port('127.0.0.2')}",), mdns=False,
                         data_port_base=random.Random().randrange(20000, 40000))
    started: queue.Queue[Any] = queue.Queue()

    async def main() -> None:
        agent = Agent(config)
        stop = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                urls = await nursery.start(partial(serve_http, agent, "127.0.0.1", 0, token=TOKEN,
                                                   limits=HttpLimits(max_concurrent=4)))
                open_urls = await nursery.start(partial(serve_http, agent, "127.0.0.1", 0, token=None))
                started.put(Served(agent, trio.lowlevel.current_trio_token(), urls[0], open_urls[0], model, stop.set))
                await stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            agent.storage.close()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - hand it to the test thread
            started.put(exc)

    thread = threading.Thread(target=thread_main, name="agent", daemon=True)
    thread.start()
    got = started.get(timeout=30)
    if isinstance(got, BaseException):
        raise got
    s: Served = got
    try:
        # A one-member cluster: the agent founds it and leads it (role "standalone"); a model
        # set before that would be proposed to nobody.
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not _leads(s.run_sync(s.agent.status)):
            assert time.monotonic() < deadline, f"no one-member cluster within {SERVE_TIMEOUT_S} s"
            time.sleep(0.05)
        answer = s.run(s.agent.set_model, {"name": str(model), "context_tokens": CONTEXT})
        assert answer["ok"], answer
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not ((s.run_sync(s.agent.status).get("placement") or {}).get("serving")):
            assert time.monotonic() < deadline, f"the model was not serving within {SERVE_TIMEOUT_S} s"
            time.sleep(0.1)
        yield s
    finally:
        s.run_sync(s.stop)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the agent did not stop"


def _leads(status: dict[str, Any]) -> bool:
    return bool(status["healthy"]) and status["leader"] == status["node_id"]


@pytest.fixture(scope="module")
def reference(served: Served) -> tuple[str, list[int]]:
    text, tokens, last = served.generate(prompt=PROMPT, max_tokens=24, temperature=0.0)
    assert last["final"] and last["finish"] == "length" and len(tokens) == 24
    return text, tokens


# ------------------------------------------------------------------------------------
# Raw HTTP helpers


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _request(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             token: str | None = TOKEN) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection(*_hostport(url), timeout=WAIT_S)
    try:
        hs = dict(headers or {})
        if token is not None:
            hs["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=hs)
        r = conn.getresponse()
        raw = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw) if raw else None
    finally:
        conn.close()


def _error(answer: tuple[int, dict[str, str], Any]) -> tuple[int, str, str | None]:
    status, _, body = answer
    return status, body["error"]["message"], body["error"]["param"]


# ------------------------------------------------------------------------------------
# Real agent: the OpenAI surface


def test_models_lists_the_served_model(served: Served) -> None:
    page = served.client().models.list()
    assert [m.id for m in page.data] == [str(served.model)]
    assert page.data[0].owned_by == "p2pmesh"


def test_greedy_completion_equals_the_agents_generate(served: Served, reference: tuple[str, list[int]]) -> None:
    text, _ = reference
    r = served.client().completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert r.model == str(served.model) and r.object == "text_completion"
    assert r.usage is not None and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(_tokenizer(served.model).encode(PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    ttft = (r.model_extra or {}).get("timings", {}).get("ttft_ms")  # p2pmesh's addition, as llama.cpp's
    assert isinstance(ttft, float) and ttft > 0


def test_streamed_completion_equals_the_same_text(served: Served, reference: tuple[str, list[int]]) -> None:
    text, _ = reference
    chunks = list(served.client().completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 1  # really streamed, not one blob
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert (chunks[-1].model_extra or {}).get("timings", {}).get("ttft_ms", 0) > 0


def test_the_async_client_under_trio(served: Served, reference: tuple[str, list[int]]) -> None:
    async def main() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
        r = await client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0)
        stream = await client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        return r.choices[0].text, "".join([c.choices[0].text async for c in stream])

    assert trio.run(main) == (reference[0], reference[0])


def test_a_stop_sequence_cuts_the_text_streamed_or_not(served: Served, reference: tuple[str, list[int]]) -> None:
    text, _ = reference
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    client = served.client()
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_goes_through_the_models_template(served: Served) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    tok = _tokenizer(served.model)
    rendered = "<s>[system] be brief\n[user] hello there\n[assistant]"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, and no second one added
    want, _, last = served.generate(prompt_tokens=ids, max_tokens=12, temperature=0.0)
    client = served.client()
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == last["finish"]
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_completion_tokens=12,  # type: ignore[arg-type]
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_sampling_is_reproducible_with_a_seed(served: Served) -> None:
    client = served.client()
    a, b = (client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    want, _, _ = served.generate(prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].text == want


def test_cluster_and_health(served: Served) -> None:
    status, _, cluster = _request(served.url, "GET", "/v1/cluster")
    me = served.run_sync(served.agent.status)
    assert status == 200
    assert cluster["node_id"] == me["node_id"] and cluster["cluster_id"] == me["cluster_id"]
    assert [m["node_id"] for m in cluster["members"]] == [me["node_id"]]
    assert cluster["placement"]["serving"] and cluster["placement"]["model"] == str(served.model)
    assert cluster["placement"]["stages"] == [{"node_id": me["node_id"], "layers": [0, 4]}]
    assert "ring" in cluster and "state_dir" not in cluster and "pid" not in cluster
    status, _, health = _request(served.url, "GET", "/health")
    assert status == 200
    assert health == {"ok": True, "node_id": me["node_id"], "role": me["role"], "healthy": True, "serving": True}
    # On loopback without a token configured, nothing is asked for.
    status, _, health = _request(served.open_url, "GET", "/health", token=None)
    assert status == 200 and health["ok"] is True


def test_a_client_hanging_up_mid_stream_closes_the_generation(served: Served, reference: tuple[str, list[int]]) -> None:
    # This prompt runs to max_tokens on the test model (no end-of-sequence token in 1000).
    stream = served.client().completions.create(model="any", prompt=LONG_PROMPT, max_tokens=400, temperature=0, stream=True)
    it = iter(stream)
    got = [next(it).choices[0].text for _ in range(3)]
    assert len(got) == 3
    stream.close()
    deadline = time.monotonic() + WAIT_S
    while served.run_sync(lambda: len(served.agent.clients)):
        assert time.monotonic() < deadline, "the agent still streams to a client that hung up"
        time.sleep(0.01)
    # Let go while the cluster was still generating (400 tokens take about a second here):
    # the request is cancelled, not run to its end: forgotten by its origin and by the head
    # (this one agent is both), its worker slot freed.
    router = served.agent.machine.router
    while served.run_sync(lambda: len(router.origins) + len(router.served)):
        assert time.monotonic() < deadline, "the request still runs after its client hung up"
        time.sleep(0.01)
    # The agent serves on as before.
    r = served.client().completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == reference[0]


# ------------------------------------------------------------------------------------
# Real agent: refusals


def test_a_token_is_required_on_every_request(served: Served) -> None:
    for token in (None, "wrong-token-0123456789"):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/nope")):
            body = b'{"prompt": "x"}' if method == "POST" else None
            status, headers, err = _request(served.url, method, path, body, token=token)
            assert status == 401, (token, path)
            assert err["error"]["type"] == "authentication_error" and headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="not-the-token", max_retries=0).models.list()


def test_unknown_paths_and_wrong_methods(served: Served) -> None:
    status, _, err = _request(served.url, "GET", "/v1/engines")
    assert status == 404 and "/v1/engines" in err["error"]["message"]
    status, headers, err = _request(served.url, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST" and "POST" in err["error"]["message"]
    status, headers, _ = _request(served.url, "DELETE", "/v1/models")
    assert status == 405 and headers["allow"] == "GET"


def test_malformed_and_invalid_bodies_say_what_is_wrong(served: Served) -> None:
    post = partial(_request, served.url, "POST")
    status, message, _ = _error(post("/v1/completions", b"{not json"))
    assert status == 400 and "not valid JSON" in message
    status, message, _ = _error(post("/v1/completions", b"[1, 2]"))
    assert status == 400 and "JSON object" in message
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop[0]"),
        ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ]
    for path, body, param in cases:
        status, message, got_param = _error(post(path, json.dumps(body).encode()))
        assert status == 400, (body, message)
        assert got_param == param and param.split("[")[0] in message, (body, message)
    # The openai client surfaces the same as BadRequestError.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client().completions.create(model="any", prompt="x", temperature=11)


def test_a_prompt_the_model_cannot_take_is_a_400_from_the_head(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match=r"the prompt has \d+ tokens"):
        served.client().completions.create(model="any", prompt=PROMPT * 2000, max_tokens=4, temperature=0)


def test_a_body_over_the_limit_is_413(served: Served) -> None:
    host, port = _hostport(served.url)
    conn = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    try:
        # Declared too large: refused before a byte of it is read.
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 413 and "limit" in body["error"]["message"]
        assert r.getheader("connection") == "close"
    finally:
        conn.close()
    # Not declared (chunked) and too large: refused once the limit is crossed.
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 65536]), big[i:i + 65536]) for i in range(0, len(big), 65536)) + b"0\r\n\r\n"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=WAIT_S) as s:
        try:
            s.sendall(head + chunked)
        except OSError:
            pass  # the server may answer and close before reading everything
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_too_many_concurrent_requests_is_429(served: Served) -> None:
    """The test server allows 4 requests at a time: 4 clients that send headers but not their
    body hold the 4 slots; the next request is refused until they go."""
    host, port = _hostport(served.url)
    holders = []
    try:
        for _ in range(4):
            s = socket.create_connection((host, port), timeout=WAIT_S)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Length: 100\r\n\r\n".encode())
            holders.append(s)
        deadline = time.monotonic() + WAIT_S
        while True:
            status, headers, err = _request(served.url, "GET", "/v1/models")
            if status == 429:
                break
            assert status == 200 and time.monotonic() < deadline, status
            time.sleep(0.05)
        assert "at most 4" in err["error"]["message"] and headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):
            served.client().completions.create(model="any", prompt="x", max_tokens=1)
        assert _request(served.url, "GET", "/health")[0] == 200  # probes still answer
    finally:
        for s in holders:
            s.close()
    deadline = time.monotonic() + WAIT_S
    while _request(served.url, "GET", "/v1/models")[0] != 200:
        assert time.monotonic() < deadline, "the slots were not released"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------
# A stub agent: scripted status and events


@dataclass
class Stub:
    placement: dict[str, Any] | None
    script: list[dict[str, Any]] = field(default_factory=list)
    forever: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    closed: trio.Event = field(default_factory=trio.Event)

    def status(self) -> dict[str, Any]:
        return {"node_id": "ab" * 16, "role": "leader", "healthy": True, "placement": self.placement}

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        try:
            for event in self.script:
                yield {"ok": True, "id": "r1", "tokens": [], "text": "", **event}
            while self.forever:
                await trio.sleep(0.01)
                yield {"ok": True, "id": "r1", "tokens": [5], "text": "x"}
        finally:
            self.closed.set()


async def _stub_server(nursery: trio.Nursery, stub: Stub, **limits: Any) -> str:
    urls = await nursery.start(partial(serve_http, stub, "127.0.0.1", 0, token=None, limits=HttpLimits(**limits)))
    return str(urls[0])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


@pytest.mark.trio
async def test_no_model_serving_is_503(models: tuple[Path, Path]) -> None:
    stub = Stub(None)
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)
        status, _, err = await trio.to_thread.run_sync(lambda: _request(url, "POST", "/v1/completions", b'{"prompt": "x"}'))
        assert status == 503 and "model set" in err["error"]["message"]
        stub.placement = {"model": str(models[0]), "serving": False, "stages": []}
        status, headers, err = await trio.to_thread.run_sync(
            lambda: _request(url, "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}'))
        assert status == 503 and "not serving yet" in err["error"]["message"] and headers["retry-after"] == "2"
        page = await trio.to_thread.run_sync(lambda: _client(url).models.list())
        assert [(m.id, m.serving) for m in page.data] == [(str(models[0]), False)]  # type: ignore[attr-defined]
        status, _, health = await trio.to_thread.run_sync(lambda: _request(url, "GET", "/health"))
        assert status == 200 and health["serving"] is False
        assert stub.requests == []  # nothing reached the agent
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_model_the_cluster_cannot_place_is_503_with_the_reason(models: tuple[Path, Path]) -> None:
    message = "tiny does not fit in the cluster's memory: it needs 17 kB = ... It would fit with --context-tokens 62 or fewer."
    problem = {"code": "model_does_not_fit", "model": str(models[0]), "context_tokens": 100, "message": message}
    stub = Stub({"model": str(models[0]), "serving": False, "stages": [], "problem": problem})
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)
        status, headers, err = await trio.to_thread.run_sync(
            lambda: _request(url, "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}'))
        assert status == 503 and err["error"]["code"] == "model_does_not_fit" and err["error"]["message"] == message
        assert "retry-after" not in headers  # retrying does not help until the cluster changes
        with pytest.raises(openai.InternalServerError, match="context-tokens 62"):
            await trio.to_thread.run_sync(lambda: _client(url).completions.create(model="x", prompt="p"))
        assert stub.requests == []
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_chat_without_a_template_uses_the_documented_fallback(models: tuple[Path, Path]) -> None:
    plain = models[0]
    stub = Stub({"model": str(plain), "serving": True}, [{"tokens": [7, 8], "text": "hi!"},
                                                          {"final": True, "finish": "stop"}])
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)
        messages = [{"role": "developer", "content": "be kind"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
        r = await trio.to_thread.run_sync(lambda: _client(url).chat.completions.create(
            model="x", messages=messages, temperature=0))  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    text = "system: be kind\nuser: hello\nassistant:"
    assert stub.requests[0]["prompt"] == text and stub.requests[0]["prompt_tokens"] is None
    assert stub.requests[0]["max_tokens"] == 1024 and stub.requests[0]["temperature"] == 0.0
    assert r.choices[0].message.content == "hi!" and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.prompt_tokens == len(_tokenizer(plain).encode(text))
    assert r.usage.completion_tokens == 2


@pytest.mark.trio
async def test_an_error_mid_stream_reaches_the_client(models: tuple[Path, Path]) -> None:
    script = [{"tokens": [1], "text": "a"}, {"ok": False, "final": True, "finish": "error", "text": "generation failed: boom",
                                           "error": "generation failed: boom"}]
    stub = Stub({"model": str(models[0]), "serving": True}, script)
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)

        def streamed() -> list[str]:
            got = []
            with pytest.raises(openai.APIError, match="boom"):
                for c in _client(url).completions.create(model="x", prompt="p", stream=True):
                    got.append(c.choices[0].text)
            return got

        assert await trio.to_thread.run_sync(streamed) == ["a"]
        with pytest.raises(openai.InternalServerError, match="boom"):
            await trio.to_thread.run_sync(lambda: _client(url).completions.create(model="x", prompt="p"))
        # Refused by the cluster before any token: the status says whose fault it is.
        stub.script = [{"ok": False, "final": True, "finish": "error", "text": "no serving epoch: the model is not placed",
                        "code": "not_serving"}]
        with pytest.raises(openai.InternalServerError) as info:
            await trio.to_thread.run_sync(lambda: _client(url).completions.create(model="x", prompt="p", stream=True))
        assert info.value.status_code == 503
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_hanging_up_closes_the_agents_iterator(models: tuple[Path, Path]) -> None:
    stub = Stub({"model": str(models[0]), "serving": True}, forever=True)
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub)

        def read_two_and_go() -> int:
            stream = _client(url).completions.create(model="x", prompt=[1, 2, 3], stream=True, max_tokens=8000)
            it = iter(stream)
            n = len([next(it), next(it)])
            stream.close()
            return n

        assert await trio.to_thread.run_sync(read_two_and_go) == 2
        with trio.fail_after(WAIT_S):
            await stub.closed.wait()
        assert stub.requests[0]["prompt_tokens"] == [1, 2, 3] and stub.requests[0]["prompt"] is None
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_slow_body_is_408(models: tuple[Path, Path]) -> None:
    stub = Stub({"model": str(models[0]), "serving": True})
    async with trio.open_nursery() as nursery:
        url = await _stub_server(nursery, stub, body_timeout_s=0.3)
        host, port = _hostport(url)

        def slow() -> bytes:
            with socket.create_connection((host, port), timeout=WAIT_S) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"pro")
                return s.recv(65536)

        reply = await trio.to_thread.run_sync(slow)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert stub.requests == []
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------
# Configuration and pure parts


NOT_LOOPBACK = ("0.0.0.0", "::", "192.0.2.1", "mac.local")
"""Addresses the checks must refuse without a token. They are only ever parsed and refused:
the tests below make any socket creation fail while they are used, so a regression in the
check can never bind a real interface (tests bind to loopback only)."""


def _forbid_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, creating a socket fails the test (set after the trio loop's own)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a socket was created for a non-loopback address")

    monkeypatch.setattr(trio.socket, "socket", refuse)
    monkeypatch.setattr(socket, "socket", refuse)


@pytest.mark.trio
async def test_a_non_loopback_bind_without_a_token_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = Stub(None)
    _forbid_sockets(monkeypatch)
    for host in NOT_LOOPBACK:
        with pytest.raises(InsecureBind, match="without a token"):
            await serve_http(stub, host, 0, token=None)


@pytest.mark.trio
async def test_a_busy_port_is_a_typed_error_before_serving() -> None:
    stub = Stub(None)
    # A busy port is a typed error too, raised before serving.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(HttpBindError, match="cannot serve the HTTP API"):
            await serve_http(stub, "127.0.0.1", s.getsockname()[1], token=None)


def test_endpoint_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_sockets(monkeypatch)
    wildcard = NOT_LOOPBACK[0]
    assert endpoint("127.0.0.1:7780", None).port == 7780
    assert endpoint("[::1]:9000", None).host == "::1"
    assert endpoint("localhost:9000", None).token is None
    assert endpoint(f"{wildcard}:7780", TOKEN).token == TOKEN  # parsed only, never bound
    with pytest.raises(InsecureBind):
        endpoint(f"{wildcard}:7780", None)
    with pytest.raises(InsecureBind):
        endpoint("10.0.0.5:7780", "")  # an empty token is no token
    with pytest.raises(HttpConfigError, match="16"):
        endpoint(f"{wildcard}:7780", "short")
    with pytest.raises(HttpConfigError, match="printable"):
        endpoint("127.0.0.1:7780", "a token with spaces in it")
    for bad in ("7780", "host:", "host:99999", ":7780"):
        with pytest.raises(HttpConfigError, match="HOST:PORT"):
            parse_address(bad)
    assert isinstance(InsecureBind("x"), ValueError)  # the CLI's usage-error handler prints it
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [HttpBindError("busy")])])
    found = find_config_error(group)
    assert isinstance(found, HttpBindError) and str(found) == "busy"
    assert find_config_error(BaseExceptionGroup("x", [OSError("other")])) is None


def test_stop_scanner_holds_back_what_may_be_a_stop_sequence() -> None:
    s = StopScanner(("END", "\n\n"))
    assert s.feed("abc E") == "abc "  # "E" may start "END"
    assert s.feed("N") == ""
    assert s.feed("X more\n") == "ENX more"
    assert s.feed("\nlater") == "" and s.hit
    t = StopScanner(("stop",))
    assert t.feed("no sto") == "no " and t.flush() == "sto" and not t.hit
    assert StopScanner(()).feed("anything") == "anything"


def test_generation_errors_map_to_whose_fault_it_is() -> None:
    """By the event's code (core/protocol.py), never its text: an event with no code (an
    older agent) is the generic 500, whatever its text says."""
    assert generation_error({"ok": True, "tokens": [1], "text": "x"}) is None
    assert generation_error({"ok": True, "final": True, "finish": "length", "text": ""}) is None
    refused = generation_error({"ok": False, "final": True, "code": "bad_request", "param": "max_tokens",
                                "error": "max_tokens must be an integer from 1 to 8192"})
    assert refused is not None and refused.status == 400 and refused.param == "max_tokens"
    lagging = generation_error({"ok": False, "final": True, "code": "client_too_slow",
                                "error": "the client fell too far behind the stream"})
    assert lagging is not None and lagging.status == 500
    prompt = generation_error({"ok": False, "final": True, "finish": "error", "code": "prompt_refused",
                               "error": "the prompt is empty"})
    assert prompt is not None and prompt.status == 400 and prompt.param == "prompt"
    old = generation_error({"ok": False, "final": True, "finish": "error", "error": "no serving epoch: the model is not placed"})
    assert old is not None and old.status == 500 and "no serving epoch" in old.message
    unknown = generation_error({"ok": False, "final": True, "code": "from_a_newer_agent", "error": "something"})
    assert unknown is not None and unknown.status == 500
    for code, spec in ERRORS.items():
        error = generation_error({"ok": False, "final": True, "finish": "error", "code": code.value, "error": "why"})
        assert error is not None and error.status == spec.http_status and error.code == spec.http_code, code
        assert ("retry-after", str(spec.retry_after_s)) in error.headers if spec.retry_after_s else not error.headers
    assert generation_error({"ok": False, "code": "busy", "error": "x"}).status == 429  # type: ignore[union-attr]
    assert generation_error({"ok": False, "code": "not_serving", "error": "x"}).status == 503  # type: ignore[union-attr]
    assert fallback_chat_prompt(()) == "assistant:"
