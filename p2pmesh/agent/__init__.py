"""The agent (`p2pmesh agent`): the runtime that owns the core Machine, the ports its tasks get,
the tasks, and the HTTP API.

- runtime.py: the Agent (the loop: save, send, publish), run_agent, configure_logging
- config.py: AgentConfig, default_state_dir, DEFAULT_PORT
- ports.py: ClusterView (committed, durable state; ``await view.changed()``) and Inbox
- status.py: the `status` op's JSON
- models.py: finding, describing and keeping models on this Mac; chat_template.py
- tasks/: links, measure, fetch, peer copy, workers, pairing (each takes ports, not the Agent)
- http/: the OpenAI-compatible HTTP API

The names below are imported on first use (PEP 562): a worker process or the client that
imports a module of this package does not pay for the runtime (trio, TLS, zeroconf).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pmesh.agent.config import DEFAULT_PORT, AgentConfig, default_state_dir
    from p2pmesh.agent.runtime import Agent, configure_logging, run_agent

_FROM = {
    "AgentConfig": "config",
    "DEFAULT_PORT": "config",
    "default_state_dir": "config",
    "Agent": "runtime",
    "configure_logging": "runtime",
    "run_agent": "runtime",
}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pmesh.agent' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"p2pmesh.agent.{module}"), name)
    globals()[name] = value  # once only
    return value
