"""Where the agent is, and the two drivers that carry out a plan's steps (client/steps.py):
one with trio, one with blocking sockets (no event loop, so it also works in notebooks).

A driver only does I/O: connect, send, receive, close, sleep, read the clock, run blocking
work. It decides nothing a plan could decide. One driver serves one operation (or one
generation, one watch) and closes every connection it opened when that ends.
"""
from __future__ import annotations

import os
import socket as stdsocket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import trio

from p2pmesh.client.errors import AgentNotRunning, AgentTimeout
from p2pmesh.client.steps import (
    RECEIVE_BYTES,
    REQUEST_TIMEOUT_S,
    Blocking,
    Clock,
    Close,
    Connect,
    Emit,
    Plan,
    Receive,
    Send,
    Sleep,
    Step,
)
from p2pmesh.core.protocol import AgentError

SOCKET_ENV = "P2PMESH_SOCKET"
SOCKET_NAME = "agent.sock"

T = TypeVar("T")
C = TypeVar("C")


def locate_socket(address: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The agent's control socket and how it was chosen (for error messages): the address
    given (a socket or a state directory), else $P2PMESH_SOCKET, else the default state
    directory's socket. The CLI resolves --socket/--state-dir the same way."""
    if address is not None:
        how = "the address given"
        raw = os.fspath(address)
    elif os.environ.get(SOCKET_ENV):
        how = f"from ${SOCKET_ENV}"
        raw = os.environ[SOCKET_ENV]
    else:
        from p2pmesh.agent import default_state_dir

        return default_state_dir() / SOCKET_NAME, "the default state directory"
    path = Path(raw).expanduser()
    return (path / SOCKET_NAME if path.is_dir() else path), how


def not_running(path: Path, how: str, exc: OSError) -> AgentNotRunning:
    if isinstance(exc, FileNotFoundError):
        why = "no socket there"
    elif isinstance(exc, ConnectionRefusedError):
        why = "the socket exists but nothing listens: an agent that stopped left it behind"
    else:
        why = exc.strerror or str(exc)
    return AgentNotRunning(
        f"no p2pmesh agent is running at {path} ({why}; looked there as {how}). Start one with `p2pmesh agent` "
        f"(with --state-dir DIR, pass DIR or DIR/{SOCKET_NAME} as the address or set ${SOCKET_ENV})", path)


def _not_taken(step: Send, exc: BaseException) -> AgentError:
    return AgentError(f"the agent did not take {step.what}: {exc}")


def _silent(step: Receive) -> AgentTimeout:
    return AgentTimeout(f"the agent sent nothing for {step.timeout_s:g} s ({step.what})")


def _broke(step: Receive, exc: BaseException) -> AgentError:
    return AgentError(f"the connection to the agent broke ({step.what}): {exc}")


def _unexpected(step: Step) -> AssertionError:
    return AssertionError(f"a plan emitted {step!r} where no value is expected")


def _resume(plan: Plan[Any], value: Any) -> tuple[str, Any]:
    """Send ``value`` into the plan: ("step", the next step to carry out), ("emit", a value it
    emits) or ("end", its result). The one loop body both drivers share."""
    try:
        step = plan.send(value)
    except StopIteration as stop:
        return "end", stop.value
    return ("emit", step.value) if isinstance(step, Emit) else ("step", step)


def _result(emitted: bool, value: Any) -> Any:
    if emitted:
        raise _unexpected(Emit(value))
    return value


class _Connections(Generic[C]):
    """The connections a driver opened, closed when its plan ends however it ends."""

    def __init__(self, path: Path, how: str) -> None:
        self.path, self.how = path, how
        self.conns: list[C] = []

    def _shut(self, conn: C) -> None:
        raise NotImplementedError

    def _opened(self, conn: C) -> C:
        """Keep a connection the plan just opened, to close it when the plan ends."""
        self.conns.append(conn)
        return conn

    def _close(self, conn: C) -> None:
        self._shut(conn)
        if conn in self.conns:
            self.conns.remove(conn)

    def close(self) -> None:
        """Close every connection still open (a plan that failed or was abandoned)."""
        for conn in list(self.conns):
            self._close(conn)

    def _end(self, plan: Plan[Any]) -> None:
        plan.close()
        self.close()


class SyncDriver(_Connections[stdsocket.socket]):
    """Carries out steps with blocking calls."""

    def step(self, step: Step) -> Any:
        if isinstance(step, Receive):
            step.conn.settimeout(step.timeout_s)
            try:
                return step.conn.recv(RECEIVE_BYTES)
            except TimeoutError:
                raise _silent(step) from None
            except OSError as exc:
                raise _broke(step, exc) from None
        if isinstance(step, Send):
            step.conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                step.conn.sendall(step.data)
            except OSError as exc:
                if step.best_effort:
                    return False
                raise _not_taken(step, exc) from None
            return True
        if isinstance(step, Connect):
            s = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
            s.settimeout(REQUEST_TIMEOUT_S)
            try:
                s.connect(str(self.path))
            except OSError as exc:
                s.close()
                raise not_running(self.path, self.how, exc) from None
            return self._opened(s)
        if isinstance(step, Close):
            return self._close(step.conn)
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Clock):
            return time.monotonic()
        if isinstance(step, Blocking):
            return step.fn()
        raise _unexpected(step)

    def _shut(self, conn: stdsocket.socket) -> None:
        conn.close()

    def advance(self, plan: Plan[Any]) -> tuple[bool, Any]:
        """Run the plan to its next Emit: (True, the value), or to its end: (False, its result)."""
        kind, out = _resume(plan, None)
        while kind == "step":
            kind, out = _resume(plan, self.step(out))
        return kind == "emit", out

    def run(self, plan: Plan[T]) -> T:
        """Run a plan that emits nothing to its result."""
        try:
            return _result(*self.advance(plan))  # type: ignore[no-any-return]
        finally:
            self._end(plan)

    def iterate(self, plan: Plan[None]) -> Iterator[Any]:
        """The values a plan emits, until it ends."""
        try:
            while True:
                emitted, value = self.advance(plan)
                if not emitted:
                    return
                yield value
        finally:
            self._end(plan)


