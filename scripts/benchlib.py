"""The bench scripts' one harness: the command line every bench shares (``--json FILE`` for
scripts/bench.py), CPU and wall timing, the markdown table rows docs/benchmarks.md quotes,
and the JSON file of raw figures.

    from benchlib import cpu, parser, row, table, wall, write_json

Convention: a bench prints markdown tables (``table`` then ``row``s) and a one-line verdict on
stdout, and with ``--json FILE`` also writes its raw figures there, for scripts/bench.py to
render docs/benchmarks.md. Timing: ``cpu`` (process CPU time: what the code costs, steady on a
shared machine) for pure computations, ``wall`` (a monotonic clock) for anything that waits on
processes, sockets or disks.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """The bench's argument parser: its docstring's first line as the description, and the
    shared ``--json FILE`` option (args.json: a path or None)."""
    p = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0], **kwargs)
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures as JSON to this file (for scripts/bench.py)")
    return p


def cpu(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the process CPU seconds it took."""
    started = time.process_time()
    out = fn()
    return out, time.process_time() - started


def wall(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the wall-clock seconds it took (monotonic, high resolution)."""
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def table(*header: str) -> None:
    """A markdown table's header and separator lines."""
    row(*header)
    print("|" + "---|" * len(header))


def row(*cells: object) -> None:
    """One markdown table row: ``| a | b |`` (cells already formatted by the caller)."""
    print("| " + " | ".join(str(c) for c in cells) + " |")


def write_json(path: Path | str | None, data: Any) -> None:
    """The raw figures, when ``--json`` named a file (nothing otherwise)."""
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
