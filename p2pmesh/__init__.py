"""p2pmesh: one AI computer from several Macs cabled with Thunderbolt.

The public API is declared here; everything else is private. See docs/client.md.

The names come from p2pmesh.client, imported on first use (PEP 562): `python -m p2pmesh`
and every worker process import this package, and they need none of it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentError",
    "AgentNotRunning",
    "AsyncClient",
    "AsyncGeneration",
    "BadRequest",
    "Busy",
    "Client",
    "Event",
    "EventKind",
    "Generation",
    "GenerationResult",
    "Hop",
    "LoadProgress",
    "LoadedModel",
    "Member",
    "ModelCannotLoad",
    "ModelDoesNotFit",
    "ModelInfo",
    "ModelNotLoaded",
    "ModelRefused",
    "NoQuorum",
    "P2PMeshError",
    "PendingPlacement",
    "Placement",
    "PlacementProblem",
    "Port",
    "Ring",
    "StageInfo",
    "Status",
    "__version__",
    "connect",
    "fallback_chat_prompt",
    "open_client",
]

if TYPE_CHECKING:
    from p2pmesh.client import (
        Agent,
        AgentError,
        AgentNotRunning,
        AsyncClient,
        AsyncGeneration,
        BadRequest,
        Busy,
        Client,
        Event,
        EventKind,
        Generation,
        GenerationResult,
        Hop,
        LoadedModel,
        LoadProgress,
        Member,
        ModelCannotLoad,
        ModelDoesNotFit,
        ModelInfo,
        ModelNotLoaded,
        ModelRefused,
        NoQuorum,
        P2PMeshError,
        PendingPlacement,
        Placement,
        PlacementProblem,
        Port,
        Ring,
        StageInfo,
        Status,
        connect,
        fallback_chat_prompt,
        open_client,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from p2pmesh import client

        value = getattr(client, name)
        globals()[name] = value  # once only
        return value
    raise AttributeError(f"module 'p2pmesh' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