class AsyncDriver(_Connections[trio.SocketStream]):
    """Carries out steps with trio."""

    async def step(self, step: Step) -> Any:
        if isinstance(step, Receive):
            try:
                with trio.fail_after(step.timeout_s):
                    return await step.conn.receive_some(RECEIVE_BYTES)
            except trio.TooSlowError:
                raise _silent(step) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _broke(step, exc.__cause__ or exc) from None
        if isinstance(step, Send):
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    await step.conn.send_all(step.data)
            except trio.TooSlowError:
                if step.best_effort:
                    return False
                raise _not_taken(step, TimeoutError(f"not within {REQUEST_TIMEOUT_S:g} s")) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if step.best_effort:
                    return False
                raise _not_taken(step, exc.__cause__ or exc) from None
            return True
        if isinstance(step, Connect):
            try:
                stream = await trio.open_unix_socket(str(self.path))
            except OSError as exc:
                raise not_running(self.path, self.how, exc) from None
            return self._opened(stream)
        if isinstance(step, Close):
            return self._close(step.conn)
        if isinstance(step, Sleep):
            await trio.sleep(step.seconds)
            return None
        if isinstance(step, Clock):
            return trio.current_time()
        if isinstance(step, Blocking):
            return await trio.to_thread.run_sync(step.fn)
        raise _unexpected(step)

    def _shut(self, conn: trio.SocketStream) -> None:
        conn.socket.close()  # synchronous: safe while a cancellation unwinds

    async def advance(self, plan: Plan[Any]) -> tuple[bool, Any]:
        """Run the plan to its next Emit: (True, the value), or to its end: (False, its result)."""
        kind, out = _resume(plan, None)
        while kind == "step":
            kind, out = _resume(plan, await self.step(out))
        return kind == "emit", out

    async def run(self, plan: Plan[T]) -> T:
        """Run a plan that emits nothing to its result."""
        try:
            return _result(*await self.advance(plan))  # type: ignore[no-any-return]
        finally:
            self._end(plan)

    async def iterate(self, plan: Plan[None]) -> AsyncIterator[Any]:
        """The values a plan emits, until it ends."""
        try:
            while True:
                emitted, value = await self.advance(plan)
                if not emitted:
                    return
                yield value
        finally:
            self._end(plan)
