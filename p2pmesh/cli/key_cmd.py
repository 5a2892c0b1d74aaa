"""`p2pmesh key show | key set KEY [--state-dir DIR]`: the cluster key in this Mac's state
directory (p2pmesh.drivers.keys; its typo-proof text form).

Exit codes: 0 shown or installed; 1 no key yet (`show`); 2 a malformed key.
"""
from __future__ import annotations

import argparse
from typing import Any

from p2pmesh.cli.common import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, add_state_dir, failed


def add_parser(subparsers: Any) -> None:
    key = subparsers.add_parser("key", help="show or install the cluster key")
    key.set_defaults(run=run)
    key_sub = key.add_subparsers(dest="key_command", required=True)
    show = key_sub.add_parser("show", help="print the cluster key (install it on another Mac with `key set`)")
    add_state_dir(show)
    setk = key_sub.add_parser("set", help="install a cluster key before starting the agent")
    setk.add_argument("key")
    add_state_dir(setk)


def run(args: argparse.Namespace) -> int:
    from p2pmesh.drivers import keys

    path = args.state_dir / keys.KEY_FILE
    if args.key_command == "show":
        if not path.exists():
            return failed(f"no cluster key in {args.state_dir} yet; start the agent once, or install one with "
                          "`p2pmesh key set`", EXIT_UNAVAILABLE)
        try:
            print(keys.format_key(keys.read_key(path)))
        except keys.KeyError_ as exc:
            return failed(exc, EXIT_USAGE)
        return EXIT_OK
    try:
        key = keys.parse_key(args.key)
    except keys.KeyError_ as exc:
        return failed(exc, EXIT_USAGE)
    keys.write_key(path, key)
    print(f"cluster key installed in {path}")
    return EXIT_OK
