"""Ollama's API: `POST /api/chat`, `POST /api/generate`, `GET /api/tags`, `POST /api/show`
and `GET /api/version` (docs/http.md, "Ollama").

Owns the requests' schemas (`ChatBody`, `GenerateBody`, `ShowBody`, their `options`), the
answers (one JSON object, or NDJSON lines ending with `done: true`, `done_reason`, token
counts and durations in nanoseconds), the served model's card (details from its config.json,
its chat template) and Ollama's error body ({"error": "..."}). Unlike the OpenAI and
Anthropic endpoints, a `model` other than the served one is a 404, as Ollama's own: Ollama
clients pick the model from /api/tags.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import trio
from msgspec import Meta, Struct

from p2pmesh.agent import models
from p2pmesh.agent.http.bodies import ApiError, bad
from p2pmesh.agent.http.call import Call
from p2pmesh.agent.http.schema import (
    DEFAULT_CHAT_MAX_TOKENS,
    MESSAGES_MAX,
    SEED_LIMIT,
    STOP_SEQUENCES_MAX,
    ChatMessage,
    Options,
    PromptText,
    StopText,
    Temperature,
    TopP,
    decode,
    make_options,
)
from p2pmesh.agent.http.stream import Event, Outcome
from p2pmesh.core import protocol
from p2pmesh.core.model_spec import text_config
from p2pmesh.drivers import model_files

OLLAMA_VERSION = "0.6.0"
"""The Ollama API version GET /api/version reports (the API this module follows)."""
TOKENIZER_CONFIG_BYTES_MAX = 16 << 20

# ------------------------------------------------------------------------------------
# The requests

Role = Literal["system", "user", "assistant", "tool"]
NumPredict = Annotated[int, Meta(ge=-2, le=protocol.GENERATE_TOKENS_MAX)]
"""Ollama's num_predict: -1 (no limit) and -2 (fill the context) mean the protocol's cap here."""


class ModelOptions(Struct, frozen=True):
    """The `options` this server honours; the others (num_ctx, num_thread, ...) are ignored,
    as Ollama ignores options a model does not use."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Annotated[int, Meta(ge=-1, lt=SEED_LIMIT)] | None = None
    num_predict: NumPredict | None = None
    stop: Annotated[list[StopText], Meta(max_length=STOP_SEQUENCES_MAX)] | None = None


class Message(Struct, frozen=True):
    role: Role
    content: PromptText = ""
    images: list[Any] | None = None


class _Body(Struct, frozen=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = True
    """Ollama streams unless told not to."""
    options: ModelOptions | None = None
    keep_alive: float | str | None = None
    """Accepted and ignored: the cluster keeps its model loaded."""
    # Features this server does not have: refused when on.
    format: str | dict[str, Any] | None = None
    tools: list[Any] | None = None
    think: bool | str | None = None


class ChatBody(_Body, frozen=True, kw_only=True):
    messages: Annotated[list[Message], Meta(max_length=MESSAGES_MAX)] | None = None


class GenerateBody(_Body, frozen=True, kw_only=True):
    prompt: PromptText | None = None
    system: PromptText | None = None
    raw: bool | None = None
    """The prompt as it is, without the chat template (Ollama's raw mode)."""
    images: list[Any] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class ShowBody(Struct, frozen=True):
    model: str | None = None
    name: str | None = None
    """The older name of `model`."""


_FEATURES = ("tools", "think", "images", "suffix", "template", "context")
_WHY = {
    "messages": f'at most {MESSAGES_MAX} messages, each {{"role", "content"}}',
    "messages.role": f"one of {', '.join(get_args(Role))}",
    "options.num_predict": f"-1, -2, or 1 to {protocol.GENERATE_TOKENS_MAX}",
    "options.seed": "-1 (random) or 0 to 2^31-1",
    "options.stop": f"at most {STOP_SEQUENCES_MAX} strings",
}


def _checked(raw: bytes, schema: type[ChatBody] | type[GenerateBody]) -> Any:
    body = decode(raw, schema, _WHY, tuple(f for f in _FEATURES if hasattr(schema, f)))
    if body.format not in (None, ""):
        raise bad("format (structured outputs) is not supported by this server", "format")
    if isinstance(body, ChatBody) and any(m.images for m in body.messages or ()):
        raise bad("images are not supported by this server", "messages")
    return body


def _options(body: _Body) -> Options:
    o = body.options or ModelOptions()
    if o.num_predict == 0:
        raise bad("options.num_predict: 0 would generate nothing (-1, -2, or 1 to "
                  f"{protocol.GENERATE_TOKENS_MAX})", "options.num_predict")
    limit = protocol.GENERATE_TOKENS_MAX if o.num_predict is not None and o.num_predict < 0 else o.num_predict
    seed = None if o.seed == -1 else o.seed
    return make_options(limit, DEFAULT_CHAT_MAX_TOKENS, o.temperature, o.top_p, seed, body.stream, o.stop)


# ------------------------------------------------------------------------------------
# The endpoints


async def chat(call: Call) -> None:
    body: ChatBody = _checked(await call.body(), ChatBody)
    options = _options(body)
    model = _served(call, body.model)
    if not body.messages:  # Ollama's way to load a model: answered at once
        await call.json({**_head(model), "message": {"role": "assistant", "content": ""}, "done": True,
                         "done_reason": "load"})
        return
    prompt = await call.chat_prompt(model, tuple(ChatMessage(m.role, m.content) for m in body.messages))
    await call.generate(prompt, options, OllamaShape(model, chat=True))


async def generate(call: Call) -> None:
    body: GenerateBody = _checked(await call.body(), GenerateBody)
    options = _options(body)
    model = _served(call, body.model)
    if not body.prompt:
        await call.json({**_head(model), "response": "", "done": True, "done_reason": "load"})
        return
    if body.raw:
        prompt = await call.text_prompt(model, body.prompt)
    else:  # the prompt as the user's turn of the model's chat template, as Ollama does
        system = [ChatMessage("system", body.system)] if body.system else []
        prompt = await call.chat_prompt(model, (*system, ChatMessage("user", body.prompt)))
    await call.generate(prompt, options, OllamaShape(model, chat=False))


async def tags(call: Call) -> None:
    name = call.placement().get("model")
    listed = []
    if name is not None:
        card = await _card(call, str(name))
        listed.append({"name": name, "model": name, "modified_at": card.modified_at, "size": card.size,
                       "digest": card.digest, "details": card.details})
    await call.json({"models": listed})


async def show(call: Call) -> None:
    body = decode(await call.body(), ShowBody, _WHY)
    asked = body.model or body.name
    if not asked:
        raise bad("model is required", "model")
    name = _known(call, asked)
    card = await _card(call, name)
    await call.json({"modelfile": "", "parameters": "", "template": card.template, "details": card.details,
                     "model_info": card.model_info, "capabilities": ["completion"], "modified_at": card.modified_at})


async def version(call: Call) -> None:
    await call.json({"version": OLLAMA_VERSION})


def _known(call: Call, asked: str) -> str:
    """The cluster's model when `asked` names it (a `:latest` tag allowed), else Ollama's 404."""
    name = call.placement().get("model")
    if name is None or asked not in (name, f"{name}:latest"):
        raise ApiError(404, f"model '{asked}' not found (this cluster serves {name or 'no model'})",
                       code="model_not_found")
    return str(name)


def _served(call: Call, asked: str) -> str:
    _known(call, asked)
    return call.serving_model()


# ------------------------------------------------------------------------------------
# The answers


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": exc.message}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": _now()}


