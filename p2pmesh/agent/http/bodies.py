"""OpenAI's body shapes besides the requests (schema.py has those): the error body, the
mapping of the agent's error codes to it, and the response objects (whole and streamed)."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from p2pmesh.core import protocol
from p2pmesh.core.errors import MeshError


class ApiError(MeshError):
    """A request that ends in an OpenAI-style error body. 4xx: the client's fault (`param`
    names the field); 5xx: the cluster's (no model serving, a generation failed)."""

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

