"""The two clients of a running agent: AsyncClient (trio) and Client (blocking), with their
streaming generations. Both are thin: each method hands the same plan (client/plans.py) to
its driver (client/drivers.py), so they share every decision and cannot drift apart.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from p2pmesh.client import plans
from p2pmesh.client.drivers import AsyncDriver, SyncDriver, locate_socket
from p2pmesh.client.plans import DEFAULT_CONTEXT_TOKENS, LOAD_TIMEOUT_S, MODEL_TIMEOUT_S, POLL_S, QUORUM_TIMEOUT_S
from p2pmesh.client.steps import REQUEST_TIMEOUT_S, STREAM_IDLE_TIMEOUT_S, Decoder, Plan, ask_answer, events, generation
from p2pmesh.client.values import Event, GenerationResult, LoadedModel, LoadProgress, Member, ModelInfo, Placement, Ring
from p2pmesh.client.values import Status
from p2pmesh.core.protocol import AgentError


class _Base:
    """What both clients hold: where the agent is, and the plans of their methods."""

    def __init__(self, address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S,
                 _model_root: Path | None = None) -> None:
        self.socket_path, self._how = locate_socket(address)
        self.quorum_timeout = quorum_timeout
        self._model_root = _model_root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.socket_path)!r})"

    def _generate_plan(self, prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> Plan[dict[str, Any]]:
        return plans.generate(plans.generate_fields(prompt, max_tokens, temperature, top_p, seed), self.quorum_timeout)

    def _chat_plan(self, messages: Sequence[Mapping[str, Any]], max_tokens: int, temperature: float, top_p: float,
                   seed: int) -> Plan[dict[str, Any]]:
        fields = plans.generate_fields("", max_tokens, temperature, top_p, seed)
        return plans.chat(messages, fields, self.quorum_timeout, self._model_root)

    @staticmethod
    def _stream_plan(op: str, idle_timeout: float, fields: dict[str, Any]) -> Plan[None]:
        return events({"op": op, **fields}, idle_timeout, f"the {op} stream")


class _Stream:
    """What both generations hold: the plan that sends the request and emits the pieces."""

    def __init__(self, prepare: Plan[dict[str, Any]]) -> None:
        self._decoder = Decoder()
        self._plan: Plan[None] = generation(prepare, self._decoder)
        self._finished = False

    @property
    def result(self) -> GenerationResult | None:
        return self._decoder.result

    def _end(self) -> None:
        self._finished = True
        self._plan.close()

    def _collected(self) -> GenerationResult:
        if self._decoder.result is None:
            raise AgentError("the generation was closed before its end")
        return self._decoder.result


# ----------------------------------------------------------------------------------------
# The async client (trio)


class AsyncClient(_Base):
    """A client of one agent, for trio programs. Every method opens its own connection to
    the control socket, so one client can be shared by many tasks."""

    async def __aenter__(self) -> Self:
        await self.status()  # fail here, with the fix, when no agent answers
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def _driver(self) -> AsyncDriver:
        return AsyncDriver(self.socket_path, self._how)

    async def status(self) -> Status:
        """This agent's view right now (no waiting: `healthy` says whether it has a cluster)."""
        return await self._driver().run(plans.status())

    async def status_object(self, *, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """The agent's status as the JSON object it sent (what `p2pmesh status --json` prints:
        every field, also those `Status` does not type)."""
        return await self._driver().run(plans.status_object(timeout))

    async def members(self) -> tuple[Member, ...]:
        """The cluster's members (waits up to quorum_timeout for a working cluster)."""
        return (await self._driver().run(plans.healthy(self.quorum_timeout))).members

    async def ring(self) -> Ring:
        """The committed ring (epoch 0 and no order before the leader commits one)."""
        return (await self._driver().run(plans.healthy(self.quorum_timeout))).ring or Ring(0, (), ())

    async def placement(self) -> Placement:
        """The model's placement: the serving epoch's stages, and a pending one if loading."""
        st = await self._driver().run(plans.healthy(self.quorum_timeout))
        return st.placement or Placement(0, None, (), False)

    async def load(self, model: str | os.PathLike[str], *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   timeout: float = LOAD_TIMEOUT_S, on_progress: Callable[[LoadProgress], None] | None = None,
                   batch: int | None = None, parallelism: str = "auto", kv_bits: int | None = None) -> LoadedModel:
        """Serve `model` (a local directory or a Hugging Face id) cluster-wide and wait until
        it serves. `on_progress` is called with each new LoadProgress. `batch`: requests to
        serve at once (KV cache is reserved for them where memory allows); None: the agent's
        --max-batch. `parallelism`: "auto" (the planner's fastest), "pipeline", "tensor" or
        "hybrid" (BadRequest for another value; the placement's `parallelism` says what runs).
        `kv_bits`: 4 or 8 quantizes the KV cache (mlx-lm's QuantizedKVCache, once a request
        holds 5000 tokens), serving one request at a time; None: full precision (BadRequest
        for another value, or for a batch above 1 with it)."""
        return await self._driver().run(plans.load(model, context_tokens, timeout, self.quorum_timeout, on_progress, batch,
                                                   parallelism, kv_bits))

    async def set_model(self, model: str | os.PathLike[str] | None, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                        timeout: float = MODEL_TIMEOUT_S, batch: int | None = None,
                        parallelism: str = "auto", kv_bits: int | None = None) -> ModelInfo | None:
        """Ask the cluster to serve `model` (None: no model) and return once the agent
        proposed it, before it commits and long before it serves (`load` waits for that):
        the model as the agent described it, None for no model."""
        return await self._driver().run(plans.set_model(model, context_tokens, timeout, batch, parallelism, kv_bits))

    def generate(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> AsyncGeneration:
        """Stream the completion of `prompt` as text pieces: `async for piece in ...`."""
        return AsyncGeneration(self, self._generate_plan(prompt, max_tokens, temperature, top_p, seed))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> AsyncGeneration:
        """Stream the assistant's reply to `messages` ({"role", "content"} mappings),
        rendered with the model's chat template (or the documented fallback)."""
        return AsyncGeneration(self, self._chat_plan(messages, max_tokens, temperature, top_p, seed))

    def watch(self, *, interval: float = POLL_S) -> AsyncIterator[Event]:
        """Yield cluster Events as they happen (polling the agent every `interval` s).
        Ends with AgentNotRunning when the agent stops."""
        return self._driver().iterate(plans.watch(interval))

    async def leave(self, *, timeout: float = 90.0) -> bool:
        """Leave the cluster gracefully; the agent then exits. True once the cluster confirmed."""
        return await self._driver().run(plans.leave(timeout))

    def pair(self, *, window: float, answer: Callable[[dict[str, Any]], bool],
             join: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Pair over a cable (docs/pairing.md): let a Mac in, or with `join` get the key of
        the Mac at the other end. Yields the agent's events (JSON objects) until the final
        one (`paired`, or `error`); `answer(event)` (run in a thread: it may ask a person)
        answers an event with a "question": True only if both Macs show its code."""
        return self._driver().iterate(plans.pair(join, window, answer))

    async def call(self, op: str, *, timeout: float = REQUEST_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """The low level: send the control op `op` with `fields` as one request line and
        return the agent's answer as the JSON object it sent (ops the typed methods do not
        offer: `members`, `log`). An error answer raises the typed error of its code."""
        return await self._driver().run(ask_answer({"op": op, **fields}, timeout))

    def stream(self, op: str, *, idle_timeout: float = STREAM_IDLE_TIMEOUT_S, **fields: Any) -> AsyncIterator[dict[str, Any]]:
        """The low level of a streaming op (`generate` with fields the typed methods do not
        offer, e.g. `prompt_tokens`): yields the agent's events as JSON objects until the
        final one. An error event raises the typed error of its code; `idle_timeout`
        seconds without an event raise AgentTimeout."""
        return self._driver().iterate(self._stream_plan(op, idle_timeout, fields))


class AsyncGeneration(_Stream):
    """A streaming generation: `async for piece in gen` yields text pieces; afterwards
    `gen.result` holds the GenerationResult. Nothing is sent before the first iteration.
    Closing it early (`aclose`, `async with`) disconnects; the agent finishes the request
    on its own and drops the rest."""

    def __init__(self, client: AsyncClient, prepare: Plan[dict[str, Any]]) -> None:
        super().__init__(prepare)
        self._driver = client._driver()

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._end()
        self._driver.close()

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        try:
            emitted, piece = await self._driver.advance(self._plan)
        except BaseException:
            await self.aclose()
            raise
        if not emitted:
            await self.aclose()
            raise StopAsyncIteration
        return str(piece)

    async def collect(self) -> GenerationResult:
        """Consume the rest of the stream and return the result (all the text, not only
        the pieces not yet read)."""
        async for _ in self:
            pass
        return self._collected()


def open_client(address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> AsyncClient:
    """The async client of the agent at `address` (its socket, or its state directory;
    default $P2PMESH_SOCKET, else the default state directory). Use it as
    `async with open_client() as client:`; entering checks that the agent answers."""
    return AsyncClient(address, quorum_timeout=quorum_timeout)


# ----------------------------------------------------------------------------------------
# The synchronous client (blocking sockets; no event loop, so it also works in notebooks)


class Client(_Base):
    """The synchronous client: the same methods as AsyncClient, blocking."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Nothing to release (each call has its own connection); for symmetry with `with`."""

    def _driver(self) -> SyncDriver:
        return SyncDriver(self.socket_path, self._how)

    def status(self) -> Status:
        return self._driver().run(plans.status())

    def status_object(self, *, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        return self._driver().run(plans.status_object(timeout))

    def members(self) -> tuple[Member, ...]:
        return self._driver().run(plans.healthy(self.quorum_timeout)).members

    def ring(self) -> Ring:
        return self._driver().run(plans.healthy(self.quorum_timeout)).ring or Ring(0, (), ())

    def placement(self) -> Placement:
        return self._driver().run(plans.healthy(self.quorum_timeout)).placement or Placement(0, None, (), False)

    def load(self, model: str | os.PathLike[str], *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
             timeout: float = LOAD_TIMEOUT_S, on_progress: Callable[[LoadProgress], None] | None = None,
             batch: int | None = None, parallelism: str = "auto", kv_bits: int | None = None) -> LoadedModel:
        return self._driver().run(plans.load(model, context_tokens, timeout, self.quorum_timeout, on_progress, batch,
                                             parallelism, kv_bits))

    def set_model(self, model: str | os.PathLike[str] | None, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                  timeout: float = MODEL_TIMEOUT_S, batch: int | None = None,
                  parallelism: str = "auto", kv_bits: int | None = None) -> ModelInfo | None:
        return self._driver().run(plans.set_model(model, context_tokens, timeout, batch, parallelism, kv_bits))

    def generate(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> Generation:
        return Generation(self, self._generate_plan(prompt, max_tokens, temperature, top_p, seed))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> Generation:
        return Generation(self, self._chat_plan(messages, max_tokens, temperature, top_p, seed))

    def watch(self, *, interval: float = POLL_S) -> Iterator[Event]:
        return self._driver().iterate(plans.watch(interval))

    def leave(self, *, timeout: float = 90.0) -> bool:
        return self._driver().run(plans.leave(timeout))

    def pair(self, *, window: float, answer: Callable[[dict[str, Any]], bool],
             join: bool = False) -> Iterator[dict[str, Any]]:
        return self._driver().iterate(plans.pair(join, window, answer))

    def call(self, op: str, *, timeout: float = REQUEST_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        return self._driver().run(ask_answer({"op": op, **fields}, timeout))

    def stream(self, op: str, *, idle_timeout: float = STREAM_IDLE_TIMEOUT_S, **fields: Any) -> Iterator[dict[str, Any]]:
        return self._driver().iterate(self._stream_plan(op, idle_timeout, fields))


class Generation(_Stream):
    """The synchronous streaming generation: `for piece in gen`, then `gen.result`."""

    def __init__(self, client: Client, prepare: Plan[dict[str, Any]]) -> None:
        super().__init__(prepare)
        self._driver = client._driver()

    def __iter__(self) -> Generation:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._end()
        self._driver.close()

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        try:
            emitted, piece = self._driver.advance(self._plan)
        except BaseException:
            self.close()
            raise
        if not emitted:
            self.close()
            raise StopIteration
        return str(piece)

    def collect(self) -> GenerationResult:
        for _ in self:
            pass
        return self._collected()


def connect(address: str | os.PathLike[str] | None = None, *, quorum_timeout: float = QUORUM_TIMEOUT_S) -> Client:
    """The synchronous client of the agent at `address` (as open_client). Raises
    AgentNotRunning at once when no agent answers. Do not call it from the trio thread of
    an embedded Agent: it blocks, and that agent could not answer."""
    client = Client(address, quorum_timeout=quorum_timeout)
    client.status()
    return client
