"""The request bodies of the two generation endpoints, as one msgspec schema each, and their
decoding into the values the server uses (Options, CompletionRequest, ChatRequest).

The schema says every field's type and bounds (the bounds are core/protocol.py's limits);
msgspec checks them while it parses, and its error names the field's path, which becomes the
400's `param` ("max_tokens", "messages[0].content[1].type"). What a schema cannot say stays
in code here, each as one named rule: a prompt list is one string or token ids
(`_one_prompt`), features this server lacks must be off (`refuse_unsupported`).

Unknown fields are ignored everywhere, as OpenAI clients send fields we do not use (user,
metadata, a message's name); only `response_format` forbids them, because anything beyond
{"type": "text"} would change the answer.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta, Struct

from p2pmesh.agent.http.bodies import ApiError, bad
from p2pmesh.core import protocol

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions."""
DEFAULT_CHAT_MAX_TOKENS = 1024
SEED_LIMIT = protocol.SEED_LIMIT
TEMPERATURE_MAX = protocol.TEMPERATURE_MAX
STOP_SEQUENCES_MAX = 4
STOP_CHARS_MAX = 256
MESSAGES_MAX = 4096
PROMPT_TOKENS_MAX = protocol.PROMPT_TOKENS_MAX
assert max(DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_CHAT_MAX_TOKENS) <= protocol.GENERATE_TOKENS_MAX


# ------------------------------------------------------------------------------------
# The values the server uses


@dataclass(frozen=True, slots=True)
class Options:
    """What both generation endpoints take besides the prompt."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str | None
    """The prompt as text, or None when the body gave token ids (``prompt_tokens``): one
    prompt per request, never a batch (``_one_prompt``)."""
    prompt_tokens: tuple[int, ...]
    options: Options


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    """One of CHAT_ROLES but "developer": parse_chat reads that one (OpenAI's newer name for
    the system role) as "system"."""
    content: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    options: Options


# ------------------------------------------------------------------------------------
# The schema (docs/http.md, "Requests")

MaxTokens = Annotated[int, Meta(ge=1, le=protocol.GENERATE_TOKENS_MAX)]
"""The protocol's cap (the agent's and the worker's), refused here with the field named."""
Temperature = Annotated[float, Meta(ge=0.0, le=TEMPERATURE_MAX)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=0, lt=SEED_LIMIT)]
StopText = Annotated[str, Meta(min_length=1, max_length=STOP_CHARS_MAX)]
Stop = StopText | Annotated[list[StopText], Meta(max_length=STOP_SEQUENCES_MAX)]
TokenId = Annotated[int, Meta(ge=0, lt=protocol.TOKEN_ID_LIMIT)]
PromptText = Annotated[str, Meta(max_length=protocol.PROMPT_CHARS_MAX)]
Prompt = PromptText | Annotated[list[PromptText | TokenId], Meta(min_length=1, max_length=PROMPT_TOKENS_MAX)]
"""A string, a list holding one string, or token ids (_one_prompt)."""
Role = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(Role)
OnlyOne = Annotated[int, Meta(ge=1, le=1)]
OnlyZero = Annotated[float, Meta(ge=0.0, le=0.0)]


class StreamOptions(Struct, frozen=True):
    include_usage: bool | None = None


class TextFormat(Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text"]


class TextPart(Struct, frozen=True):
    type: Literal["text"]
    text: str


class Message(Struct, frozen=True):
    role: Role
    content: str | list[TextPart] | None = None


class _Body(Struct, frozen=True, kw_only=True):
    """The fields both endpoints take."""

    model: str | None = None
    """Accepted whatever it says (the cluster serves one model); a string if given."""
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    # Features this server does not have: refused when they would change the answer.
    n: OnlyOne | None = None
    best_of: OnlyOne | None = None
    presence_penalty: OnlyZero | None = None
    frequency_penalty: OnlyZero | None = None
    response_format: TextFormat | None = None
    echo: bool | None = None
    logprobs: bool | int | None = None  # a bool for chat, a count for completions
    top_logprobs: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionBody(_Body, frozen=True, kw_only=True):
    """POST /v1/completions."""

    prompt: Prompt


class ChatBody(_Body, frozen=True, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Meta(min_length=1, max_length=MESSAGES_MAX)]
    max_completion_tokens: MaxTokens | None = None
    """Chat's newer name for max_tokens; it wins when both are given."""


_WHY = {
    "prompt": "a string, a list holding one string, or a list of token ids",
    "messages": f"at most {MESSAGES_MAX} messages, each {{\"role\", \"content\"}}",
    "messages.role": f"one of {', '.join(CHAT_ROLES)}",
    "messages.content": "a string or a list of text parts",
    "messages.content.type": "only text parts are supported",
    "n": "one choice per request",
    "best_of": "one choice per request",
    "presence_penalty": "only 0 is supported",
    "frequency_penalty": "only 0 is supported",
    "response_format": 'only {"type": "text"} is supported',
    "model": "the cluster serves one model; see GET /v1/models",
}
"""Why a field's bound is what it is, where msgspec's text alone does not say (keyed by the
path without indices; the nearest enclosing field's entry applies)."""

_OFF: tuple[Any, ...] = (None, False, 0, {}, [], "none")
_FEATURES = ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "functions", "tool_choice",
             "function_call")


# ------------------------------------------------------------------------------------
# Decoding (pure; every error names the field)

B = TypeVar("B", bound=Struct)


