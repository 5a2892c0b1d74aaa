"""The agent's HTTP API: an OpenAI-compatible front door to the cluster (docs/http.md).

Owns the HTTP side only: a hand-written ASGI app served by hypercorn's trio worker, the
endpoints (`GET /health`, `GET /v1/models`, `GET /v1/cluster`, `POST /v1/completions`,
`POST /v1/chat/completions`, the last two also as server-sent events), request validation,
authentication, limits, the mapping of the agent's generation events and errors onto
OpenAI's response and error shapes, and the chat prompt (the model's chat template through
transformers' tokenizer, or a documented plain-text fallback).

Generation itself is the agent's `generate` op, the same one `p2pmesh generate` uses over the
control socket: this module never talks to workers or to the core.

Safety rules: binding to anything but a loopback address needs a token (refused at start-up
with `InsecureBind`); the token is checked on every request in constant time; bodies are
bounded in size and in time, requests in number; a client that goes away mid-generation
closes the agent's generate iterator.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from p2pmesh import chat_template
from p2pmesh.core import protocol
from p2pmesh.core.errors import MeshError

log = logging.getLogger("p2pmesh.http")

DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 7780
"""Not 7741 (peers) or 7742 (link probes, peer port + 1), nowhere near the data plane's
47000-48023, and not 8000/8080 where other local model servers usually sit."""
DEFAULT_HTTP_ADDRESS = f"{DEFAULT_HTTP_HOST}:{DEFAULT_HTTP_PORT}"
TOKEN_ENV = "P2PMESH_HTTP_TOKEN"
TOKEN_CHARS_MIN = 16
TOKEN_CHARS_MAX = 4096

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions."""
DEFAULT_CHAT_MAX_TOKENS = 1024
SEED_LIMIT = protocol.SEED_LIMIT
TEMPERATURE_MAX = protocol.TEMPERATURE_MAX
STOP_SEQUENCES_MAX = 4
STOP_CHARS_MAX = 256
MESSAGES_MAX = 4096
PROMPT_TOKENS_MAX = protocol.PROMPT_TOKENS_MAX
assert max(DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_CHAT_MAX_TOKENS) <= protocol.GENERATE_TOKENS_MAX
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ------------------------------------------------------------------------------------
# Values and errors


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on what one client can make the agent hold."""

    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64
    """Requests in flight on the API (GET /health is not counted, so a saturated agent can
    still be probed). One more is refused with 429."""
    body_timeout_s: float = 30.0
    """A request body must arrive within this time (408 otherwise)."""
    stream_idle_timeout_s: float = 300.0
    """A generation that yields nothing for this long fails (504)."""


@dataclass(frozen=True, slots=True)
class HttpEndpoint:
    """Where the API listens and the token it requires (None: no token)."""

    host: str
    port: int
    token: str | None = field(default=None, repr=False)  # never in a log line


class HttpConfigError(MeshError, ValueError):
    """The user's HTTP settings are unusable (the user's to fix: flags or environment).
    A ValueError too, so the CLI's usage-error handler prints it as it is."""


class InsecureBind(HttpConfigError):
    """A non-loopback address was asked for without a token."""


class HttpBindError(HttpConfigError):
    """The address cannot be bound (in use, not on this Mac, no permission)."""


