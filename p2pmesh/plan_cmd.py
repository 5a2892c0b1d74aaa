"""`p2pmesh plan solve`: placement planning for a described cluster (being written)."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    subparsers.add_parser("plan", help="plan layer placement (being written)")


def run(args: argparse.Namespace) -> int:
    return 2
