"""Identifier types shared by every core module."""
from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
"""32 lowercase hex characters derived from the node's public key (see identity.py)."""

ClusterId = NewType("ClusterId", str)
"""A cluster's name: chosen by its founder at bootstrap, never reused."""