class ApiError(MeshError):
    """A request that ends in an OpenAI-style error body. 4xx: the client's fault (says
    which field); 5xx: the cluster's (no model serving, a generation failed)."""

    def __init__(self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
                 code: str | None = None, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


@dataclass(frozen=True, slots=True)
class Options:
    """What both generation endpoints take besides the prompt."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str | None
    prompt_tokens: tuple[int, ...]
    options: Options


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    options: Options


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the agent is asked to continue: text (tokenized by the head, BOS added, exactly
    as `p2pmesh generate` does) or token ids (a rendered chat template, which carries its
    own special tokens). `count` is the number of prompt tokens when known (for usage)."""

    text: str | None
    tokens: tuple[int, ...] = ()
    count: int | None = None


# ------------------------------------------------------------------------------------
# Configuration checks (the CLI calls these before starting the agent)


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HttpConfigError(
            f"--http must look like HOST:PORT (e.g. {DEFAULT_HTTP_ADDRESS} or [::1]:{DEFAULT_HTTP_PORT}), got {address!r}"
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so it is not trusted as local


def check_bind(host: str, token: str | None) -> None:
    """Refuse a token that cannot be sent in a header or is too short to guess-proof, and an
    address reachable from other machines without a token."""
    if token is not None:
        if not TOKEN_CHARS_MIN <= len(token) <= TOKEN_CHARS_MAX or not all("!" <= c <= "~" for c in token):
            raise HttpConfigError(
                f"the HTTP token must be {TOKEN_CHARS_MIN} to {TOKEN_CHARS_MAX} printable ASCII characters without spaces "
                f"(for example: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    elif not is_loopback(host):
        raise InsecureBind(
            f"refusing to serve the HTTP API on {host} without a token: anyone who can reach that address could use "
            f"the cluster. Set {TOKEN_ENV} (or --http-token), bind to 127.0.0.1, or pass --no-http"
        )


def endpoint(address: str, token: str | None) -> HttpEndpoint:
    """Parse and check `--http` and the token in one go (raises HttpConfigError)."""
    host, port = parse_address(address)
    token = token or None
    check_bind(host, token)
    return HttpEndpoint(host, port, token)


def find_config_error(exc: BaseException) -> HttpConfigError | None:
    """The HttpConfigError inside an exception (group) from trio.run, if any: a bind failure
    surfaces through the agent's nurseries wrapped in exception groups."""
    if isinstance(exc, HttpConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_config_error(inner)
            if found is not None:
                return found
    return None


# ------------------------------------------------------------------------------------
# Serving


class AgentLike(Protocol):
    """What the API needs from the agent (p2pmesh.agent.Agent)."""

    def status(self) -> dict[str, Any]: ...

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


async def serve_http(
    agent: AgentLike,
    host: str,
    port: int,
    *,
    token: str | None = None,
    limits: HttpLimits = HttpLimits(),
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API on host:port until cancelled; `task_status.started` gets the bound URLs
    (port 0 picks a free port). Raises InsecureBind / HttpConfigError for bad settings and
    HttpBindError when the address cannot be bound, before anything is served."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    check_bind(host, token)
    # Bind here rather than in hypercorn so that a busy port is a typed error raised from
    # this call, not an OSError somewhere inside hypercorn's nurseries; hypercorn adopts the
    # socket through an fd:// bind (it owns and closes it from then on).
    fd = _bind(host, port)
    config = Config()
    config.bind = [f"fd://{fd}"]
    config.accesslog = None
    server_log = logging.getLogger("p2pmesh.http.server")
    server_log.setLevel(logging.WARNING)  # hypercorn's own "Running on ..." would repeat our line
    config.errorlog = server_log
    config.include_server_header = False
    config.graceful_timeout = 2.0
    agent_config = getattr(agent, "config", None)
    app = HttpApi(agent, token=token, limits=limits, model_root=getattr(agent_config, "model_root", None),
                  state_dir=getattr(agent_config, "state_dir", None))

    def started(binds: list[str] | None = None) -> None:
        log.info("HTTP API on %s%s", ", ".join(binds or []), " (token required)" if token else "")
        task_status.started(binds or [])

    await serve(app, config, task_status=_Started(started))  # type: ignore[arg-type]


class _Started:
    """A task_status that logs the bound URLs before passing them on."""

    def __init__(self, callback: Callable[[list[str] | None], None]) -> None:
        self._callback = callback

    def started(self, value: list[str] | None = None) -> None:
        self._callback(value)


def _bind(host: str, port: int) -> int:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise HttpBindError(f"cannot serve the HTTP API on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart must not wait out TIME_WAIT
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # tokens are small writes
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise HttpBindError(
            f"cannot serve the HTTP API on {host}:{port}: {exc.strerror or exc} (pick another with --http HOST:PORT, "
            f"or --no-http)"
        ) from None
    return sock.detach()


# ------------------------------------------------------------------------------------
# The ASGI application

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/cluster": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}


class _Reply:
    """One response: JSON or server-sent events; remembers whether it has started, since an
    error after the first byte can only be reported inside the stream."""

    def __init__(self, send: Send, unread: bool) -> None:
        self._send = send
        self.started = False
        self.unread = unread
        """The request has a body not read (yet): an error answer must close the connection."""

    async def json(self, status: int, obj: Any, headers: Iterable[tuple[str, str]] = (), *, close: bool = False) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode()
        hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hs += [(k.encode(), v.encode()) for k, v in headers]
        if close or self.unread:
            # The request body was not (fully) read: closing keeps the unread bytes from being
            # parsed as the next request on this connection.
            hs.append((b"connection", b"close"))
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": hs})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, exc: ApiError, *, close: bool = False) -> None:
        await self.json(exc.status, exc.body(), exc.headers, close=close)

    async def start_events(self) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # a proxy in front must not buffer the tokens
        ]})

    async def event(self, obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await self._send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

    async def end_events(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class HttpApi:
    """The ASGI app. One instance per server; `active` counts requests in flight."""

    def __init__(self, agent: AgentLike, *, token: str | None, limits: HttpLimits = HttpLimits(),
                 model_root: Path | None = None, state_dir: Path | None = None) -> None:
        self.agent = agent
        self.limits = limits
        # Compare digests, not the token itself: equal lengths, so the comparison's time says
        # nothing about the token's length either.
        self._token_digest = hashlib.sha256(token.encode()).digest() if token is not None else None
        self.tokenizers = Tokenizers(model_root, state_dir)
        self.active = 0

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})  # no websockets here
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reply = _Reply(send, unread=headers.get("content-length", "0").strip() != "0" or "transfer-encoding" in headers)
        try:
            self._authenticate(headers)
            allowed = ROUTES.get(path)
            if allowed is None:
                raise ApiError(404, f"no endpoint {path} (this server has {', '.join(ROUTES)})", code="unknown_url")
            if method not in allowed:
                raise ApiError(405, f"{path} takes {' or '.join(allowed)}, not {method}", code="method_not_allowed",
                               headers=(("allow", ", ".join(allowed)),))
            if path == "/health":
                await reply.json(200, self._health())
                return
            if self.active >= self.limits.max_concurrent:
                raise ApiError(429, f"too many concurrent requests (at most {self.limits.max_concurrent}); retry shortly",
                               code="too_many_requests", headers=(("retry-after", "1"),))
            self.active += 1
            try:
                await self._dispatch(path, headers, receive, reply)
            finally:
                self.active -= 1
        except ApiError as exc:
            if reply.started:
                log.warning("HTTP %s %s failed after the response started: %s", method, path, exc.message)
                return
            await reply.error(exc)
        except Exception:  # a bug here must not take the server down
            log.exception("HTTP %s %s failed", method, path)
            if not reply.started:
                await reply.error(ApiError(500, "internal error in the agent's HTTP API (see the agent's log)"))

    def _authenticate(self, headers: dict[str, str]) -> None:
        if self._token_digest is None:
            return
        scheme, _, given = headers.get("authorization", "").partition(" ")
        given = given.strip()
        ok = scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self._token_digest)
        if not ok:
            raise ApiError(401, "missing or wrong token: send the header `Authorization: Bearer <token>`",
                           code="invalid_api_key", headers=(("www-authenticate", "Bearer"),))

    async def _dispatch(self, path: str, headers: dict[str, str], receive: Receive, reply: _Reply) -> None:
        if path == "/v1/models":
            await reply.json(200, self._models())
        elif path == "/v1/cluster":
            await reply.json(200, self._cluster())
        else:
            body = await self._read_json(headers, receive, reply)
            if body is None:
                return  # the client went away while sending its request
            if path == "/v1/completions":
                c = parse_completion(body)
                model = _serving_model(self.agent.status())
                prompt = (Prompt(None, c.prompt_tokens, len(c.prompt_tokens)) if c.prompt is None
                          else Prompt(c.prompt, (), await self.tokenizers.count(model, c.prompt)))
                await self._generation(model, prompt, c.options, _Shape("text_completion"), receive, reply)
            else:
                r = parse_chat(body)
                model = _serving_model(self.agent.status())  # 503 before loading a template
                prompt = await self.tokenizers.chat_prompt(model, r.messages)
                await self._generation(model, prompt, r.options, _Shape("chat.completion"), receive, reply)

    # -- reading requests ------------------------------------------------------------

    async def _read_json(self, headers: dict[str, str], receive: Receive, reply: _Reply) -> Any:
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise ApiError(400, "Content-Length is not a number")
            if int(declared) > limit:
                raise ApiError(413, f"request body of {declared} bytes is larger than the limit of {limit} bytes",
                               code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.body_timeout_s) as scope:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s", code="timeout")
        reply.unread = False
        raw = b"".join(chunks)
        if not raw.strip():
            raise _bad("the request needs a JSON object body")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"the body is not valid JSON: {exc}") from None
        except RecursionError:  # json's parser recurses: a few thousand brackets are enough
            raise _bad("the body is not valid JSON: it is nested too deeply") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        return body

    # -- the cheap endpoints ------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        s = self.agent.status()
        return {"ok": True, "node_id": s.get("node_id"), "role": s.get("role"), "healthy": bool(s.get("healthy")),
                "serving": bool((s.get("placement") or {}).get("serving"))}

    def _models(self) -> dict[str, Any]:
        placement = self.agent.status().get("placement") or {}
        name = placement.get("model")
        data = [] if name is None else [{"id": name, "object": "model", "created": 0, "owned_by": "p2pmesh",
                                         "serving": bool(placement.get("serving"))}]
        return {"object": "list", "data": data}

    def _cluster(self) -> dict[str, Any]:
        s = self.agent.status()
        # Local details (pid, state directory) stay on the control socket.
        keys = ("node_id", "cluster_id", "role", "term", "leader", "healthy", "commit_index", "applied_index",
                "members", "ring", "placement")
        return {k: s.get(k) for k in keys}

    # -- generation -------------------------------------------------------------------

    async def _generation(self, model: str, prompt: Prompt, options: Options, shape: _Shape, receive: Receive,
                          reply: _Reply) -> None:
        request: dict[str, Any] = {
            "prompt": prompt.text, "prompt_tokens": list(prompt.tokens) or None, "max_tokens": options.max_tokens,
            "temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
        }
        events = self.agent.generate(request)
        run = _Run(events, options, shape.with_model(model), prompt.count, self.limits.stream_idle_timeout_s)
        try:
            async with trio.open_nursery() as nursery:
                # A client that hangs up cancels the generation (the finally closes the
                # agent's iterator, which forgets the request).
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await run.respond(reply)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await events.aclose()  # type: ignore[attr-defined]


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _serving_model(status: dict[str, Any]) -> str:
    """The model to generate with, or 503 saying why there is none."""
    placement = status.get("placement") or {}
    name = placement.get("model")
    if name is None:
        raise ApiError(503, "no model is serving: choose one with `p2pmesh model set NAME`", code="no_model")
    problem = placement.get("problem")
    if problem and not placement.get("serving"):  # core/fit.py: retrying will not help until the cluster changes
        raise ApiError(503, str(problem.get("message")), code=str(problem.get("code")))
    if not placement.get("serving"):
        raise ApiError(503, f"the model {name} is not serving yet (being placed or loaded, or a Mac holding a stage "
                            f"is down); retry shortly", code="model_not_serving", headers=(("retry-after", "2"),))
    return str(name)


# ------------------------------------------------------------------------------------
# Responses: OpenAI's shapes


@dataclass(frozen=True, slots=True)
class _Shape:
    """OpenAI's objects for one endpoint: "text_completion" or "chat.completion"."""

    kind: str
    model: str = ""
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def with_model(self, model: str) -> _Shape:
        return _Shape(self.kind, model, self.id, self.created)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _head(self, stream: bool) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        obj = self.kind + ".chunk" if self.chat and stream else self.kind
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": usage}

    def role_chunk(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}

    def chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}