@dataclass(frozen=True, slots=True)
class OllamaShape:
    """/api/chat's and /api/generate's objects, whole or as NDJSON lines (a stream.Format)."""

    ndjson: ClassVar[bool] = True
    model: str
    chat: bool

    def error_body(self, exc: ApiError) -> Any:
        return error_body(exc)

    def whole(self, out: Outcome) -> dict[str, Any]:
        return {**_head(self.model), **self._text(out.text), "done": True, **_final(out)}

    def opening(self, out: Outcome) -> Iterable[Event]:
        return ()

    def piece(self, text: str) -> Iterable[Event]:
        yield None, {**_head(self.model), **self._text(text), "done": False}

    def closing(self, out: Outcome) -> Iterable[Event]:
        yield None, {**_head(self.model), **self._text(""), "done": True, **_final(out)}

    def failure(self, exc: ApiError) -> Iterable[Event]:
        yield None, error_body(exc)  # the ollama client raises ResponseError on a line with "error"

    def _text(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}} if self.chat else {"response": text}


def _final(out: Outcome) -> dict[str, Any]:
    """The last object's counts and durations (ns): the prompt's evaluation is the time to
    the first token, the generation's the rest."""
    ns = 1_000_000_000
    first = out.elapsed_s if out.ttft_s is None else out.ttft_s
    return {"done_reason": out.finish, "total_duration": int(out.elapsed_s * ns), "load_duration": 0,
            "prompt_eval_count": out.prompt_tokens, "prompt_eval_duration": int(first * ns),
            "eval_count": out.completion_tokens, "eval_duration": int((out.elapsed_s - first) * ns)}


# ------------------------------------------------------------------------------------
# The model's card


@dataclass(frozen=True, slots=True)
class Card:
    size: int
    digest: str
    modified_at: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str


async def _card(call: Call, name: str) -> Card:
    return await trio.to_thread.run_sync(_read_card, call.tokenizers.locate(name))


def _read_card(local: str) -> Card:
    """What /api/tags and /api/show say of the model, from its directory on this Mac (what
    it cannot read stays empty: a hub model whose files are elsewhere)."""
    try:
        directory = models.resolve(local, allow_download=False)
        config = text_config(models.read_config(directory))
        raw = (directory / "config.json").read_bytes()
        modified = datetime.fromtimestamp((directory / "config.json").stat().st_mtime, timezone.utc)
    except (models.ModelError, OSError):
        return Card(0, "", _now(), {"format": "safetensors"}, {}, "")
    arch = str(config.get("model_type") or "unknown")
    keys = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "vocab_size": "vocab_size"}
    info: dict[str, Any] = {"general.architecture": arch}
    info.update({f"{arch}.{k}": config[v] for k, v in keys.items() if v in config})
    details = {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
               "quantization_level": _quantization(config)}
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors") if p.exists())
    return Card(size, hashlib.sha256(raw).hexdigest(), modified.isoformat().replace("+00:00", "Z"), details, info,
                _template(directory))


def _quantization(config: Any) -> str:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and isinstance(q.get("bits"), int):
        return f"Q{q['bits']}"
    dtype = str(config.get("torch_dtype") or "")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())


def _template(directory: Path) -> str:
    try:
        cfg = model_files.read_json(directory / "tokenizer_config.json", TOKENIZER_CONFIG_BYTES_MAX)
    except model_files.ModelFilesError:
        return ""
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), "")
    return template if isinstance(template, str) else ""
