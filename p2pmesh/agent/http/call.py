"""One request as an endpoint's handler sees it (`Call`), whichever API it belongs to: the
agent's status and the served model, the body (bounded in size and time), prompts through
the model's tokenizer, a JSON answer, and a generation answered in the API's own format
(stream.Format) that a client hanging up cancels.

Every API (completions.py, responses.py, anthropic.py, ollama.py) generates through
`Call.generate`, so the limits, the cancellation and the usage counts are the same for all.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import trio

from p2pmesh.agent.http.bodies import ApiError
from p2pmesh.agent.http.config import HttpLimits
from p2pmesh.agent.http.prompts import Prompt, Tokenizers
from p2pmesh.agent.http.schema import ChatMessage, Options
from p2pmesh.agent.http.stream import Format, Receive, Reply, Run


class Service(Protocol):
    """What the API needs of the agent: its `status` and `generate` control ops (the agent's
    runtime, or a stub in tests). Nothing else: the API never touches the core."""

    def status(self) -> dict[str, Any]: ...

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


class ClientGone(Exception):
    """The client went away while sending its request: nothing is answered."""


class Call:
    """One request being answered."""

    def __init__(self, agent: Service, tokenizers: Tokenizers, limits: HttpLimits, headers: dict[str, str],
                 receive: Receive, reply: Reply) -> None:
        self.agent, self.tokenizers, self.limits = agent, tokenizers, limits
        self.headers, self.receive, self.reply = headers, receive, reply

    def status(self) -> dict[str, Any]:
        return self.agent.status()

    def placement(self) -> dict[str, Any]:
        return self.agent.status().get("placement") or {}

    def serving_model(self) -> str:
        """The model to generate with, or 503 saying why there is none."""
        placement = self.placement()
        name = placement.get("model")
        if name is None:
            raise ApiError(503, "no model is serving: choose one with `p2pmesh model set NAME`", code="no_model")
        problem = placement.get("problem")
        if problem and not placement.get("serving"):  # core/fit.py: retrying will not help until the cluster changes
            raise ApiError(503, str(problem.get("message")), code=str(problem.get("code")))
        if not placement.get("serving"):
            raise ApiError(503, f"the model {name} is not serving yet (being placed or loaded, or a Mac holding a "
                                f"stage is down); retry shortly", code="model_not_serving", headers=(("retry-after", "2"),))
        return str(name)

    async def json(self, obj: Any, status: int = 200) -> None:
        await self.reply.json(status, obj)

    # -- reading the request ------------------------------------------------------------

    async def body(self) -> bytes:
        """The body's bytes, bounded in size and time (raises ClientGone when the client went
        away); each API's schema parses them."""
        limit = self.limits.max_body_bytes
        declared = self.headers.get("content-length")
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
                message = await self.receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s", code="timeout")
        self.reply.unread = False
        return b"".join(chunks)

    # -- prompts ----------------------------------------------------------------------

    async def chat_prompt(self, model: str, messages: tuple[ChatMessage, ...]) -> Prompt:
        """A conversation through the model's chat template (prompts.render_chat)."""
        return await self.tokenizers.chat_prompt(model, messages)

    async def text_prompt(self, model: str, text: str) -> Prompt:
        """Text the head tokenizes as it is (BOS added), counted for usage."""
        return Prompt(text, (), await self.tokenizers.count(model, text))

    # -- generation -------------------------------------------------------------------

    async def generate(self, prompt: Prompt, options: Options, fmt: Format) -> None:
        """Generate with the agent's `generate` op and answer in `fmt`; a client that hangs
        up cancels the generation (the finally closes the agent's iterator, which forgets
        the request)."""
        request: dict[str, Any] = {
            "prompt": prompt.text, "prompt_tokens": list(prompt.tokens) or None, "max_tokens": options.max_tokens,
            "temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
        }
        events = self.agent.generate(request)
        run = Run(events, options, fmt, prompt.count, self.limits.stream_idle_timeout_s)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, self.receive, nursery.cancel_scope)
                await run.respond(self.reply)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await events.aclose()  # type: ignore[attr-defined]


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