class StopScanner:
    """Cuts the text at the first stop sequence. Text that could be the start of a stop
    sequence is held back until the next piece shows whether it is one, so a stream never
    sends a prefix of a stop sequence it would have cut."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        cuts = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            out, self.pending = self.pending[: min(cuts)], ""
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Run:
    """One generation: reads the agent's events and answers as one JSON object or as SSE."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], options: Options, shape: _Shape, prompt_count: int | None,
                 idle_s: float) -> None:
        self.events, self.options, self.shape = events, options, shape
        self.prompt_count, self.idle_s = prompt_count, idle_s
        self.scanner = StopScanner(options.stop)
        self.completion_tokens = 0

    async def _next(self) -> dict[str, Any]:
        with trio.move_on_after(self.idle_s):
            try:
                return await self.events.__anext__()
            except StopAsyncIteration:
                raise ApiError(500, "the agent ended the generation without a final event") from None
        raise ApiError(504, f"the cluster produced nothing for {self.idle_s:g} s", code="timeout")

    def _take(self, event: dict[str, Any]) -> tuple[str, str | None]:
        """(text to send, finish reason or None while it goes on); raises the event's error."""
        problem = generation_error(event)
        if problem is not None:
            raise problem
        self.completion_tokens += len(event.get("tokens") or ())
        text = self.scanner.feed(str(event.get("text") or ""))
        if self.scanner.hit:
            return text, "stop"
        if event.get("final"):
            return text + self.scanner.flush(), str(event.get("finish") or "stop")
        return text, None

    def usage(self) -> dict[str, Any]:
        p, c = self.prompt_count, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": None if p is None else p + c}

    async def respond(self, reply: _Reply) -> None:
        try:
            if self.options.stream:
                await self._stream(reply)
            else:
                parts: list[str] = []
                while True:
                    text, finish = self._take(await self._next())
                    parts.append(text)
                    if finish is not None:
                        break
                await reply.json(200, self.shape.whole("".join(parts), finish, self.usage()))
        except ApiError as exc:
            if not reply.started:
                await reply.error(exc)
            else:
                # Headers are gone: report inside the stream (the openai client raises on an
                # event with an "error" key) and end it without [DONE].
                await reply.event(exc.body())
                await reply.end_events()

    async def _stream(self, reply: _Reply) -> None:
        # Wait for the first event before answering, so a request the cluster refuses (no
        # model, a prompt too long) still gets a proper status code.
        text, finish = self._take(await self._next())
        await reply.start_events()
        first = self.shape.role_chunk()
        if first is not None:
            await reply.event(first)
        while True:
            if text or finish is not None:
                await reply.event(self.shape.chunk(text, finish))
            if finish is not None:
                break
            text, finish = self._take(await self._next())
        if self.options.include_usage:
            await reply.event(self.shape.usage_chunk(self.usage()))
        await reply.event("[DONE]")
        await reply.end_events()


