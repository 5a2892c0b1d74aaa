"""Identifier types shared by every core module."""
from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
"""32 lowercase hex characters derived from the node's public key (see identity.py)."""

ClusterId = NewType("ClusterId", str)
"""A cluster's name: chosen by its founder at bootstrap, never reused."""


def is_node_id(value: object) -> bool:
    """Whether a value from outside (a TXT record, a pairing message) is a node id."""
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)
