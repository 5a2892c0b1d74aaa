"""`p2pmesh.Agent`: a p2pmesh agent (p2pmesh/agent/runtime.py) run inside the caller's trio program."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import trio

from p2pmesh.client.api import AsyncClient
from p2pmesh.client.errors import BadRequest, P2PMeshError
from p2pmesh.client.plans import QUORUM_TIMEOUT_S

if TYPE_CHECKING:
    from p2pmesh.agent import Agent as _CoreAgent
    from p2pmesh.agent import AgentConfig


_TUPLE_FIELDS = ("listen", "peers", "interfaces", "advertise")
_PATH_FIELDS = ("state_dir", "cluster_key_file", "model_root")


class Agent:
    """Run a p2pmesh agent inside this trio program: `async with p2pmesh.Agent(state_dir=...,
    listen=("0.0.0.0:7741",)) as agent:`. Keyword arguments are AgentConfig's fields (or
    pass `config=`). The agent runs until the block ends (then it stops, without leaving the
    cluster: call `await agent.client().leave()` first for that). It installs no signal
    handlers: the program owns them."""

    def __init__(self, config: AgentConfig | None = None, **fields: Any) -> None:
        from p2pmesh.agent import AgentConfig

        for name in _TUPLE_FIELDS:  # accept one address as a string, or a list
            if name in fields:
                v = fields[name]
                fields[name] = (v,) if isinstance(v, str) else tuple(v)
        for name in _PATH_FIELDS:
            if fields.get(name) is not None:
                fields[name] = Path(fields[name]).expanduser()
        try:
            self.config: AgentConfig = dataclasses.replace(config, **fields) if config is not None else AgentConfig(**fields)
        except TypeError as exc:
            raise BadRequest(f"p2pmesh.Agent takes AgentConfig's fields: {exc}") from None
        self._agent: _CoreAgent | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def socket_path(self) -> Path:
        return self.config.socket_path

    @property
    def node_id(self) -> str:
        if self._agent is None:
            raise P2PMeshError("the agent is not running: use it as `async with p2pmesh.Agent(...) as agent`")
        return str(self._agent.identity.node_id)

    @property
    def running(self) -> bool:
        return self._agent is not None and not self._agent.left.is_set()

    def client(self, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> AsyncClient:
        """An async client of this agent (no need to enter it)."""
        return AsyncClient(self.socket_path, quorum_timeout=quorum_timeout, _model_root=self.config.model_root)

    async def __aenter__(self) -> Self:
        from p2pmesh.agent import Agent as CoreAgent

        if self._stack is not None:
            raise P2PMeshError("this p2pmesh.Agent is already running")
        agent = CoreAgent(self.config)  # opens the state directory: StateCorrupted surfaces here
        stack = contextlib.AsyncExitStack()
        stack.callback(agent.storage.close)  # last, once the nursery has stopped every task
        self._stack, self._agent = stack, agent
        try:
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            await self._nursery.start(agent.run)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        stack, nursery = self._stack, self._nursery
        assert stack is not None
        self._stack = self._nursery = self._agent = None
        if nursery is not None:
            nursery.cancel_scope.cancel()  # stops the agent: its workers, control socket, links
        try:
            return bool(await stack.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            # trio wraps even a single error of the body in a group; give it back plain.
            leaves = _leaves(group)
            if len(leaves) == 1:
                raise leaves[0] from None
            raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out