def generation_error(event: dict[str, Any]) -> ApiError | None:
    """The agent's generate events -> an HTTP error when the event is one, decided by the
    event's code (core/protocol.py), never by its text. An event with no code (an older
    agent) is a 500: the generic code's status."""
    if event.get("ok", True) and event.get("finish") != "error":
        return None
    message = str(event.get("error") or event.get("text") or "the generation failed")
    param = event.get("param")
    return api_error(protocol.code_of(event), message, param if isinstance(param, str) else None)


def api_error(code: protocol.ErrorCode, message: str, param: str | None = None) -> ApiError:
    """The HTTP error for an agent's error code: core/protocol.ERRORS has its status, the
    OpenAI-style body code and whether to retry."""
    spec = protocol.ERRORS[code]
    if spec.http_status >= 500 and spec.retry_after_s is None:
        message = f"the generation failed: {message}"
    headers = (("retry-after", str(spec.retry_after_s)),) if spec.retry_after_s is not None else ()
    return ApiError(spec.http_status, message, param=param or spec.param, code=spec.http_code, headers=headers)


# ------------------------------------------------------------------------------------
# Request validation (pure; every error names the field)


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise _bad(f"{key} must be an integer from {low} to {high}, got {v!r}", key)
    return v


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (low < v if open_low else low <= v) or not v <= high:
        interval = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise _bad(f"{key} must be a number in {interval}, got {v!r}", key)
    return float(v)


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false, got {v!r}", key)
    return v


