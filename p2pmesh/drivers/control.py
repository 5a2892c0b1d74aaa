"""The local control socket, the agent's side: a Unix socket in the state directory that
the CLI and programs reach through p2pmesh/client. One JSON request line in; one JSON
response line out, or for a streaming op (``generate``) one JSON line per event until a
line with ``"final": true``. Requests are bounded in size and time (a stream: in time between events).
Ops: ``status``, ``model``, ``leave``, ``generate``, ``pair`` (a conversation: the
user answers the code question on the same connection), and for the chaos tool's history
(scripts/chaos.py) ``members`` (the committed membership, a linearizable ReadIndex read by
default) and ``log`` (committed entries as index, term and digest, in bounded pages).

Only the server side lives here: every program, tool and test talks to it through
p2pmesh/client (its typed methods, or ``Client.call`` / ``Client.stream`` for raw ops).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import trio

from p2pmesh.core.protocol import ErrorCode, error_answer, is_number

REQUEST_BYTES_MAX = 64 * 1024
REQUEST_TIMEOUT_S = 10.0
MODEL_TIMEOUT_S = 6 * 3600.0
CLIENTS_CONCURRENT_MAX = 32
STREAM_IDLE_TIMEOUT_S = 300.0
"""A streaming request fails when nothing happens for this long (no token, no end)."""


class _Agent(Protocol):
    def status(self) -> dict[str, Any]: ...

    def request_leave(self) -> None: ...

    async def set_model(self, request: dict[str, Any]) -> dict[str, Any]: ...

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def read_members(self, *, linearizable: bool = True) -> dict[str, Any]: ...

    def committed_log(self, after: int, count_max: int) -> dict[str, Any]: ...

    def leave_outcome(self) -> dict[str, Any]: ...

    async def pair(self, request: dict[str, Any], emit: Callable[[dict[str, Any]], Awaitable[None]],
                   ask: Callable[[dict[str, Any]], Awaitable[bool]]) -> dict[str, Any]: ...

    left: trio.Event
    control_active: int


async def serve(path: Path, agent: _Agent, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    limiter = trio.CapacityLimiter(CLIENTS_CONCURRENT_MAX)
    task_status.started()
    try:
        async with trio.open_nursery() as nursery:
            async with listener:
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(_handle, stream, agent, limiter)
    finally:
        try:
            path.unlink()
        except OSError:
            pass


async def _handle(stream: trio.SocketStream, agent: _Agent, limiter: trio.CapacityLimiter) -> None:
    async with limiter, stream:
        agent.control_active += 1
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                buf = b""
                while b"\n" not in buf:
                    chunk = await stream.receive_some(4096)
                    if not chunk or len(buf) + len(chunk) > REQUEST_BYTES_MAX:
                        return
                    buf += chunk
            line, rest = buf.split(b"\n", 1)
            op = _op_of(line)
            if op == "generate":
                await _stream(stream, json.loads(line), agent)
                return
            if op == "pair":
                await _pair(stream, rest, json.loads(line), agent)
                return
            # Loading a model may first download it: that op gets hours; a leave waits as long
            # as its caller asked (a Mac holding layers drains first); the others seconds.
            with trio.fail_after(_bound(op, line)):
                response = await _dispatch(line, agent)
                await stream.send_all(json.dumps(response).encode() + b"\n")
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            agent.control_active -= 1


LEAVE_TIMEOUT_MAX_S = 600.0
LEAVE_WAIT_DEFAULT_S = 90.0
"""How long a leave waits for the cluster's confirmation by default: a Mac holding layers
first drains (a new placement loads without it), which takes more than a few seconds."""


def _bound(op: str | None, line: bytes) -> float:
    if op == "model":
        return MODEL_TIMEOUT_S
    if op == "leave":
        try:
            asked = float(json.loads(line).get("timeout_s", LEAVE_WAIT_DEFAULT_S))
        except (ValueError, TypeError, AttributeError):
            asked = REQUEST_TIMEOUT_S
        return min(LEAVE_TIMEOUT_MAX_S, max(REQUEST_TIMEOUT_S, asked + 5.0))
    return REQUEST_TIMEOUT_S


def _op_of(line: bytes) -> str | None:
    try:
        request = json.loads(line)
        return request.get("op") if isinstance(request, dict) else None
    except ValueError:
        return None


async def _stream(stream: trio.SocketStream, request: dict[str, Any], agent: _Agent) -> None:
    """Send each event of a generation as its own line; the last one has "final": true."""
    events = agent.generate(request)
    try:
        while True:
            with trio.fail_after(STREAM_IDLE_TIMEOUT_S):
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    return
            await stream.send_all(json.dumps(event).encode() + b"\n")
            if event.get("final"):
                return
    finally:
        await events.aclose()  # type: ignore[attr-defined]


ANSWER_BYTES_MAX = 1024


async def _pair(stream: trio.SocketStream, rest: bytes, request: dict[str, Any], agent: _Agent) -> None:
    """A pairing (p2pmesh/agent/tasks/pairing.py) is a conversation: progress events go out as lines,
    and an event with a "question" waits for one answer line ``{"same_code": true}`` from
    the user. Anything but a clear yes is a no; a line that comes when nothing was asked is
    dropped (it must never answer a later question). When the user's command goes away the
    pairing stops at once (the host's port closes). The pairing window bounds the whole."""
    answers_send, answers = trio.open_memory_channel[bytes](1)
    asking = False

    async with trio.open_nursery() as nursery:
        async def read_answers() -> None:
            buf = rest
            while True:
                while b"\n" not in buf:
                    try:
                        chunk = await stream.receive_some(256)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        chunk = b""
                    if not chunk or len(buf) + len(chunk) > ANSWER_BYTES_MAX:
                        nursery.cancel_scope.cancel()  # the user's command went away
                        return
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                if asking:
                    await answers_send.send(line)

        async def emit(event: dict[str, Any]) -> None:
            try:
                await stream.send_all(json.dumps({"ok": True, **event}).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                nursery.cancel_scope.cancel()
                await trio.lowlevel.checkpoint()  # the cancellation lands here

        async def ask(event: dict[str, Any]) -> bool:
            nonlocal asking
            asking = True
            try:
                await emit({**event, "question": "do both Macs show this code?"})
                line = await answers.receive()
            finally:
                asking = False
            try:
                answer = json.loads(line)
            except ValueError:
                return False
            return isinstance(answer, dict) and answer.get("same_code") is True

        async def run() -> None:
            result = await agent.pair(request, emit, ask)
            await emit({**result, "final": True})
            nursery.cancel_scope.cancel()

        nursery.start_soon(read_answers)
        nursery.start_soon(run)


async def _dispatch(line: bytes, agent: _Agent) -> dict[str, Any]:
    try:
        request = json.loads(line)
        op = request["op"]
    except (ValueError, KeyError, TypeError):
        return error_answer(ErrorCode.BAD_REQUEST, "bad request: send one JSON object with an 'op' key")
    if op == "status":
        return {"ok": True, "status": agent.status()}
    if op == "model":
        return await agent.set_model(request)
    if op == "members":
        linearizable = request.get("linearizable", True)
        if not isinstance(linearizable, bool):
            return error_answer(ErrorCode.BAD_REQUEST, "members: linearizable must be true or false", param="linearizable")
        return await agent.read_members(linearizable=linearizable)
    if op == "log":
        after, count = request.get("after", 0), request.get("count_max", 256)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in (after, count)):
            return error_answer(ErrorCode.BAD_REQUEST, "log: after and count_max must be non-negative integers")
        return agent.committed_log(after, count)
    if op == "leave":
        wait = request.get("timeout_s", LEAVE_WAIT_DEFAULT_S)
        if not is_number(wait) or not wait >= 0:
            return error_answer(ErrorCode.BAD_REQUEST, "leave: timeout_s must be a non-negative number", param="timeout_s")
        agent.request_leave()
        with trio.move_on_after(min(LEAVE_TIMEOUT_MAX_S, float(wait))):
            await agent.left.wait()
        return {"ok": True, "left": agent.left.is_set(), **agent.leave_outcome()}
    return error_answer(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
