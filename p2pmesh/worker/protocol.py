"""The JSON-lines protocol between the agent and a worker process (no MLX here).

Owns the commands the agent writes to rank 0's stdin, their validation and limits, and
the events every rank writes to stdout. Pure: the agent may import it to build commands
and parse events with the same definitions. docs/inference.md has the full contract.

stdout (one JSON object per line, every rank):
  {"event": "ready", "rank": r, "layers": [s, e], "load_s": t}
  {"event": "heartbeat", "rank": r, "t": unix_seconds}            every 0.5 s, from a thread;
                                 rank 0's also has "running", "queued" (requests in its batch
                                 and waiting for a place) and "tokens" (generated since it started)
  {"event": "error", "id": id?, "code": c, "message": m}           "id" only for a request's error
rank 0 only:
  {"event": "token", "id": id, "token": int, "text": "incremental text"}   the first also has
                                                               "prompt_tokens": [int]
  {"event": "done", "id": id, "tokens": n, "finish": "stop"|"length"|"cancelled", "text": "held-back text"}
stdin (rank 0 only), read by a thread while the batch runs:
  {"op": "generate", "id": str, "prompt": str|null, "prompt_tokens": [int]|null,
   "max_tokens": n, "temperature": t, "top_p": p, "seed": s}
  {"op": "cancel", "id": str}                                       frees the request's slot at once
  {"op": "shutdown"}                                                also: EOF on stdin
Requests run concurrently (continuous batching, worker/scheduler.py): events of different
ids interleave, each request's own events stay in order.

An error's "code" says whose fault it is, so the agent never reads the English message:
  request_invalid   this request is wrong (bad fields, empty or too long prompt, a token
                    outside the vocabulary): it is refused for good, the worker serves on;
  command_invalid   a line that is not a command (no id could be read): the worker serves on;
  busy              the batch and the queue are full: this request is refused now (not for
                    good: it may be sent again later), the worker serves on;
  pipeline_broken   the epoch's pipeline failed (a peer lost, the stages out of sync); with
                    "id" the request it was running: not the request's fault, the worker exits 1;
  unusable          the arguments, the environment or the model (exit 2).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from p2pmesh.core import protocol as limits_

MAX_LINE_BYTES = 4 << 20
"""A command line longer than this is refused (and skipped up to its newline)."""
# The generation limits are the control protocol's (core/protocol.py), re-checked here with
# the very constants the agent validated at the edge.
MAX_PROMPT_TOKENS = limits_.PROMPT_TOKENS_MAX
MAX_TOKENS_CAP = limits_.GENERATE_TOKENS_MAX
MAX_ID_CHARS = 256
SEED_LIMIT = limits_.SEED_LIMIT
DEFAULT_MAX_TOKENS = limits_.GENERATE_TOKENS_DEFAULT

# The error codes are defined in core/protocol.py, where the agent's supervisor reads them.
REQUEST_INVALID = limits_.WORKER_REQUEST_INVALID
COMMAND_INVALID = limits_.WORKER_COMMAND_INVALID
PIPELINE_BROKEN = limits_.WORKER_PIPELINE_BROKEN
UNUSABLE = limits_.WORKER_UNUSABLE
BUSY = limits_.WORKER_BUSY
ERROR_CODES = (REQUEST_INVALID, COMMAND_INVALID, PIPELINE_BROKEN, UNUSABLE, BUSY)
FINISH_CANCELLED = "cancelled"


class CommandError(ValueError):
    """A command line the agent wrote is malformed or out of bounds: the agent's fault.
    `request_id` is the command's id when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class Limits:
    max_line_bytes: int = MAX_LINE_BYTES
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_tokens_cap: int = MAX_TOKENS_CAP


