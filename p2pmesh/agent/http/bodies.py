"""OpenAI's body shapes: the requests the two generation endpoints take (validated, every
error naming its field), the error body, and the response objects (whole and streamed)."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from p2pmesh.core import protocol
from p2pmesh.core.errors import MeshError

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
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(MeshError):
    """A request that ends in an OpenAI-style error body. 4xx: the client's fault (says
    which field); 5xx: the cluster's (no model serving, a generation failed)."""

    def __init__(self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
                 code: str | None = None, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


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
    prompt_tokens: tuple[int, ...]
    options: Options


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    options: Options



# ------------------------------------------------------------------------------------
# Request validation (pure; every error names the field)


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise bad(f"{key} must be an integer from {low} to {high}, got {v!r}", key)
    return v


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (low < v if open_low else low <= v) or not v <= high:
        interval = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise bad(f"{key} must be a number in {interval}, got {v!r}", key)
    return float(v)


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


def _unsupported(body: dict[str, Any]) -> None:
    """Refuse what would silently change the answer; ignore what cannot (user, metadata...)."""
    if body.get("n", 1) not in (1, None):
        raise bad("n must be 1: one choice per request", "n")
    if body.get("best_of", 1) not in (1, None):
        raise bad("best_of must be 1", "best_of")
    for key in ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "functions", "tool_choice",
                "function_call"):
        if body.get(key) not in (None, False, 0, {}, [], "none") and not (key == "tool_choice" and body.get(key) == "auto"):
            raise bad(f"{key} is not supported by this server", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"{key} is not supported (only 0)", key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string (the cluster serves one model; see GET /v1/models)", "model")


def _options(body: dict[str, Any], default_max_tokens: int, chat: bool) -> Options:
    _unsupported(body)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # The protocol's cap (the agent's and the worker's): a 400 naming the field, here.
    max_tokens = _int(body, key, default_max_tokens, 1, protocol.GENERATE_TOKENS_MAX)
    temperature = _number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    # OpenAI's default is sampling without a fixed seed: draw one, so two unseeded requests differ.
    seed = _int(body, "seed", secrets.randbelow(SEED_LIMIT), 0, SEED_LIMIT - 1)
    stream = _bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options must be an object", "stream_options")
        include_usage = _bool(so, "include_usage")
    stop_raw = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop_raw, str):
        stops = (stop_raw,)
    elif isinstance(stop_raw, list):
        stops = tuple(stop_raw)
    elif stop_raw is not None:
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > STOP_SEQUENCES_MAX or not all(isinstance(s, str) and 0 < len(s) <= STOP_CHARS_MAX for s in stops):
        raise bad(f"stop must be at most {STOP_SEQUENCES_MAX} non-empty strings of at most {STOP_CHARS_MAX} characters", "stop")
    return Options(max_tokens, temperature, top_p, seed, stream, include_usage, stops)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """POST /v1/completions. `prompt`: a string, a list holding one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return CompletionRequest(prompt, (), _options(body, DEFAULT_COMPLETION_MAX_TOKENS, False))
    if (isinstance(prompt, list) and 0 < len(prompt) <= PROMPT_TOKENS_MAX
            and all(protocol.is_int(t) and 0 <= t < protocol.TOKEN_ID_LIMIT for t in prompt)):
        return CompletionRequest(None, tuple(prompt), _options(body, DEFAULT_COMPLETION_MAX_TOKENS, False))
    if prompt is None:
        raise bad("prompt is required (a string)", "prompt")
    raise bad("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    """POST /v1/chat/completions: `messages` with text content."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages is required: a non-empty list of {\"role\", \"content\"} objects", "messages")
    if len(raw) > MESSAGES_MAX:
        raise bad(f"messages holds more than {MESSAGES_MAX} messages", "messages")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        messages.append(ChatMessage("system" if role == "developer" else role, _content(m.get("content"), where)))
    return ChatRequest(tuple(messages), _options(body, DEFAULT_CHAT_MAX_TOKENS, True))


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def generation_error(event: dict[str, Any]) -> ApiError | None:
    """The agent's generate events -> an HTTP error when the event is one, decided by the
    event's code (core/protocol.py), never by its text. An event with no code (an older
    agent) is a 500: the generic code's status."""
    if event.get("ok", True) and event.get("finish") != "error":
        return None
    message = str(event.get("error") or event.get("text") or "the generation failed")
    param = event.get("param")
    return api_error(protocol.code_of(event), message, param if isinstance(param, str) else None)


def api_error(code: protocol.ErrorCode, message: str, param: str | None = None) -> ApiError:
    """The HTTP error for an agent's error code: core/protocol.ERRORS has its status, the
    OpenAI-style body code and whether to retry."""
    spec = protocol.ERRORS[code]
    if spec.http_status >= 500 and spec.retry_after_s is None:
        message = f"the generation failed: {message}"
    headers = (("retry-after", str(spec.retry_after_s)),) if spec.retry_after_s is not None else ()
    return ApiError(spec.http_status, message, param=param or spec.param, code=spec.http_code, headers=headers)


# ------------------------------------------------------------------------------------
# Responses: OpenAI's shapes


@dataclass(frozen=True, slots=True)
class Shape:
    """OpenAI's objects for one endpoint: "text_completion" or "chat.completion"."""

    kind: str
    model: str = ""
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def with_model(self, model: str) -> Shape:
        return Shape(self.kind, model, self.id, self.created)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _head(self, stream: bool) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        obj = self.kind + ".chunk" if self.chat and stream else self.kind
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": usage}

    def role_chunk(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return {**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}

    def chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

