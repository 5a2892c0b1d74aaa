"""OpenAI's Responses API: `POST /v1/responses` (docs/http.md, "OpenAI Responses").

Owns the request's schema (`ResponsesBody`: `input` as a string or a list of messages with
text content, `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`) and
the answer: a `response` object whole, or the Responses stream's events
(response.created ... response.output_text.delta ... response.completed). The input is a
conversation rendered through the model's chat template, exactly as chat completions do;
errors have OpenAI's shape (bodies.ApiError).
"""
from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

from msgspec import Meta, Struct

from p2pmesh.agent.http.bodies import ApiError
from p2pmesh.agent.http.call import Call
from p2pmesh.agent.http.schema import (
    DEFAULT_CHAT_MAX_TOKENS,
    MESSAGES_MAX,
    ChatMessage,
    Conversation,
    MaxTokens,
    PromptText,
    Temperature,
    TextFormat,
    TopP,
    decode,
    make_options,
    text_of,
)
from p2pmesh.agent.http.stream import Event, Outcome

# ------------------------------------------------------------------------------------
# The request

InputRole = Literal["user", "assistant", "system", "developer"]


class InputText(Struct, frozen=True):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(Struct, frozen=True):
    """An input item: a message (EasyInputMessage, or an item with "type": "message")."""

    role: InputRole
    content: str | list[InputText]
    type: Literal["message"] = "message"


class TextConfig(Struct, frozen=True):
    format: TextFormat | None = None


class ResponsesBody(Struct, frozen=True, kw_only=True):
    """POST /v1/responses. Unknown fields (store, metadata, reasoning, user, ...) are ignored."""

    input: PromptText | Annotated[list[InputMessage], Meta(min_length=1, max_length=MESSAGES_MAX)]
    model: str | None = None
    """Accepted whatever it says (the cluster serves one model)."""
    instructions: PromptText | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    text: TextConfig | None = None
    # Features this server does not have: refused when on (schema.refuse_unsupported).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None


_FEATURES = ("tools", "tool_choice", "previous_response_id", "conversation", "prompt", "background", "top_logprobs")
_WHY = {
    "input": f'a string, or a list of at most {MESSAGES_MAX} messages {{"role", "content"}}',
    "input.role": f"one of {', '.join(get_args(InputRole))}",
    "input.content": "a string or a list of text parts",
    "input.content.type": "only text parts are supported (input_text, output_text)",
    "input.type": "only message items are supported",
    "text": 'only {"format": {"type": "text"}} is supported',
    "model": "the cluster serves one model; see GET /v1/models",
}


def parse_responses(raw: bytes) -> Conversation[ResponsesBody]:
    body = decode(raw, ResponsesBody, _WHY, _FEATURES)
    messages = [ChatMessage("system", body.instructions)] if body.instructions is not None else []
    if isinstance(body.input, str):
        messages.append(ChatMessage("user", body.input))
    else:
        messages += [ChatMessage("system" if m.role == "developer" else m.role, text_of(m.content)) for m in body.input]
    return Conversation(tuple(messages), body)


async def create(call: Call) -> None:
    r = parse_responses(await call.body())
    b = r.body
    options = make_options(b.max_output_tokens, DEFAULT_CHAT_MAX_TOKENS, b.temperature, b.top_p, None, bool(b.stream))
    model = call.serving_model()
    prompt = await call.chat_prompt(model, r.messages)
    fmt = ResponseShape(model, b.instructions, options.max_tokens, options.temperature, options.top_p)
    await call.generate(prompt, options, fmt)


# ------------------------------------------------------------------------------------
# The answer


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """The `response` object and the Responses stream's events (a stream.Format)."""

    ndjson: ClassVar[bool] = False
    model: str
    instructions: str | None
    max_output_tokens: int
    temperature: float
    top_p: float
    id: str = field(default_factory=lambda: "resp_" + secrets.token_hex(12))
    item_id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    created_at: int = field(default_factory=lambda: int(time.time()))
    _numbers: Iterator[int] = field(default_factory=itertools.count)
    """Every event's sequence_number, from 0."""

    def error_body(self, exc: ApiError) -> Any:
        return exc.body()

    def whole(self, out: Outcome) -> dict[str, Any]:
        return self._response(out)

    def opening(self, out: Outcome) -> Iterable[Event]:
        shell = self._response(None)
        yield self._event("response.created", response=shell)
        yield self._event("response.in_progress", response=shell)
        yield self._event("response.output_item.added", output_index=0, item=self._message(None))
        yield self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                          part=_text_part(""))

    def piece(self, text: str) -> Iterable[Event]:
        yield self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, out: Outcome) -> Iterable[Event]:
        yield self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                          text=out.text, logprobs=[])
        yield self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                          part=_text_part(out.text))
        yield self._event("response.output_item.done", output_index=0, item=self._message(out))
        response = self._response(out)
        yield self._event(f"response.{response['status']}", response=response)

    def failure(self, exc: ApiError) -> Iterable[Event]:
        yield self._event("error", code=exc.code, message=exc.message, param=exc.param)
        failed = {**self._response(None), "status": "failed", "error": {"code": exc.code or "server_error",
                                                                         "message": exc.message}}
        yield self._event("response.failed", response=failed)

    def _event(self, kind: str, **fields: Any) -> Event:
        return kind, {"type": kind, "sequence_number": next(self._numbers), **fields}

    def _message(self, out: Outcome | None) -> dict[str, Any]:
        status = "in_progress" if out is None else _status(out)
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if out is None else [_text_part(out.text)]}

    def _response(self, out: Outcome | None) -> dict[str, Any]:
        status = "in_progress" if out is None else _status(out)
        usage = None
        if out is not None:
            p, c = out.prompt_tokens, out.completion_tokens
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": c,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": None if p is None else p + c}
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": [] if out is None else [self._message(out)], "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": False, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": {}, "previous_response_id": None, "reasoning": None, "background": False,
        }
        if out is not None:
            body["timings"] = out.timings()
        return body


def _status(out: Outcome) -> str:
    """A response cut by max_output_tokens (or the context's end) is "incomplete", as OpenAI's."""
    return "incomplete" if out.finish == "length" else "completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
