"""`p2pmesh links parse`: turn saved Thunderbolt captures into this Mac's port list.

  p2pmesh links parse --system-profiler FILE [--networksetup FILE] [--json]

Reads files only (it never runs system_profiler itself), so a capture from another Mac, or a
bug report, can be checked anywhere. The parsing lives in p2pmesh.core.thunderbolt; this
module owns only argument wiring, file reading and printing. cli.py calls add_parser/run.
Exit codes: 0 success, 2 unreadable or malformed input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from p2pmesh.core.thunderbolt import CaptureError, local_ports, to_json

EXIT_OK, EXIT_USAGE = 0, 2


def add_parser(subparsers: Any) -> None:
    """Add `links parse` to an argparse subparsers object (from add_subparsers())."""
    links = subparsers.add_parser("links", help="inspect Thunderbolt links")
    links_sub = links.add_subparsers(dest="links_command", required=True)
    parse = links_sub.add_parser("parse", help="parse saved system_profiler/networksetup captures")
    parse.add_argument(
        "--system-profiler",
        dest="system_profiler",
        type=Path,
        required=True,
        metavar="FILE",
        help="output of `system_profiler SPThunderboltDataType -json`",
    )
    parse.add_argument(
        "--networksetup",
        type=Path,
        default=None,
        metavar="FILE",
        help="output of `networksetup -listallhardwareports` (maps ports to enX)",
    )
    parse.add_argument("--json", action="store_true")


def _read(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CaptureError(f"cannot read {what} file {str(path)!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CaptureError(f"{what} file {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def run(args: argparse.Namespace) -> int:
    """Execute `links parse`; prints to stdout, errors to stderr as `p2pmesh: ...`."""
    try:
        sp_text = _read(args.system_profiler, "system_profiler")
        ns_text = _read(args.networksetup, "networksetup") if args.networksetup is not None else None
        try:
            ports = local_ports(sp_text, ns_text)
        except CaptureError as e:
            # Name the file too: with two inputs the message alone may not say which is bad.
            raise CaptureError(f"{e} (in {str(args.system_profiler)!r}"
                               + (f" / {str(args.networksetup)!r})" if ns_text is not None else ")")) from None
    except CaptureError as e:
        print(f"p2pmesh: {e}", file=sys.stderr)
        return EXIT_USAGE
    rows = to_json(ports)
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    header = ("PORT", "IFACE", "CONNECTED", "GBPS", "PEER DOMAIN")
    table = [header] + [
        (
            r["port"],
            r["interface"] or "-",
            "yes" if r["connected"] else "no",
            "-" if r["speed_gbps"] is None else f"{r['speed_gbps']:g}",
            r["peer_domain_uuid"] or "-",
        )
        for r in rows
    ]
    # Captures may carry any text (even lone surrogates from a JSON escape); keep print safe.
    table = [tuple(c.encode("utf-8", "backslashreplace").decode("utf-8") for c in row) for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return EXIT_OK
