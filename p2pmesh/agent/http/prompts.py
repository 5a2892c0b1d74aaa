"""Prompts for the chat endpoint: the model's chat template through transformers' tokenizer
(loaded once per model, in a thread), or the documented plain-text fallback; and prompt
token counts for usage."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent import chat_template, models
from p2pmesh.agent.http.bodies import bad
from p2pmesh.agent.http.schema import PROMPT_TOKENS_MAX, ChatMessage

log = logging.getLogger("p2pmesh.http")


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the agent is asked to continue: text (tokenized by the head, BOS added, exactly
    as `p2pmesh generate` does) or token ids (a rendered chat template, which carries its
    own special tokens). `count` is the number of prompt tokens when known (for usage)."""

    text: str | None
    tokens: tuple[int, ...] = ()
    count: int | None = None


# ------------------------------------------------------------------------------------
# Prompts: chat templates and token counts


def fallback_chat_prompt(messages: Iterable[ChatMessage]) -> str:
    """For a model without a chat template: see chat_template.fallback_prompt."""
    return chat_template.fallback_prompt((m.role, m.content) for m in messages)


@dataclass(slots=True)
class Loaded:
    tokenizer: Any | None
    """transformers' tokenizer, or None when the model's tokenizer cannot be loaded here."""
    loaded_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    """A tokenizer is not safe to share between threads; calls on it go one at a time."""

    @property
    def has_template(self) -> bool:
        return chat_template.tokenizer_has_template(self.tokenizer)


class Tokenizers:
    """The served model's tokenizer, loaded once per model name in a thread (transformers is
    slow to import and to load); two names at most, the cluster serves one model at a time."""

    CACHE_MAX = 2
    RETRY_FAILED_S = 60.0
    """A tokenizer that failed to load (offline, a partial download) is tried again after this."""

    def __init__(self, model_root: Path | None = None, state_dir: Path | None = None) -> None:
        self.model_root = model_root
        self.state_dir = state_dir
        """Where the agent keeps models copied from other Macs (models.copy_dir)."""
        self._cache: dict[str, Loaded] = {}
        self._lock = trio.Lock()

    async def get(self, name: str) -> Loaded:
        async with self._lock:  # one load at a time; concurrent requests wait for it
            loaded = self._cache.pop(name, None)
            if loaded is None or loaded.tokenizer is None and trio.current_time() - loaded.loaded_at > self.RETRY_FAILED_S:
                loaded = await trio.to_thread.run_sync(self._load, name)
                loaded.loaded_at = trio.current_time()
            while len(self._cache) >= self.CACHE_MAX:
                self._cache.pop(next(iter(self._cache)))  # the least recently used
            self._cache[name] = loaded
            return loaded

    def locate(self, name: str) -> str:
        """Where this Mac's workers load the model from: its own directory (relative names
        under --model-root), else its copy from the other Macs, else the name (a hub id)."""
        if self.state_dir is not None:
            return models.model_dir(name, self.model_root, self.state_dir)
        return models.located(name, self.model_root)

    def _load(self, name: str) -> Loaded:
        try:
            return Loaded(chat_template.load_tokenizer(models.resolve(self.locate(name))))
        except Exception as exc:  # noqa: BLE001 - any failure: serve without counts or templates
            log.warning("cannot load the tokenizer of %s (no chat template, no prompt token counts): %s", name, exc)
            return Loaded(None)

    async def count(self, model: str, text: str) -> int | None:
        """Prompt tokens as the head will count them (BOS added as the tokenizer does)."""
        loaded = await self.get(model)
        if loaded.tokenizer is None:
            return None

        def encode() -> int:
            with loaded.lock:
                return len(loaded.tokenizer.encode(text))

        return await trio.to_thread.run_sync(encode)

    async def chat_prompt(self, model: str, messages: tuple[ChatMessage, ...]) -> Prompt:
        loaded = await self.get(model)
        return await trio.to_thread.run_sync(render_chat, loaded, messages)


def render_chat(loaded: Loaded, messages: tuple[ChatMessage, ...]) -> Prompt:
    """The model's chat template when it has one (sent as token ids: the template writes its
    own BOS, the head must not add another), else the plain-text fallback (sent as text,
    tokenized by the head like any completion prompt)."""
    tok = loaded.tokenizer
    if not loaded.has_template:
        text = fallback_chat_prompt(messages)
        if tok is None:
            return Prompt(text)
        with loaded.lock:
            return Prompt(text, (), len(tok.encode(text)))
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    with loaded.lock:
        try:
            tokens = chat_template.render_tokens(tok, conversation)
        except chat_template.TemplateRefused as exc:
            raise bad(str(exc), "messages") from None
    if not tokens:
        raise bad("the chat template rendered an empty prompt", "messages")
    if len(tokens) > PROMPT_TOKENS_MAX:
        raise bad(f"the rendered prompt has {len(tokens)} tokens, more than {PROMPT_TOKENS_MAX}", "messages")
    return Prompt(None, tokens, len(tokens))
