"""Chat messages to a prompt: the model's own chat template when it has one, else a plain
fallback. Shared by the Python client's chat() and the HTTP API's /v1/chat/completions,
so both send the cluster exactly the same prompt for the same conversation.

A template's output is sent as token ids (templates write their own BOS; the head must not
add a second one, as it would for a text prompt). The fallback is sent as text.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class TemplateRefused(ValueError):
    """The model's chat template raised on this conversation (the caller's messages do not
    fit the template: e.g. roles out of order)."""


def fallback_prompt(turns: Iterable[tuple[str, str]]) -> str:
    """For a model without a chat template (a base model, the test models): one
    "role: content" line per (role, content) turn, then "assistant:" for the model to go on."""
    return "".join(f"{role}: {content}\n" for role, content in turns) + "assistant:"


def directory_has_template(directory: Path) -> bool:
    """True when the model's files carry a chat template (checked without loading a tokenizer,
    which needs transformers and takes seconds)."""
    if any((directory / name).is_file() for name in TEMPLATE_FILES):
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def tokenizer_has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def load_tokenizer(directory: Path) -> Any:
    """transformers' tokenizer for a model directory on this machine (never downloads).
    Raises ImportError with what to install when transformers is missing."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("rendering a model's chat template needs the transformers package "
                          "(pip install transformers)") from None
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def render_tokens(tokenizer: Any, conversation: Iterable[Mapping[str, Any]]) -> tuple[int, ...]:
    """The conversation through the tokenizer's chat template, as token ids, ending with the
    assistant's turn opened for generation. Not thread-safe: callers serialise calls on one
    tokenizer."""
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in conversation], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template raises what it likes; it means the messages do not fit it
        raise TemplateRefused(f"the model's chat template refused these messages: {exc}") from None
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
