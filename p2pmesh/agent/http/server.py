"""The agent's HTTP API: an OpenAI-compatible front door to the cluster (docs/http.md).

This module owns the serving and the routing: a hand-written ASGI app served by hypercorn's
trio worker, the endpoints (`GET /health`, `GET /v1/models`, `GET /v1/cluster`,
`POST /v1/completions`, `POST /v1/chat/completions`, the last two also as server-sent
events; the dashboard's `GET /` and `GET /v1/events` are dashboard.py's), authentication,
limits and reading bodies. Beside it: config.py (settings and the
start-up checks), schema.py (the request bodies' schemas), bodies.py (OpenAI's response shapes,
errors), prompts.py
(chat templates, token counts), stream.py (one response, one generation).

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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from p2pmesh.agent.http.bodies import ApiError, Shape
from p2pmesh.agent.http.dashboard import EventStreams, serve_page
from p2pmesh.agent.http.schema import Options, parse_chat, parse_completion
from p2pmesh.agent.http.config import HttpBindError, HttpLimits, check_bind
from p2pmesh.agent.http.prompts import Prompt, Tokenizers
from p2pmesh.agent.http.stream import Receive, Reply, Run, Send
from p2pmesh.agent.status import public_status

log = logging.getLogger("p2pmesh.http")


# ------------------------------------------------------------------------------------
# Serving


class Service(Protocol):
    """What the API needs of the agent: its `status` and `generate` control ops (the agent's
    runtime, or a stub in tests). Nothing else: the API never touches the core."""

    def status(self) -> dict[str, Any]: ...

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


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

ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/cluster": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/events": ("GET",),  # the dashboard's live feed (dashboard.py; the page itself is dashboard.PAGES)
}


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

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})  # no websockets here
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reply = Reply(send, unread=headers.get("content-length", "0").strip() != "0" or "transfer-encoding" in headers)
        if await serve_page(path, method, send):  # the dashboard's page holds no data: no token needed
            return
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
            if path == "/v1/events":  # bounded on its own (dashboard.py): a stream lasts
                await self.events.stream(receive, reply)
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

    async def _dispatch(self, path: str, headers: dict[str, str], receive: Receive, reply: Reply) -> None:
        if path == "/v1/models":
            await reply.json(200, self._models())
        elif path == "/v1/cluster":
            await reply.json(200, self._cluster())
        else:
            body = await self._read_body(headers, receive, reply)
            if body is None:
                return  # the client went away while sending its request
            if path == "/v1/completions":
                c = parse_completion(body)
                model = _serving_model(self.agent.status())
                prompt = (Prompt(None, c.prompt_tokens, len(c.prompt_tokens)) if c.prompt is None
                          else Prompt(c.prompt, (), await self.tokenizers.count(model, c.prompt)))
                await self._generation(model, prompt, c.options, Shape("text_completion"), receive, reply)
            else:
                r = parse_chat(body)
                model = _serving_model(self.agent.status())  # 503 before loading a template
                prompt = await self.tokenizers.chat_prompt(model, r.messages)
                await self._generation(model, prompt, r.options, Shape("chat.completion"), receive, reply)

    # -- reading requests ------------------------------------------------------------

    async def _read_body(self, headers: dict[str, str], receive: Receive, reply: Reply) -> bytes | None:
        """The body's bytes (None: the client went away), bounded in size and time; schema.py
        parses them."""
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
        return b"".join(chunks)

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
        return public_status(self.agent.status())

    # -- generation -------------------------------------------------------------------

    async def _generation(self, model: str, prompt: Prompt, options: Options, shape: Shape, receive: Receive,
                          reply: Reply) -> None:
        request: dict[str, Any] = {
            "prompt": prompt.text, "prompt_tokens": list(prompt.tokens) or None, "max_tokens": options.max_tokens,
            "temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
        }
        events = self.agent.generate(request)
        run = Run(events, options, shape.with_model(model), prompt.count, self.limits.stream_idle_timeout_s)
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
