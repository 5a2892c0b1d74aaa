"""The client API: a program's typed view of a running agent, over the agent's control
socket (drivers/control.py), and an agent embedded in a program (docs/client.md).

The package, one concept a module:
- values.py: the typed values (frozen dataclasses) built from the agent's JSON;
- errors.py: the typed errors (those an agent's answer maps to are defined with their codes
  in core/protocol.py, the one table of codes, HTTP statuses and client errors);
- steps.py: the sans-I/O steps and the socket-level plans (ask, a generation's stream);
- plans.py: every operation as one plan (status, the model op, load with progress, generate,
  chat, watch, leave, pair);
- drivers.py: where the agent is, and the trio and blocking drivers that run the plans;
- api.py: AsyncClient / open_client and Client / connect with their generations: thin
  shells that hand the same plans to their driver, so sync and async cannot drift apart;
- events.py: watch's events (the diff of two statuses); chat.py: messages -> a prompt;
- embedded.py: `Agent`, p2pmesh.agent.Agent run inside the caller's trio program.

Everything importable from the single-module client before (`from p2pmesh.client import X`)
still is, from here.
"""
from __future__ import annotations

from p2pmesh.client import errors as _errors
from p2pmesh.client.api import AsyncClient, AsyncGeneration, Client, Generation, connect, open_client
from p2pmesh.client.chat import chat_prompt as _chat_prompt
from p2pmesh.client.chat import check_messages as _check_messages
from p2pmesh.client.chat import fallback_chat_prompt
from p2pmesh.client.chat import model_directory as _model_directory
from p2pmesh.client.drivers import SOCKET_ENV, SOCKET_NAME, locate_socket
from p2pmesh.client.embedded import Agent
from p2pmesh.client.errors import *  # noqa: F403 - every typed error, listed once (errors.__all__)
from p2pmesh.client.events import diff as _diff
from p2pmesh.client.plans import (
    DEFAULT_CONTEXT_TOKENS,
    LOAD_TIMEOUT_S,
    MODEL_RESEND_S,
    MODEL_TIMEOUT_S,
    POLL_S,
    QUORUM_TIMEOUT_S,
    model_name,
)
from p2pmesh.client.plans import load_progress as _load_progress
from p2pmesh.client.steps import LINE_BYTES_MAX, REQUEST_TIMEOUT_S, STREAM_IDLE_TIMEOUT_S
from p2pmesh.client.values import (
    Event,
    EventKind,
    GenerationResult,
    Hop,
    LoadedModel,
    GroupInfo,
    LoadProgress,
    Member,
    ModelInfo,
    PendingPlacement,
    Placement,
    Port,
    Requests,
    Ring,
    ShareInfo,
    StageInfo,
    Status,
    Transfer,
)
from p2pmesh.client.values import parse_status as _status
from p2pmesh.core.errors import MeshError
from p2pmesh.core.fit import PlacementProblem
from p2pmesh.core.protocol import refused as _refused

__all__ = sorted([
    *_errors.__all__,
    "Agent",
    "AsyncClient",
    "AsyncGeneration",
    "Client",
    "Event",
    "EventKind",
    "Generation",
    "GenerationResult",
    "GroupInfo",
    "Hop",
    "LoadProgress",
    "LoadedModel",
    "Member",
    "ModelInfo",
    "PendingPlacement",
    "Placement",
    "PlacementProblem",
    "Port",
    "Requests",
    "Ring",
    "ShareInfo",
    "StageInfo",
    "Status",
    "Transfer",
    "connect",
    "fallback_chat_prompt",
    "open_client",
])

# Not in __all__ (not the documented API) but importable as before: the CLI and tests use them.
_ALSO = (DEFAULT_CONTEXT_TOKENS, LINE_BYTES_MAX, LOAD_TIMEOUT_S, MODEL_RESEND_S, MODEL_TIMEOUT_S, POLL_S,
         QUORUM_TIMEOUT_S, REQUEST_TIMEOUT_S, SOCKET_ENV, SOCKET_NAME, STREAM_IDLE_TIMEOUT_S, MeshError, locate_socket, model_name,
         _chat_prompt, _check_messages, _diff, _load_progress, _model_directory, _refused, _status)
