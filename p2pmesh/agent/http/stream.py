"""Answering one request: a JSON body, server-sent events or NDJSON lines (`Reply`), and
one generation read from the agent's events and cut at stop sequences (`Run`), whatever the
API: each API's `Format` turns the generation (`Outcome`) into its own objects and events.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from p2pmesh.agent.http.bodies import ApiError, generation_error
from p2pmesh.agent.http.schema import Options

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
ErrorBody = Callable[[ApiError], Any]
"""An API's error body for an ApiError (OpenAI's, Anthropic's, Ollama's)."""
Event = tuple[str | None, Any]
"""One streamed message: its SSE event name (None: a bare `data:` line; NDJSON has no names)
and its payload (a JSON value, or a string sent as it is, such as OpenAI's `[DONE]`)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A generation as far as it went, in the terms every API's answer is made of."""

    text: str
    finish: str | None
    """The agent's reason: "stop" (end of sequence or a stop sequence) or "length"; None
    while the generation goes on."""
    stop_sequence: str | None
    """The stop sequence that cut the text, if one did."""
    prompt_tokens: int | None
    completion_tokens: int
    ttft_s: float | None
    """From the request's arrival to the first token (None: no token yet)."""
    elapsed_s: float
    """From the request's arrival to now."""

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object."""
        p, c = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": None if p is None else p + c}

    def timings(self) -> dict[str, Any]:
        """p2pmesh's addition (as llama.cpp's server has one): the time from the request's
        arrival to its first token, None when none came."""
        return {"ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 1)}


class Format(Protocol):
    """One API's answer to a generation: a whole JSON object, or a stream of events."""

    ndjson: bool
    """Stream as newline-delimited JSON (Ollama) rather than server-sent events."""

    def error_body(self, exc: ApiError) -> Any: ...

    def whole(self, out: Outcome) -> dict[str, Any]: ...

    def opening(self, out: Outcome) -> Iterable[Event]: ...

    def piece(self, text: str) -> Iterable[Event]: ...

    def closing(self, out: Outcome) -> Iterable[Event]: ...

    def failure(self, exc: ApiError) -> Iterable[Event]:
        """An error after the stream started: the events that report it (the stream ends after them)."""
        ...


class Reply:
    """One response: JSON, server-sent events or NDJSON; remembers whether it has started,
    since an error after the first byte can only be reported inside the stream. `errors`
    is the error body of the API the request is for."""

    def __init__(self, send: Send, unread: bool, errors: ErrorBody = ApiError.body) -> None:
        self._send = send
        self.started = False
        self.unread = unread
        """The request has a body not read (yet): an error answer must close the connection."""
        self.errors = errors
        self._ndjson = False

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
        await self.json(exc.status, self.errors(exc), exc.headers, close=close)

    async def start_events(self, ndjson: bool = False) -> None:
        self.started = True
        self._ndjson = ndjson
        kind = b"application/x-ndjson" if ndjson else b"text/event-stream; charset=utf-8"
        await self._send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", kind),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # a proxy in front must not buffer the tokens
        ]})

    async def event(self, obj: Any, name: str | None = None) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        if self._ndjson:
            frame = f"{data}\n"
        else:
            frame = f"data: {data}\n\n" if name is None else f"event: {name}\ndata: {data}\n\n"
        await self._send({"type": "http.response.body", "body": frame.encode(), "more_body": True})

    async def events(self, events: Iterable[Event]) -> None:
        for name, obj in events:
            await self.event(obj, name)

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
        self.matched: str | None = None
        """The stop sequence that cut the text (the earliest in it)."""

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        cuts = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            cut = min(cuts)
            self.matched = next(s for s in self.stops if self.pending.find(s) == cut)
            out, self.pending = self.pending[:cut], ""
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
    """One generation: reads the agent's events and answers in its API's format, as one
    JSON object or as a stream."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], options: Options, fmt: Format, prompt_count: int | None,
                 idle_s: float) -> None:
        self.events, self.options, self.fmt = events, options, fmt
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

    def outcome(self, text: str, finish: str | None) -> Outcome:
        now, first = trio.current_time(), self.first_token_at
        return Outcome(text, finish, self.scanner.matched, self.prompt_count, self.completion_tokens,
                       None if first is None else first - self.started, now - self.started)

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
                await reply.json(200, self.fmt.whole(self.outcome("".join(parts), finish)))
        except ApiError as exc:
            if not reply.started:
                await reply.error(exc)
            else:
                # Headers are gone: report inside the stream, in the API's own way (the
                # clients raise on it), and end it.
                await reply.events(self.fmt.failure(exc))
                await reply.end_events()

    async def _stream(self, reply: Reply) -> None:
        # Wait for the first event before answering, so a request the cluster refuses (no
        # model, a prompt too long) still gets a proper status code.
        text, finish = self._take(await self._next())
        await reply.start_events(self.fmt.ndjson)
        await reply.events(self.fmt.opening(self.outcome("", None)))
        parts: list[str] = []
        while True:
            if text:
                parts.append(text)
                await reply.events(self.fmt.piece(text))
            if finish is not None:
                break
            text, finish = self._take(await self._next())
        await reply.events(self.fmt.closing(self.outcome("".join(parts), finish)))
        await reply.end_events()
