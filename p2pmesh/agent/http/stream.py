"""Answering one request: a JSON body or server-sent events (`Reply`), and one generation
read from the agent's events and cut at stop sequences (`Run`)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import trio

from p2pmesh.agent.http.bodies import ApiError, Shape, generation_error
from p2pmesh.agent.http.schema import Options

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class Reply:
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


class Run:
    """One generation: reads the agent's events and answers as one JSON object or as SSE."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], options: Options, shape: Shape, prompt_count: int | None,
                 idle_s: float) -> None:
        self.events, self.options, self.shape = events, options, shape
        self.prompt_count, self.idle_s = prompt_count, idle_s
        self.scanner = StopScanner(options.stop)
        self.completion_tokens = 0
        self.started = trio.current_time()
        self.first_token_at: float | None = None

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
        tokens = len(event.get("tokens") or ())
        if tokens and self.first_token_at is None:
            self.first_token_at = trio.current_time()
        self.completion_tokens += tokens
        text = self.scanner.feed(str(event.get("text") or ""))
        if self.scanner.hit:
            return text, "stop"
        if event.get("final"):
            return text + self.scanner.flush(), str(event.get("finish") or "stop")
        return text, None

    def usage(self) -> dict[str, Any]:
        p, c = self.prompt_count, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": None if p is None else p + c}

    def timings(self) -> dict[str, Any]:
        """p2pmesh's addition (as llama.cpp's server has one): the time from the request's
        arrival to its first token, None when none came."""
        first = self.first_token_at
        return {"ttft_ms": None if first is None else round((first - self.started) * 1000, 1)}

    async def respond(self, reply: Reply) -> None:
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
                await reply.json(200, {**self.shape.whole("".join(parts), finish, self.usage()), "timings": self.timings()})
        except ApiError as exc:
            if not reply.started:
                await reply.error(exc)
            else:
                # Headers are gone: report inside the stream (the openai client raises on an
                # event with an "error" key) and end it without [DONE].
                await reply.event(exc.body())
                await reply.end_events()

    async def _stream(self, reply: Reply) -> None:
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
            await reply.event({**self.shape.usage_chunk(self.usage()), "timings": self.timings()})
        await reply.event("[DONE]")
        await reply.end_events()
