"""The bench scripts' one harness: the command line every bench shares (``--json [FILE]``),
CPU and wall timing, the markdown table rows docs/benchmarks.md quotes, and the raw figures
as JSON.

    from benchlib import cpu, parser, row, table, wall, write_json

Convention: a bench prints markdown tables (``table`` then ``row``s) and a one-line verdict
on stdout, then, last, its raw figures with ``write_json(args.json, figures)``: with
``--json FILE`` into FILE (what scripts/bench.py passes, to render docs/benchmarks.md), with a
bare ``--json`` as the last line of stdout (one JSON object: a program reads the last line),
without ``--json`` not at all. Timing: ``cpu`` (process CPU time: what the code costs,
steady on a shared machine) for pure computations, ``wall`` (a monotonic clock) for anything
that waits on processes, sockets or disks.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

STDOUT = "-"
"""What ``--json`` holds when no FILE follows it: the figures go to stdout's last line."""


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """The bench's argument parser: its docstring's first line as the description, and the
    shared ``--json [FILE]`` option (args.json: FILE as given, STDOUT without one, or None)."""
    p = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0], **kwargs)
    p.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE",
                   help="the raw figures as JSON: into FILE (for scripts/bench.py), or with no FILE as the last line of stdout")
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


def table_lines(*header: str) -> list[str]:
    """A markdown table's header and separator lines (for a bench that also writes them to a file)."""
    return [row_line(*header), "|" + "---|" * len(header)]


def row_line(*cells: object) -> str:
    """One markdown table row: ``| a | b |`` (cells already formatted by the caller)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(*header: str) -> None:
    """Print a markdown table's header and separator lines."""
    print("\n".join(table_lines(*header)))


def row(*cells: object) -> None:
    """Print one markdown table row."""
    print(row_line(*cells))


def write_json(path: Path | str | None, data: Any) -> None:
    """The raw figures as ``--json`` asked: into a file, as stdout's last line (STDOUT: call
    this after everything else the bench prints), or nowhere (None)."""
    if path is None:
        return
    if str(path) == STDOUT:
        print(json.dumps(data), flush=True)
        return
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
