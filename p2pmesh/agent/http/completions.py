"""OpenAI's Completions and Chat Completions: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions` (docs/http.md), and their answer objects, whole and streamed
(`Shape`). The bodies' schemas are in schema.py."""
from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from p2pmesh.agent.http.bodies import ApiError
from p2pmesh.agent.http.call import Call
from p2pmesh.agent.http.prompts import Prompt
from p2pmesh.agent.http.schema import parse_chat, parse_completion
from p2pmesh.agent.http.stream import Event, Outcome


async def models(call: Call) -> None:
    placement = call.placement()
    name = placement.get("model")
    data = [] if name is None else [{"id": name, "object": "model", "created": 0, "owned_by": "p2pmesh",
                                     "serving": bool(placement.get("serving"))}]
    await call.json({"object": "list", "data": data})


async def completions(call: Call) -> None:
    c = parse_completion(await call.body())
    model = call.serving_model()
    prompt = Prompt(None, c.prompt_tokens, len(c.prompt_tokens)) if c.prompt is None else await call.text_prompt(model, c.prompt)
    await call.generate(prompt, c.options, Shape("text_completion", model, c.options.include_usage))


async def chat(call: Call) -> None:
    r = parse_chat(await call.body())
    model = call.serving_model()  # 503 before loading a template
    prompt = await call.chat_prompt(model, r.messages)
    await call.generate(prompt, r.options, Shape("chat.completion", model, r.options.include_usage))


@dataclass(frozen=True, slots=True)
class Shape:
    """OpenAI's objects for one endpoint: "text_completion" or "chat.completion" (a stream.Format)."""

    ndjson: ClassVar[bool] = False
    kind: str
    model: str = ""
    include_usage: bool = False
    """Streams end with a chunk carrying the usage (stream_options.include_usage)."""
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _head(self, stream: bool) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        obj = self.kind + ".chunk" if self.chat and stream else self.kind
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def error_body(self, exc: ApiError) -> Any:
        return exc.body()

    def whole(self, out: Outcome) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        return {**self._head(False), "choices": [choice], "usage": out.usage(), "timings": out.timings()}

    def opening(self, out: Outcome) -> Iterable[Event]:
        if self.chat:
            yield None, {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]}

    def piece(self, text: str) -> Iterable[Event]:
        yield None, self._chunk(text, None)

    def closing(self, out: Outcome) -> Iterable[Event]:
        yield None, self._chunk("", out.finish)
        if self.include_usage:
            yield None, {**self._head(True), "choices": [], "usage": out.usage(), "timings": out.timings()}
        yield None, "[DONE]"

    def failure(self, exc: ApiError) -> Iterable[Event]:
        # The openai client raises APIError on an event with an "error" key; no [DONE] follows.
        yield None, exc.body()

    def _chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return {**self._head(True), "choices": [choice]}