def _unsupported(body: dict[str, Any]) -> None:
    """Refuse what would silently change the answer; ignore what cannot (user, metadata...)."""
    if body.get("n", 1) not in (1, None):
        raise _bad("n must be 1: one choice per request", "n")
    if body.get("best_of", 1) not in (1, None):
        raise _bad("best_of must be 1", "best_of")
    for key in ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "functions", "tool_choice",
                "function_call"):
        if body.get(key) not in (None, False, 0, {}, [], "none") and not (key == "tool_choice" and body.get(key) == "auto"):
            raise _bad(f"{key} is not supported by this server", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"{key} is not supported (only 0)", key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string (the cluster serves one model; see GET /v1/models)", "model")


def _options(body: dict[str, Any], default_max_tokens: int, chat: bool) -> Options:
    _unsupported(body)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # The protocol's cap (the agent's and the worker's): a 400 naming the field, here.
    max_tokens = _int(body, key, default_max_tokens, 1, protocol.GENERATE_TOKENS_MAX)
    temperature = _number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    # OpenAI's default is sampling without a fixed seed: draw one, so two unseeded requests differ.
    seed = _int(body, "seed", secrets.randbelow(SEED_LIMIT), 0, SEED_LIMIT - 1)
    stream = _bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = _bool(so, "include_usage")
    stop_raw = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop_raw, str):
        stops = (stop_raw,)
    elif isinstance(stop_raw, list):
        stops = tuple(stop_raw)
    elif stop_raw is not None:
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > STOP_SEQUENCES_MAX or not all(isinstance(s, str) and 0 < len(s) <= STOP_CHARS_MAX for s in stops):
        raise _bad(f"stop must be at most {STOP_SEQUENCES_MAX} non-empty strings of at most {STOP_CHARS_MAX} characters", "stop")
    return Options(max_tokens, temperature, top_p, seed, stream, include_usage, stops)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """POST /v1/completions. `prompt`: a string, a list holding one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return CompletionRequest(prompt, (), _options(body, DEFAULT_COMPLETION_MAX_TOKENS, False))
    if (isinstance(prompt, list) and 0 < len(prompt) <= PROMPT_TOKENS_MAX
            and all(protocol.is_int(t) and 0 <= t < protocol.TOKEN_ID_LIMIT for t in prompt)):
        return CompletionRequest(None, tuple(prompt), _options(body, DEFAULT_COMPLETION_MAX_TOKENS, False))
    if prompt is None:
        raise _bad("prompt is required (a string)", "prompt")
    raise _bad("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    """POST /v1/chat/completions: `messages` with text content."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages is required: a non-empty list of {\"role\", \"content\"} objects", "messages")
    if len(raw) > MESSAGES_MAX:
        raise _bad(f"messages holds more than {MESSAGES_MAX} messages", "messages")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        messages.append(ChatMessage("system" if role == "developer" else role, _content(m.get("content"), where)))
    return ChatRequest(tuple(messages), _options(body, DEFAULT_CHAT_MAX_TOKENS, True))


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


