"""Anthropic's Messages API: `POST /v1/messages` (docs/http.md, "Anthropic Messages").

Owns the request's schema (`MessagesBody`: `model`, `max_tokens` (required), `system`,
`messages` of user and assistant turns with string or text-block content, `temperature`,
`top_p`, `stop_sequences`, `stream`), the answer (a `message` object, or the stream's
message_start, content_block_start, content_block_delta, content_block_stop,
message_delta and message_stop events) and Anthropic's error body
({"type": "error", "error": {"type", "message"}}). The conversation goes through the
model's chat template, exactly as OpenAI's chat completions do.
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

from msgspec import Meta, Struct

from p2pmesh.agent.http.bodies import ApiError, bad
from p2pmesh.agent.http.call import Call
from p2pmesh.agent.http.schema import (
    MESSAGES_MAX,
    STOP_SEQUENCES_MAX,
    ChatMessage,
    Conversation,
    MaxTokens,
    PromptText,
    StopText,
    TopP,
    decode,
    make_options,
    text_of,
)
from p2pmesh.agent.http.stream import Event, Outcome

# ------------------------------------------------------------------------------------
# The request

Role = Literal["user", "assistant"]


class TextBlock(Struct, frozen=True):
    type: Literal["text"]
    text: str


class Message(Struct, frozen=True):
    role: Role
    content: str | list[TextBlock]


class MessagesBody(Struct, frozen=True, kw_only=True):
    """POST /v1/messages. Unknown fields (metadata, cache_control, ...) are ignored."""

    model: str
    """Required, as Anthropic's API has it; accepted whatever it names (the cluster serves one model)."""
    max_tokens: MaxTokens
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MESSAGES_MAX)]
    system: PromptText | list[TextBlock] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    stop_sequences: Annotated[list[StopText], Meta(max_length=STOP_SEQUENCES_MAX)] | None = None
    stream: bool | None = None
    # Features this server does not have: refused when on.
    top_k: int | None = None
    tools: list[Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    """Its `effort` is ignored (a hint); its `format` (structured output) is refused."""


_FEATURES = ("top_k", "tools")
_WHY = {
    "messages": f'at most {MESSAGES_MAX} messages, each {{"role", "content"}}',
    "messages.role": f"one of {', '.join(get_args(Role))}",
    "messages.content": "a string or a list of text blocks",
    "messages.content.type": "only text blocks are supported",
    "system": "a string or a list of text blocks",
    "stop_sequences": f"at most {STOP_SEQUENCES_MAX} strings",
}


def parse_messages(raw: bytes) -> Conversation[MessagesBody]:
    body = decode(raw, MessagesBody, _WHY, _FEATURES)
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise bad("thinking is not supported by this server", "thinking")
    if body.output_config is not None and body.output_config.get("format") is not None:
        raise bad("output_config.format (structured output) is not supported by this server", "output_config.format")
    messages = [ChatMessage("system", text_of(body.system))] if body.system else []
    messages += [ChatMessage(m.role, text_of(m.content)) for m in body.messages]
    return Conversation(tuple(messages), body)


async def messages(call: Call) -> None:
    r = parse_messages(await call.body())
    b = r.body
    options = make_options(b.max_tokens, b.max_tokens, b.temperature, b.top_p, None, bool(b.stream), b.stop_sequences)
    model = call.serving_model()
    prompt = await call.chat_prompt(model, r.messages)
    await call.generate(prompt, options, MessageShape(model))


# ------------------------------------------------------------------------------------
# The answer and the errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error body; the type follows the status, as Anthropic's does."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


@dataclass(frozen=True, slots=True)
class MessageShape:
    """The `message` object and the Messages stream's events (a stream.Format)."""

    ndjson: ClassVar[bool] = False
    model: str
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))

    def error_body(self, exc: ApiError) -> Any:
        return error_body(exc)

    def whole(self, out: Outcome) -> dict[str, Any]:
        return self._message(out, [{"type": "text", "text": out.text}])

    def opening(self, out: Outcome) -> Iterable[Event]:
        yield "message_start", {"type": "message_start", "message": self._message(out, [])}
        yield "content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}

    def piece(self, text: str) -> Iterable[Event]:
        yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": text}}

    def closing(self, out: Outcome) -> Iterable[Event]:
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        yield "message_delta", {"type": "message_delta", "delta": _stop(out),
                                "usage": {"output_tokens": out.completion_tokens}}
        yield "message_stop", {"type": "message_stop"}

    def failure(self, exc: ApiError) -> Iterable[Event]:
        yield "error", error_body(exc)  # the anthropic client raises on an `error` event

    def _message(self, out: Outcome, content: list[dict[str, Any]]) -> dict[str, Any]:
        stop = _stop(out) if out.finish is not None else {"stop_reason": None, "stop_sequence": None}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **stop, "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens}}


def _stop(out: Outcome) -> dict[str, Any]:
    if out.finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if out.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}