@dataclass(frozen=True, slots=True)
class Conversation(Generic[B]):
    """A chat-like request of any API: its messages as the chat template takes them, and its body."""

    messages: tuple[ChatMessage, ...]
    body: B


def decode(raw: bytes, schema: type[B], why: Mapping[str, str] | None = None, refuse: tuple[str, ...] = ()) -> B:
    """A request body -> its schema's Struct, or an ApiError 400 naming the field at fault
    (`why`: the schema's explanations, keyed as _WHY is; OpenAI's by default). `refuse`: the
    body's fields for features this server lacks (refuse_unsupported)."""
    body = _decode(raw, schema, why)
    refuse_unsupported(body, refuse)
    return body


def _decode(raw: bytes, schema: type[B], why: Mapping[str, str] | None) -> B:
    if not raw.strip():
        raise bad("the request needs a JSON object body")
    try:
        return msgspec.json.decode(_utf8(raw), type=schema)
    except msgspec.ValidationError as exc:  # a DecodeError too: first
        raise field_error(str(exc), _WHY if why is None else why) from None
    except msgspec.DecodeError as exc:
        raise bad(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses: a few thousand brackets are enough
        raise bad("the body is not valid JSON: it is nested too deeply") from None


def _utf8(raw: bytes) -> bytes | str:
    """The body as msgspec reads it. JSON is UTF-8 (RFC 8259), but the API has always taken
    what json.loads takes, a BOM and UTF-16/32 too: those are decoded here first."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise bad(f"the body is not valid JSON: {exc}") from None


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"^Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]*)`$")


def field_error(text: str, why: Mapping[str, str] = _WHY) -> ApiError:
    """msgspec's ValidationError text ("Expected `int` <= 8192 - at `$.max_tokens`") -> the
    400 with `param` set to the field's path ("max_tokens", "messages[0].role")."""
    m = _AT.match(text)
    assert m is not None  # the pattern matches any text
    detail, path = m["detail"], (m["path"] or "").removeprefix(".")
    named = _FIELD.match(detail)
    if named is not None:  # msgspec names the object; the field is the one at fault
        path = f"{path}.{named['name']}" if path else named["name"]
        detail = "is required" if named["what"] == "missing required" else "is not a field of this object"
        message = f"{path} {detail}"
    elif not path:
        # The body itself: the only thing a schema of an object can say about it.
        return bad("the body must be a JSON object" if detail.startswith("Expected `object`") else detail)
    else:
        message = f"{path}: {detail}"
    reason = _why(path, why)
    return bad(f"{message} ({reason})" if reason else message, path)


def _why(path: str, why: Mapping[str, str]) -> str | None:
    key = re.sub(r"\[[^\]]*\]", "", path)
    while key:
        if key in why:
            return why[key]
        key = key.rpartition(".")[0]
    return None


# ------------------------------------------------------------------------------------
# Schema -> values, with the rules a schema cannot say


def parse_completion(raw: bytes) -> CompletionRequest:
    """POST /v1/completions. `prompt`: a string, a list holding one string, or a list of token ids."""
    body = decode(raw, CompletionBody)
    text, tokens = _one_prompt(body.prompt)
    return CompletionRequest(text, tokens, _options(body, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS))


def parse_chat(raw: bytes) -> ChatRequest:
    """POST /v1/chat/completions: `messages` with text content."""
    body = decode(raw, ChatBody)
    messages = tuple(ChatMessage("system" if m.role == "developer" else m.role, text_of(m.content)) for m in body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return ChatRequest(messages, _options(body, max_tokens, DEFAULT_CHAT_MAX_TOKENS))


def _one_prompt(prompt: str | list[str | int]) -> tuple[str | None, tuple[int, ...]]:
    """Rule: one prompt per request. A list is either one string or token ids, not a batch
    of prompts and not a mix (the schema allows each element to be either)."""
    if isinstance(prompt, str):
        return prompt, ()
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], ()
    if all(isinstance(t, int) for t in prompt):
        return None, tuple(t for t in prompt if isinstance(t, int))
    raise bad("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")


def text_of(content: str | list[Any] | None) -> str:
    """A message's text: a string, or its text parts (any API's; each has `.text`) joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def refuse_unsupported(body: Struct, features: tuple[str, ...] = _FEATURES) -> None:
    """Rule: a feature this server lacks must be off (null, false, 0, empty, "none"; also
    "auto" for tool_choice), since honouring it would change the answer. Bounds the schema
    can say (n, best_of, the penalties, response_format) are in the schema."""
    for key in features:
        value = getattr(body, key)
        if value not in _OFF and not (key == "tool_choice" and value == "auto"):
            raise bad(f"{key} is not supported by this server", key)


def _options(body: _Body, max_tokens: int | None, default_max_tokens: int) -> Options:
    refuse_unsupported(body)
    return make_options(max_tokens, default_max_tokens, body.temperature, body.top_p, body.seed, bool(body.stream),
                        body.stop, include_usage=bool(body.stream_options and body.stream_options.include_usage))


def make_options(max_tokens: int | None, default_max_tokens: int, temperature: float | None, top_p: float | None,
                 seed: int | None, stream: bool, stop: str | list[str] | None = None, *,
                 include_usage: bool = False) -> Options:
    """Options from a body's (checked) fields, with the defaults every API shares."""
    return Options(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        # OpenAI's default is sampling without a fixed seed: draw one, so two unseeded requests differ.
        seed=secrets.randbelow(SEED_LIMIT) if seed is None else seed,
        stream=stream,
        include_usage=include_usage,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
    )
