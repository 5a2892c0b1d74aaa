"""The HTTP API's errors: `ApiError` (OpenAI's error body; each API's module renders it in
its own format) and the mapping of the agent's error codes to it."""
from __future__ import annotations

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