# ------------------------------------------------------------------------------------
# Prompts: chat templates and token counts


def fallback_chat_prompt(messages: Iterable[ChatMessage]) -> str:
    """For a model without a chat template: see chat_template.fallback_prompt."""
    return chat_template.fallback_prompt((m.role, m.content) for m in messages)


@dataclass(slots=True)
class _Loaded:
    tokenizer: Any | None
    """transformers' tokenizer, or None when the model's tokenizer cannot be loaded here."""
    loaded_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    """A tokenizer is not safe to share between threads; calls on it go one at a time."""

    @property
    def has_template(self) -> bool:
        return chat_template.tokenizer_has_template(self.tokenizer)


class Tokenizers:
    """The served model's tokenizer, loaded once per model name in a thread (transformers is
    slow to import and to load); two names at most, the cluster serves one model at a time."""

    CACHE_MAX = 2
    RETRY_FAILED_S = 60.0
    """A tokenizer that failed to load (offline, a partial download) is tried again after this."""

    def __init__(self, model_root: Path | None = None, state_dir: Path | None = None) -> None:
        self.model_root = model_root
        self.state_dir = state_dir
        """Where the agent keeps models copied from other Macs (peer_copy.copy_dir)."""
        self._cache: dict[str, _Loaded] = {}
        self._lock = trio.Lock()

    async def get(self, name: str) -> _Loaded:
        async with self._lock:  # one load at a time; concurrent requests wait for it
            loaded = self._cache.pop(name, None)
            if loaded is None or loaded.tokenizer is None and trio.current_time() - loaded.loaded_at > self.RETRY_FAILED_S:
                loaded = await trio.to_thread.run_sync(self._load, name)
                loaded.loaded_at = trio.current_time()
            while len(self._cache) >= self.CACHE_MAX:
                self._cache.pop(next(iter(self._cache)))  # the least recently used
            self._cache[name] = loaded
            return loaded

    def _load(self, name: str) -> _Loaded:
        from p2pmesh import models

        from p2pmesh import peer_copy

        # Where this Mac's workers load the model from: its own directory (relative names
        # under --model-root), else its copy from the other Macs, else the name (a hub id).
        if self.state_dir is not None:
            local = peer_copy.model_dir(name, self.model_root, self.state_dir)
        else:
            local = models.located(name, self.model_root)
        try:
            return _Loaded(chat_template.load_tokenizer(models.resolve(local)))
        except Exception as exc:  # noqa: BLE001 - any failure: serve without counts or templates
            log.warning("cannot load the tokenizer of %s (no chat template, no prompt token counts): %s", name, exc)
            return _Loaded(None)

    async def count(self, model: str, text: str) -> int | None:
        """Prompt tokens as the head will count them (BOS added as the tokenizer does)."""
        loaded = await self.get(model)
        if loaded.tokenizer is None:
            return None

        def encode() -> int:
            with loaded.lock:
                return len(loaded.tokenizer.encode(text))

        return await trio.to_thread.run_sync(encode)

    async def chat_prompt(self, model: str, messages: tuple[ChatMessage, ...]) -> Prompt:
        loaded = await self.get(model)
        return await trio.to_thread.run_sync(render_chat, loaded, messages)


def render_chat(loaded: _Loaded, messages: tuple[ChatMessage, ...]) -> Prompt:
    """The model's chat template when it has one (sent as token ids: the template writes its
    own BOS, the head must not add another), else the plain-text fallback (sent as text,
    tokenized by the head like any completion prompt)."""
    tok = loaded.tokenizer
    if not loaded.has_template:
        text = fallback_chat_prompt(messages)
        if tok is None:
            return Prompt(text)
        with loaded.lock:
            return Prompt(text, (), len(tok.encode(text)))
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    with loaded.lock:
        try:
            tokens = chat_template.render_tokens(tok, conversation)
        except chat_template.TemplateRefused as exc:
            raise _bad(str(exc), "messages") from None
    if not tokens:
        raise _bad("the chat template rendered an empty prompt", "messages")
    if len(tokens) > PROMPT_TOKENS_MAX:
        raise _bad(f"the rendered prompt has {len(tokens)} tokens, more than {PROMPT_TOKENS_MAX}", "messages")
    return Prompt(None, tokens, len(tokens))
