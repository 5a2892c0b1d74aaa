"""p2pmesh: one AI computer from several Macs cabled with Thunderbolt.

The public API is declared here; everything else is private.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
