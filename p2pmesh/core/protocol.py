"""The control protocol's contract, in one place: the error codes, the HTTP status and the
typed client error each one maps to, and the limits of a generation that the agent, the
worker, the HTTP API and the client share.

Every error the agent answers on its control socket carries a machine-readable ``code``
beside its English ``error`` text: ``{"ok": false, "code": "not_serving", "error": "..."}``.
Programs decide on the code, never on the text (the text is for people and may change).
An answer with no code (an agent from before codes) or with a code this version does not
know (a newer agent) reads as ``agent_error``: a clear, generic failure.

The limits are validated once, at the edge (the agent's control socket and the HTTP API);
the worker re-checks the same constants, so a request the edge accepts is never refused
deeper in for a bound it did not know. Their relations with the wire codec's own bounds
are asserted below, at import.

Pure: no I/O. The typed errors live here (not in p2pmesh/client) because this table names
them; the client re-exports them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from p2pmesh.core import fit, wire
from p2pmesh.core.errors import MeshError
from p2pmesh.core.fit import PlacementProblem

# ----------------------------------------------------------------------------------------
# Limits of a generation (named qualifier-last: *_MAX inclusive, *_LIMIT exclusive)

GENERATE_TOKENS_MAX = 8192
"""max_tokens: the most tokens one request may ask for."""
GENERATE_TOKENS_DEFAULT = 256
"""max_tokens when the control request does not say (the HTTP API has OpenAI's defaults)."""
PROMPT_TOKENS_MAX = 32768
"""A prompt's tokens, given as ids or counted by the head worker after tokenizing text."""
PROMPT_CHARS_MAX = 1 << 20
"""A text prompt, before tokenizing (bounds what the agent holds and forwards)."""
TOKEN_ID_LIMIT = 1 << 31
"""Token ids are in [0, TOKEN_ID_LIMIT) (a model's vocabulary is far smaller)."""
SEED_LIMIT = 1 << 31
"""Seeds are in [0, SEED_LIMIT)."""
TEMPERATURE_MAX = 10.0
"""temperature is in [0, TEMPERATURE_MAX]; top_p is in (0, 1]."""
CONTEXT_TOKENS_MAX = 1 << 22
"""The model op's context_tokens is in [1, CONTEXT_TOKENS_MAX]."""
CONTEXT_TOKENS_DEFAULT = 4096
BATCH_REQUESTS_DEFAULT = 8
"""Requests a head worker serves at once (continuous batching, core/batching.py)."""
BATCH_REQUESTS_MAX = 256
QUEUE_REQUESTS_DEFAULT = 64
"""Requests a head worker holds waiting for a batch slot; beyond them it answers busy."""
QUEUE_REQUESTS_MAX = 4096
KV_BITS_CHOICES = (4, 8)
"""load's kv_bits: the KV cache quantized to 4 or 8 bits (mlx-lm's QuantizedKVCache); absent
(0 in a ModelInfo) is full precision."""

# A resumed request (core/serving.py) travels in one InferRequest as its prompt plus every
# token generated so far: that sequence must fit the wire codec's bound.
assert PROMPT_TOKENS_MAX + GENERATE_TOKENS_MAX <= wire.SEQ_LEN_MAX
# Seeds and token ids cross the wire as signed 64-bit integers.
assert SEED_LIMIT - 1 <= wire.INT_MAX and TOKEN_ID_LIMIT - 1 <= wire.INT_MAX
assert 1 <= GENERATE_TOKENS_DEFAULT <= GENERATE_TOKENS_MAX <= CONTEXT_TOKENS_MAX
assert 1 <= CONTEXT_TOKENS_DEFAULT <= CONTEXT_TOKENS_MAX
assert PROMPT_TOKENS_MAX <= PROMPT_CHARS_MAX
assert 1 <= BATCH_REQUESTS_DEFAULT <= BATCH_REQUESTS_MAX and 0 <= QUEUE_REQUESTS_DEFAULT <= QUEUE_REQUESTS_MAX


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------------
# Typed errors (the client raises them; p2pmesh.client re-exports them)


class BadRequest(MeshError):
    """The agent refused the request's arguments (the caller's to fix: the message says how)."""


class NoQuorum(MeshError):
    """The agent has no working cluster (no leader it can hear) and did not get one within
    the timeout. The network's or the cluster's state, not the caller's: retry later."""


class ModelNotLoaded(MeshError):
    """The cluster serves no model (or not yet the one asked for). Load one first."""


class ModelRefused(ModelNotLoaded):
    """The cluster's verdict on the model (core/fit.py): it will not serve it as things
    stand. ``code`` is machine-readable, ``problem`` has the numbers; the message says why."""

    code = ""

    def __init__(self, problem: PlacementProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class ModelDoesNotFit(ModelRefused):
    """The members' memory cannot hold the model with its KV cache (the cluster's state: a
    shorter context, another Mac or smaller weights). A Mac that joins and makes it fit
    starts the placement by itself."""

    code = fit.DOES_NOT_FIT


class ModelCannotLoad(ModelRefused):
    """No member can load the model at all (a family the workers do not run, a broken
    checkpoint): the model's fault; the message has the members' own errors."""

    code = fit.CANNOT_LOAD


def refused(problem: PlacementProblem) -> ModelRefused:
    """The typed error for the cluster's verdict on its model."""
    return (ModelCannotLoad if problem.code == fit.CANNOT_LOAD else ModelDoesNotFit)(problem)


class AgentError(MeshError):
    """The agent failed, stopped answering, or said something this client cannot read
    (the agent's or the data plane's fault; a version mismatch also lands here)."""


class Busy(AgentError):
    """Too many requests in flight (the agent's, the cluster's request table, or the head
    worker's batch and queue): nothing is wrong, retry shortly (HTTP 429 with Retry-After)."""


# ----------------------------------------------------------------------------------------
# Error codes


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"
    """The request's fields are wrong (named in the text; ``param`` names the field)."""
    UNKNOWN_OP = "unknown_op"
    """The agent has no such op: the client and the agent are different versions."""
    MODEL_INVALID = "model_invalid"
    """The model op's model cannot be used: not found, unreadable, not a model we run."""
    PROMPT_REFUSED = "prompt_refused"
    """The head worker refused the prompt: empty, longer than the model's context or
    PROMPT_TOKENS_MAX, a token outside the vocabulary. The request's fault, for good."""
    NO_CLUSTER = "no_cluster"
    """This agent is not in a cluster yet (starting, or forming one)."""
    NO_QUORUM = "no_quorum"
    """No leader confirmed a read in time (an election, a partition): retry."""
    RETRY = "retry"
    """The agent moved to another cluster or log under the request: retry."""
    BUSY = "busy"
    """Too many requests in flight (this agent's reads, the cluster's request table, the
    head's): retry shortly."""
    NOT_SERVING = "not_serving"
    """No serving epoch: the model is not placed (yet) or a stage's Mac is down."""
    STALLED = "stalled"
    """The serving epoch made no progress on the request for core/serving.STALL_MS."""
    STALE_EPOCH = "stale_epoch"
    """Between agents only: the head's epoch is over for this request; the origin sends it
    again to the next head (core/serving.py). A client never sees it."""
    CLIENT_TOO_SLOW = "client_too_slow"
    """The client read the stream too slowly and the agent dropped it."""
    AGENT_ERROR = "agent_error"
    """Anything else, and the fallback for an answer with no code or an unknown one."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """What a code means to each side of the protocol."""

    http_status: int
    error: type[MeshError]
    """The exception the client raises."""
    http_code: str | None = None
    """The ``code`` of the HTTP API's OpenAI-style error body (its contract, docs/http.md)."""
    retry_after_s: int | None = None
    """The HTTP API's Retry-After header, when retrying soon can help."""
    param: str | None = None
    """The request field at fault, when the code alone says which."""


ERRORS: Mapping[ErrorCode, ErrorSpec] = MappingProxyType({
    ErrorCode.BAD_REQUEST: ErrorSpec(400, BadRequest),
    ErrorCode.UNKNOWN_OP: ErrorSpec(400, AgentError),
    ErrorCode.MODEL_INVALID: ErrorSpec(400, BadRequest, param="model"),
    ErrorCode.PROMPT_REFUSED: ErrorSpec(400, BadRequest, param="prompt"),
    ErrorCode.NO_CLUSTER: ErrorSpec(503, NoQuorum, "no_cluster", 2),
    ErrorCode.NO_QUORUM: ErrorSpec(503, NoQuorum, "no_quorum", 2),
    ErrorCode.RETRY: ErrorSpec(503, AgentError, "retry", 1),
    ErrorCode.BUSY: ErrorSpec(429, Busy, "too_many_requests", 1),
    ErrorCode.NOT_SERVING: ErrorSpec(503, ModelNotLoaded, "model_not_serving", 2),
    ErrorCode.STALLED: ErrorSpec(503, AgentError, "model_not_serving", 2),
    ErrorCode.STALE_EPOCH: ErrorSpec(503, AgentError, "model_not_serving", 2),
    ErrorCode.CLIENT_TOO_SLOW: ErrorSpec(500, AgentError),
    ErrorCode.AGENT_ERROR: ErrorSpec(500, AgentError),
})
assert set(ERRORS) == set(ErrorCode), "every code has its HTTP status and client error"


def code_of(answer: Mapping[str, Any]) -> ErrorCode:
    """The code of an error answer or event; AGENT_ERROR when it has none or an unknown one."""
    try:
        return ErrorCode(answer.get("code"))
    except ValueError:
        return ErrorCode.AGENT_ERROR


def error_answer(code: ErrorCode, message: str, **fields: Any) -> dict[str, Any]:
    """An error answer on the control socket: the code for programs, the text for people."""
    return {"ok": False, "code": code.value, "error": message, **fields}


def client_error(code: ErrorCode, message: str) -> MeshError:
    """The typed client error for a code (its ``error_code`` says which code it came from)."""
    exc = ERRORS[code].error(message)
    exc.error_code = code.value
    return exc


class RequestInvalid(ValueError):
    """A request field out of its limits (the caller's fault); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------------------
# The worker's error codes (worker/protocol.py documents them; the agent's supervisor,
# core/supervision.py, decides on them, so they live where both may import them)

WORKER_REQUEST_INVALID = "request_invalid"
WORKER_COMMAND_INVALID = "command_invalid"
WORKER_PIPELINE_BROKEN = "pipeline_broken"
WORKER_UNUSABLE = "unusable"
WORKER_BUSY = "busy"
