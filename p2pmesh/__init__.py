"""p2pmesh: one AI computer from several Macs cabled with Thunderbolt.

The public API is p2pmesh.client's ``__all__`` (the one list; docs/client.md documents
it), re-exported here with ``__version__``; everything else is private.

The names come from p2pmesh.client, imported on first use (PEP 562): `python -m p2pmesh`
and every worker process import this package, and they need none of it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # type checkers follow the star import through p2pmesh.client.__all__
    from p2pmesh.client import *  # noqa: F403


def _client() -> Any:
    # import_module, not `from p2pmesh import client`: that asks this module's __getattr__
    # for "client" first, which would ask for the client again.
    return importlib.import_module("p2pmesh.client")


def _public() -> list[str]:
    return [*_client().__all__, "__version__"]


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from p2pmesh import *` asks for it
        value: Any = _public()
    elif name in _public():
        value = getattr(_client(), name)
    else:
        raise AttributeError(f"module 'p2pmesh' has no attribute {name!r}")
    globals()[name] = value  # once only
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_public()))
