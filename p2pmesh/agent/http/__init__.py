"""The agent's OpenAI-compatible HTTP API (docs/http.md): `serve_http` and the names the CLI,
embedders and tests use. The modules: server.py (serving, routing, authentication, limits),
config.py (settings and start-up checks), schema.py (the request bodies' msgspec schemas),
bodies.py (OpenAI's error and response shapes), prompts.py (chat templates, token counts),
stream.py (one response, one generation), dashboard.py and watch_events.py (the dashboard
at / and its live feed, docs/dashboard.md)."""
from __future__ import annotations

from p2pmesh.agent.http.bodies import ApiError, api_error, generation_error
from p2pmesh.agent.http.config import (
    DEFAULT_HTTP_ADDRESS,
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    TOKEN_ENV,
    HttpBindError,
    HttpConfigError,
    HttpEndpoint,
    HttpLimits,
    InsecureBind,
    check_bind,
    endpoint,
    find_config_error,
    is_loopback,
    parse_address,
)
from p2pmesh.agent.http.prompts import Loaded, Prompt, Tokenizers, fallback_chat_prompt, render_chat
from p2pmesh.agent.http.schema import (
    CHAT_ROLES,
    PROMPT_TOKENS_MAX,
    SEED_LIMIT,
    TEMPERATURE_MAX,
    ChatMessage,
    Options,
    parse_chat,
    parse_completion,
)
from p2pmesh.agent.http.server import HttpApi, Service, serve_http
from p2pmesh.agent.http.stream import StopScanner

__all__ = [
    "CHAT_ROLES", "DEFAULT_HTTP_ADDRESS", "DEFAULT_HTTP_HOST", "DEFAULT_HTTP_PORT", "PROMPT_TOKENS_MAX", "SEED_LIMIT",
    "TEMPERATURE_MAX", "TOKEN_ENV", "ApiError", "ChatMessage", "HttpApi", "HttpBindError", "HttpConfigError",
    "HttpEndpoint", "HttpLimits", "InsecureBind", "Loaded", "Options", "Prompt", "Service", "StopScanner", "Tokenizers",
    "api_error", "check_bind", "endpoint", "fallback_chat_prompt", "find_config_error", "generation_error",
    "is_loopback", "parse_address", "parse_chat", "parse_completion", "render_chat", "serve_http",
]
