"""Chat on the client: messages -> a prompt rendered with the model's chat template (the
agent only generates from text or token ids). The tokenizer comes from the model's files on
this machine: its own directory, the agent's copy from another Mac, or for a Hugging Face
id its metadata (never its weights).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pmesh.agent import chat_template
from p2pmesh.client.errors import BadRequest, P2PMeshError


def check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise BadRequest("chat needs a non-empty list of messages such as {'role': 'user', 'content': 'hello'}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"chat message {i} must be a mapping with text 'role' and 'content'")
        out.append(dict(m))
    return tuple(out)


def fallback_chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt chat() sends for a model without a chat template: one "role: content"
    line per message, then "assistant:" for the model to continue."""
    return chat_template.fallback_prompt((m["role"], m["content"]) for m in check_messages(messages))


_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def model_directory(name: str, model_root: Path | None, state_dir: Path | None = None) -> Path:
    """The model's files on this machine, for its tokenizer and chat template: its own
    directory, the agent's copy of it from another Mac (in the agent's state directory),
    or, for a Hugging Face id, its metadata."""
    from p2pmesh.agent import models
    from p2pmesh.drivers import model_files

    local = models.located(name, model_root)
    try:
        return models.resolve(local, allow_download=False)
    except models.ModelError:
        pass
    if state_dir is not None and (models.copy_dir(state_dir, name) / "config.json").is_file():
        return models.copy_dir(state_dir, name)

    if not model_files.is_hub_id(name):
        raise P2PMeshError(f"chat needs the tokenizer of {name}, and there is no such directory on this machine; "
                           "run the client where the model's directory is, or render the prompt and call generate()")
    try:  # a Hugging Face id: fetch only the tokenizer and config files, never the weights
        return model_files.fetch_metadata(name)
    except model_files.ModelFilesError as exc:
        raise P2PMeshError(f"chat needs the tokenizer of {name}: {exc}; render the prompt yourself and call generate()") from None


def _tokenizer(directory: Path) -> Any:
    key = str(directory.resolve())
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            try:
                tok = _TOKENIZERS[key] = chat_template.load_tokenizer(directory)
            except ImportError as exc:
                raise P2PMeshError(str(exc)) from None
        return tok


def chat_prompt(name: str, messages: tuple[dict[str, Any], ...], model_root: Path | None,
                 state_dir: Path | None = None) -> dict[str, Any]:
    """The generate fields for a chat: token ids rendered by the model's chat template, or
    the fallback prompt as text when the model has none."""
    directory = model_directory(name, model_root, state_dir)
    if not chat_template.directory_has_template(directory):
        return {"prompt": fallback_chat_prompt(messages)}
    try:
        tokens = chat_template.render_tokens(_tokenizer(directory), messages)
    except chat_template.TemplateRefused as exc:
        raise BadRequest(f"{name}: {exc}") from None
    return {"prompt": None, "prompt_tokens": list(tokens)}

