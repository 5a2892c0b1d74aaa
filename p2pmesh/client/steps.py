"""Sans-I/O plans: every client operation, down to the bytes on the socket, is written once
as a generator that yields *steps* and is driven either by trio (AsyncClient) or by plain
blocking calls (Client) (client/drivers.py). The drivers only carry out the steps; every
decision (framing, timeouts, what an answer means) is here, so the two clients cannot drift.

Steps: connect to the agent, send bytes, receive bytes, close, sleep, read the clock, run
blocking work (files, a tokenizer), and emit a value to the caller (a watch event, a piece
of generated text). A connection is an opaque handle the driver returned; the driver closes
whatever a plan left open when the plan ends or is abandoned.

The control protocol is one JSON request line per connection, answered by one JSON line,
or for `generate` by one line per event until one with `"final": true`. An error answer's
``code`` (core/protocol.py) decides the client error; its text only goes into the message.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from p2pmesh.client.values import GenerationResult
from p2pmesh.core.errors import MeshError
from p2pmesh.core.protocol import AgentError, ErrorCode, client_error, code_of

REQUEST_TIMEOUT_S = 15.0
"""One request/answer exchange (status, leave, ...). The agent answers in milliseconds."""
STREAM_IDLE_TIMEOUT_S = 300.0
"""A generation fails when the agent sends nothing for this long (as the agent's own bound)."""
LINE_BYTES_MAX = 16 * 1024 * 1024
RECEIVE_BYTES = 65536

T = TypeVar("T")


@dataclass(frozen=True)
class Connect:
    """Open a connection to the agent's control socket; the value is its handle."""


@dataclass(frozen=True)
class Send:
    conn: Any
    data: bytes
    what: str
    """For the error when the agent does not take the bytes ("the status request")."""
    best_effort: bool = False
    """A connection the agent already closed is no error: the value is whether the bytes
    went (a conversation's answer, when the agent ended it first: its last line is still
    to read)."""


@dataclass(frozen=True)
class Receive:
    """The value is the next bytes the agent sent, b"" once it closed the connection."""

    conn: Any
    timeout_s: float
    what: str


@dataclass(frozen=True)
class Close:
    conn: Any


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Clock:
    """The value is a monotonic time in seconds."""


@dataclass(frozen=True)
class Blocking:
    """Work that blocks (files, a tokenizer): a worker thread under trio."""

    fn: Callable[[], Any]


@dataclass(frozen=True)
class Emit:
    """Hand a value to the caller (an iteration's next item); the plan resumes on the next."""

    value: Any


Step = Connect | Send | Receive | Close | Sleep | Clock | Blocking | Emit
Plan = Generator[Step, Any, T]

# ----------------------------------------------------------------------------------------
# Lines on the socket


EOF_: Any = object()
"""What read_line returns when the agent closed the connection."""
_NO_LINE: Any = object()


class Lines:
    """Bytes in, complete decoded lines out; bounded, so a broken peer cannot exhaust memory."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if len(self.buf) > LINE_BYTES_MAX and b"\n" not in self.buf:
            raise AgentError("the agent sent an oversized line")

    def pop(self) -> Any:
        """The next decoded line, or _NO_LINE when no complete line is buffered."""
        if b"\n" not in self.buf:
            return _NO_LINE
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise AgentError("the agent sent a line that is not JSON") from None


def encode(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


def read_line(conn: Any, lines: Lines, timeout_s: float, what: str) -> Plan[Any]:
    """The next decoded line, or EOF_ when the agent closed the connection."""
    while True:
        line = lines.pop()
        if line is not _NO_LINE:
            return line
        chunk = yield Receive(conn, timeout_s, what)
        if not chunk:
            return EOF_
        lines.feed(chunk)


# ----------------------------------------------------------------------------------------
# Answers -> values or typed errors, by code


def _error(answer: dict[str, Any], default: str) -> tuple[ErrorCode, str]:
    return code_of(answer), str(answer.get("error") or default)


def checked(answer: Any, op: str, *, ok_default: bool = False) -> dict[str, Any]:
    """An op's answer, or the typed error its code maps to (core/protocol.ERRORS).
    ``ok_default``: what an answer without "ok" means (a stream's events: success)."""
    if not isinstance(answer, dict):
        raise AgentError(f"the agent answered {op} with something that is not a JSON object")
    if answer.get("ok", ok_default):
        return answer
    code, error = _error(answer, "no reason given")
    if code is ErrorCode.UNKNOWN_OP:
        raise client_error(code, f"the agent does not understand {op!r} ({error}); are the client and the agent the same version?")
    raise client_error(code, f"the agent refused {'the model' if op == 'model' else op}: {error}")


def ask(request: dict[str, Any], timeout_s: float, *, eof_ok: bool = False) -> Plan[dict[str, Any] | None]:
    """Send one request line, return the checked answer (None at EOF when eof_ok)."""
    op = str(request.get("op"))
    conn = yield Connect()
    yield Send(conn, encode(request), f"the {op} request")
    line = yield from read_line(conn, Lines(), timeout_s, f"waiting for the answer to {op}")
    yield Close(conn)
    if line is EOF_:
        if eof_ok:
            return None
        raise AgentError(f"the agent closed the connection without answering {op} (is it stopping?)")
    return checked(line, op)


def ask_answer(request: dict[str, Any], timeout_s: float) -> Plan[dict[str, Any]]:
    """`ask` for an op that must be answered."""
    answer = yield from ask(request, timeout_s)
    assert answer is not None
    return answer


# ----------------------------------------------------------------------------------------
# A streaming op's events, raw


def events(request: dict[str, Any], idle_timeout_s: float, what: str,
           answer: Callable[[dict[str, Any]], bool] | None = None) -> Plan[None]:
    """Send one request line, then emit each of the agent's events (its JSON objects, checked:
    an error event raises the typed error of its code) until the one with "final": true.
    ``what`` names the stream in errors ("pairing"). An event with a "question" (pairing's
    code check) is answered, once it was emitted, with ``answer(event)`` (blocking work: it
    may ask a person): True only for a clear yes."""
    op = str(request.get("op"))
    conn = yield Connect()
    yield Send(conn, encode(request), f"the {op} request")
    lines = Lines()
    while True:
        event = yield from read_line(conn, lines, idle_timeout_s, what)
        if event is EOF_:
            raise AgentError(f"the agent closed the {what} before its end (did it stop?)")
        event = checked(event, op, ok_default=True)
        yield Emit(event)
        if event.get("final"):
            yield Close(conn)
            return
        if answer is not None and event.get("question"):
            same = yield Blocking(lambda: answer(event))
            yield Send(conn, encode({"same_code": same is True}), "the answer", best_effort=True)


# ----------------------------------------------------------------------------------------
# A generation's stream


class Decoder:
    """The generate stream's events -> text pieces, the result, or a typed error."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.request_id = ""
        self.result: GenerationResult | None = None

    def feed(self, event: Any) -> str:
        if not isinstance(event, dict):
            raise AgentError("the agent sent a generation event that is not a JSON object")
        if not event.get("ok", True):
            raise generation_error(event)
        self.request_id = str(event.get("id", self.request_id))
        text, tokens = event.get("text") or "", event.get("tokens") or []
        if not isinstance(text, str) or not isinstance(tokens, list):
            raise AgentError("the agent sent a generation event of an unknown shape")
        self.tokens += [int(t) for t in tokens]
        if text:
            self.pieces.append(text)
        if event.get("final"):
            ttft_ms = event.get("ttft_ms")
            ttft_s = ttft_ms / 1000 if isinstance(ttft_ms, int | float) and not isinstance(ttft_ms, bool) and ttft_ms >= 0 else None
            self.result = GenerationResult(self.request_id, "".join(self.pieces), tuple(self.tokens), str(event.get("finish", "")),
                                           ttft_s)
        return text


def generation_error(event: dict[str, Any]) -> MeshError:
    code, error = _error(event, "the agent refused the request")
    if code is ErrorCode.BAD_REQUEST:
        return client_error(code, f"the agent refused the generation: {error}")
    if code is ErrorCode.NOT_SERVING:
        return client_error(code, f"the generation could not start: {error} (is the model still loading?)")
    return client_error(code, f"the generation failed: {error}")


def generation(prepare: Plan[dict[str, Any]], decoder: Decoder) -> Plan[None]:
    """Prepare the request (checks, a chat prompt), send it, then emit each text piece as it
    comes; `decoder.result` holds the end."""
    request = yield from prepare
    conn = yield Connect()
    yield Send(conn, encode(request), "the generate request")
    lines = Lines()
    while True:
        event = yield from read_line(conn, lines, STREAM_IDLE_TIMEOUT_S, "generating")
        if event is EOF_:
            raise AgentError("the agent closed the stream before the generation ended (did it stop?)")
        piece = decoder.feed(event)
        if decoder.result is not None:
            yield Close(conn)
            if piece:
                yield Emit(piece)
            return
        if piece:
            yield Emit(piece)