@dataclass(frozen=True, slots=True)
class Generate:
    """A generation request. Exactly one of prompt (text, tokenized by rank 0) and
    prompt_tokens (used as is) is set; prompt_tokens wins when both are given."""

    id: str
    prompt: str | None
    prompt_tokens: tuple[int, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """End a running or queued request now (an unknown or finished id is ignored: the
    request may have ended while the command was on its way)."""

    id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = Generate | Cancel | Shutdown


def parse_command(line: bytes | str, limits: Limits = Limits()) -> Command:
    """One stdin line as a command; CommandError (with the id when known) otherwise."""
    if len(line) > limits.max_line_bytes:
        raise CommandError(f"command line of {len(line)} bytes exceeds {limits.max_line_bytes}")
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise CommandError(f"command is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CommandError("command is not a JSON object")
    rid = obj.get("id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None
    op = obj.get("op")
    if op == "shutdown":
        return Shutdown()
    if op == "cancel":
        if rid is None:
            raise CommandError(f"cancel needs an \"id\": a string of 1..{MAX_ID_CHARS} characters")
        return Cancel(rid)
    if op != "generate":
        raise CommandError(f"unknown op {op!r} (expected \"generate\", \"cancel\" or \"shutdown\")", rid)
    if rid is None:
        raise CommandError(f"generate needs an \"id\": a string of 1..{MAX_ID_CHARS} characters")
    prompt, tokens = obj.get("prompt"), obj.get("prompt_tokens")
    if tokens is not None:
        if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < limits_.TOKEN_ID_LIMIT for t in tokens):
            raise CommandError(f"prompt_tokens must be a list of non-negative integers below {limits_.TOKEN_ID_LIMIT}", rid)
        if len(tokens) > limits.max_prompt_tokens:
            raise CommandError(f"prompt_tokens has {len(tokens)} tokens, more than {limits.max_prompt_tokens}", rid)
        prompt = None
    elif not isinstance(prompt, str):
        raise CommandError("generate needs \"prompt\" (a string) or \"prompt_tokens\" (a list of ints)", rid)
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_tokens_cap:
        raise CommandError(f"max_tokens must be an integer in 1..{limits.max_tokens_cap}", rid)
    temperature, top_p = obj.get("temperature", 0.0), obj.get("top_p", 1.0)
    if not _is_number(temperature) or not (math.isfinite(temperature) and 0 <= temperature <= limits_.TEMPERATURE_MAX):
        raise CommandError(f"temperature must be a number in [0, {limits_.TEMPERATURE_MAX:g}]", rid)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise CommandError("top_p must be a number in (0, 1]", rid)
    seed = obj.get("seed", 0)
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise CommandError(f"seed must be an integer in [0, {SEED_LIMIT})", rid)
    return Generate(rid, prompt, tuple(tokens) if tokens is not None else None, max_tokens, float(temperature), float(top_p), seed)


_is_int = limits_.is_int
_is_number = limits_.is_number


@dataclass(frozen=True, slots=True)
class Load:
    """Rank 0's batch as its heartbeat reports it."""

    running: int = 0
    queued: int = 0
    tokens: int = 0
    """Tokens generated since the worker started (a counter: the agent takes rates from it)."""


# Events. Plain dicts: the writer adds nothing but a newline.

def ready(rank: int, layers: tuple[int, int], load_s: float) -> dict[str, Any]:
    return {"event": "ready", "rank": rank, "layers": list(layers), "load_s": round(load_s, 3)}


def heartbeat(rank: int, t: float, load: Load | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"event": "heartbeat", "rank": rank, "t": round(t, 3)}
    if load is not None:
        event.update(running=load.running, queued=load.queued, tokens=load.tokens)
    return event


def token(request_id: str, token_id: int, text: str, prompt_tokens: list[int] | None = None) -> dict[str, Any]:
    """A generated token. The first one of a request also carries the prompt as tokens, so
    the agent can resume the request elsewhere without a tokenizer of its own."""
    event: dict[str, Any] = {"event": "token", "id": request_id, "token": token_id, "text": text}
    if prompt_tokens is not None:
        event["prompt_tokens"] = prompt_tokens
    return event


def done(request_id: str, tokens: int, finish: str, text: str) -> dict[str, Any]:
    return {"event": "done", "id": request_id, "tokens": tokens, "finish": finish, "text": text}


def error(code: str, message: str, request_id: str | None = None, fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """An error event; ``code`` is one of ERROR_CODES (the module comment says which when).
    ``fault`` (a worker that could not form its group) says why in machine terms:
    {"code", "rank" (the rank at fault), "address", "port"} (worker/ring_check.py)."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    event: dict[str, Any] = {"event": "error", **({"id": request_id} if request_id is not None else {}), "code": code, "message": message}
    if fault is not None:
        event["fault"] = fault
    return event
