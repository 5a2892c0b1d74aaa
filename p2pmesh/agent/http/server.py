"""The agent's HTTP API: the cluster's front door for the tools people plug in (docs/http.md).

This module owns the serving and the routing: a hand-written ASGI app served by hypercorn's
trio worker, the route table (`ROUTES`: each path's methods, handler and API), authentication
and the bound on requests in flight. The APIs, each in its own module: completions.py
(OpenAI's models, completions and chat completions), responses.py (OpenAI Responses),
anthropic.py (Anthropic Messages), ollama.py (Ollama's chat, generate, tags, show). Beside
them: call.py (one request: body, prompts, generation), config.py (settings and the start-up
checks), schema.py (the OpenAI bodies' schemas and the shared decoding), bodies.py (errors),
prompts.py (chat templates, token counts), stream.py (one response, one generation, in any
API's format); dashboard.py (the dashboard's page at `GET /` and its live feed
`GET /v1/events`, docs/dashboard.md).

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
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent.http import anthropic, completions, ollama, responses
from p2pmesh.agent.http.bodies import ApiError
from p2pmesh.agent.http.call import Call, ClientGone, Service
from p2pmesh.agent.http.config import HttpBindError, HttpLimits, check_bind
from p2pmesh.agent.http.prompts import Tokenizers
from p2pmesh.agent.http.dashboard import EventStreams, serve_page
from p2pmesh.agent.http.stream import ErrorBody, Receive, Reply, Send
from p2pmesh.agent.status import public_status

log = logging.getLogger("p2pmesh.http")


# ------------------------------------------------------------------------------------
# Serving


async def serve_http(
    agent: Service,
    host: str,
    port: int,
    *,
    token: str | None = None,
    limits: HttpLimits = HttpLimits(),
    model_root: Path | None = None,
    state_dir: Path | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API on host:port until cancelled; `task_status.started` gets the bound URLs
    (port 0 picks a free port). Raises InsecureBind / HttpConfigError for bad settings and
    HttpBindError when the address cannot be bound, before anything is served. `model_root`
    and `state_dir` say where the tokenizer of the served model is (AgentConfig's fields);
    when not given they are taken from ``agent.config``, if it has one (an embedder passing
    the running agent)."""
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
    app = HttpApi(agent, token=token, limits=limits, model_root=model_root or getattr(agent_config, "model_root", None),
                  state_dir=state_dir or getattr(agent_config, "state_dir", None))

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


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: its methods, its handler, and the error body of the API it belongs to."""

    methods: tuple[str, ...]
    handle: Callable[[Call], Awaitable[None]]
    errors: ErrorBody = ApiError.body
    counted: bool = True
    """Counts against HttpLimits.max_concurrent (not /health, so a saturated agent can be probed)."""


async def _health(call: Call) -> None:
    s = call.status()
    await call.json({"ok": True, "node_id": s.get("node_id"), "role": s.get("role"), "healthy": bool(s.get("healthy")),
                     "serving": bool((s.get("placement") or {}).get("serving"))})


async def _cluster(call: Call) -> None:
    await call.json(public_status(call.status()))


ROUTES: dict[str, Route] = {
    "/health": Route(("GET",), _health, counted=False),
    "/v1/cluster": Route(("GET",), _cluster),
    # OpenAI (completions.py, responses.py)
    "/v1/models": Route(("GET",), completions.models),
    "/v1/completions": Route(("POST",), completions.completions),
    "/v1/chat/completions": Route(("POST",), completions.chat),
    "/v1/responses": Route(("POST",), responses.create),
    # Anthropic (anthropic.py)
    "/v1/messages": Route(("POST",), anthropic.messages, anthropic.error_body),
    # Ollama (ollama.py)
    "/api/chat": Route(("POST",), ollama.chat, ollama.error_body),
    "/api/generate": Route(("POST",), ollama.generate, ollama.error_body),
    "/api/tags": Route(("GET",), ollama.tags, ollama.error_body),
    "/api/show": Route(("POST",), ollama.show, ollama.error_body),
    "/api/version": Route(("GET",), ollama.version, ollama.error_body),
}


def _errors_for(path: str) -> ErrorBody:
    """The error body for a path: its route's, else by the API its prefix names."""
    route = ROUTES.get(path)
    if route is not None:
        return route.errors
    if path.startswith("/api/"):
        return ollama.error_body
    if path.startswith("/v1/messages"):
        return anthropic.error_body
    return ApiError.body


class HttpApi:
    """The ASGI app. One instance per server; `active` counts requests in flight."""

    def __init__(self, agent: Service, *, token: str | None, limits: HttpLimits = HttpLimits(),
                 model_root: Path | None = None, state_dir: Path | None = None) -> None:
        self.agent = agent
        self.limits = limits
        # Compare digests, not the token itself: equal lengths, so the comparison's time says
        # nothing about the token's length either.
        self._token_digest = hashlib.sha256(token.encode()).digest() if token is not None else None
        self.tokenizers = Tokenizers(model_root, state_dir)
        self.active = 0
        self.events = EventStreams(agent, limits)
        # The dashboard's live feed is bounded on its own (dashboard.py): a stream lasts.
        self.routes = {**ROUTES, "/v1/events": Route(("GET",), lambda call: self.events.stream(call.receive, call.reply),
                                                     counted=False)}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})  # no websockets here
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reply = Reply(send, unread=headers.get("content-length", "0").strip() != "0" or "transfer-encoding" in headers,
                      errors=_errors_for(path))
        if await serve_page(path, method, send):  # the dashboard's page holds no data: no token needed
            return
        try:
            self._authenticate(headers)
            route = self.routes.get(path)
            if route is None:
                raise ApiError(404, f"no endpoint {path} (this server has {', '.join(self.routes)})", code="unknown_url")
            if method not in route.methods:
                raise ApiError(405, f"{path} takes {' or '.join(route.methods)}, not {method}", code="method_not_allowed",
                               headers=(("allow", ", ".join(route.methods)),))
            call = Call(self.agent, self.tokenizers, self.limits, headers, receive, reply)
            if not route.counted:
                await route.handle(call)
                return
            if self.active >= self.limits.max_concurrent:
                raise ApiError(429, f"too many concurrent requests (at most {self.limits.max_concurrent}); retry shortly",
                               code="too_many_requests", headers=(("retry-after", "1"),))
            self.active += 1
            try:
                await route.handle(call)
            finally:
                self.active -= 1
        except ClientGone:
            return  # the client went away while sending its request
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
        """The token as `Authorization: Bearer <token>` (OpenAI's and Ollama's clients) or as
        `x-api-key: <token>` (Anthropic's)."""
        if self._token_digest is None:
            return
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and "x-api-key" in headers:
            scheme, given = "bearer", headers["x-api-key"]
        given = given.strip()
        ok = scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self._token_digest)
        if not ok:
            raise ApiError(401, "missing or wrong token: send the header `Authorization: Bearer <token>` (or "
                                "`x-api-key: <token>`)", code="invalid_api_key", headers=(("www-authenticate", "Bearer"),))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
