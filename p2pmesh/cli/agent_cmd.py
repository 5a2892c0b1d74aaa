"""`p2pmesh agent`: run the agent, the same on every Mac, no options needed.

  p2pmesh agent [--state-dir DIR] [--listen HOST:PORT]... [--interface NAME]... [--peer HOST:PORT]...
                [--cluster-key-file FILE] [--advertise HOST:PORT]... [--leave-on-exit] [--http HOST:PORT]
                [--memory-limit BYTES] [--layer-ms MS] [--max-batch N] [--max-queue N] [--model-root DIR]
                [--configure-links] [--copy-over-tls]
                [--log-level LEVEL] [--log-format text|json]

This module turns the options into an AgentConfig and runs p2pmesh.agent.run_agent (agent/runtime.py) under
trio. `service install` checks the arguments it will start the agent with against this
same parser (add_parser), so a service never starts into a crash loop.

Exit codes: the agent's own when it stops; 1 it cannot start (an address in use, an HTTP
configuration it cannot serve); 2 bad usage (a bad key, a damaged state directory).
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from p2pmesh.cli.common import EXIT_UNAVAILABLE, EXIT_USAGE, add_state_dir, failed
from p2pmesh.core.protocol import BATCH_REQUESTS_DEFAULT, BATCH_REQUESTS_MAX, QUEUE_REQUESTS_DEFAULT, QUEUE_REQUESTS_MAX


def _count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value
    return parse


def _positive_ms(text: str) -> float:
    """A time per layer in milliseconds: finite and above zero."""
    from p2pmesh.core.validate import LAYER_MS_MAX

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value < LAYER_MS_MAX):
        raise argparse.ArgumentTypeError(f"must be above 0 and below {LAYER_MS_MAX:g} ms, got {text}")
    return value


def add_parser(subparsers: Any) -> None:
    agent = subparsers.add_parser("agent", help="run the agent (the same on every Mac, no options needed)")
    agent.set_defaults(run=run)
    add_state_dir(agent)
    agent.add_argument("--listen", action="append", default=[], help="HOST:PORT to accept peers on (repeatable; default :7741, every IPv4 and IPv6 address)")
    agent.add_argument("--no-mdns", action="store_true", help="do not advertise or browse with zeroconf (static peers only)")
    agent.add_argument("--interface", action="append", default=[], help="network interface to use (repeatable)")
    agent.add_argument("--peer", action="append", default=[], help="static peer HOST:PORT where multicast is blocked")
    agent.add_argument("--advertise", action="append", default=[], help="HOST:PORT peers should dial (default: --listen)")
    agent.add_argument("--cluster-key-file", type=Path, default=None)
    agent.add_argument("--leave-on-exit", action="store_true", help="leave the cluster gracefully on SIGINT/SIGTERM")
    agent.add_argument(
        "--configure-links",
        action="store_true",
        help="add the data-plane IPv4 addresses `p2pmesh links plan` prints (never done without this flag)",
    )
    agent.add_argument("--copy-over-tls", action="store_true",
                       help="copy model files inside TLS, both ways (confidential; slower than the default, a plain "
                            "TCP connection tied to the TLS session and checked by SHA-256)")
    agent.add_argument("--memory-limit", type=int, default=None, metavar="BYTES",
                       help="offer at most this much memory for model layers (default: what the Mac allows)")
    agent.add_argument("--layer-ms", type=_positive_ms, default=None, metavar="MS",
                       help="report this time per layer instead of the measured one (a Mac that is "
                            "busy with other work while it measures, or whose timing you know)")
    agent.add_argument("--max-batch", type=_count(1, BATCH_REQUESTS_MAX), default=BATCH_REQUESTS_DEFAULT, metavar="N",
                       help="requests this Mac's head worker serves at once (default %(default)s)")
    agent.add_argument("--max-queue", type=_count(0, QUEUE_REQUESTS_MAX), default=QUEUE_REQUESTS_DEFAULT, metavar="N",
                       help="requests waiting for a slot; beyond them a request is refused as busy, HTTP 429 "
                            "(default %(default)s)")
    agent.add_argument("--data-port", type=int, default=47000, help="first port of the data-plane workers")
    agent.add_argument("--model-root", type=Path, default=None, metavar="DIR",
                       help="look up model names that are relative paths here (a model only this Mac has is "
                            "copied to the others over the cluster's links)")
    agent.add_argument("--http", default="127.0.0.1:7780", metavar="HOST:PORT",
                       help="serve the OpenAI-compatible HTTP API here (default %(default)s; docs/http.md)")
    agent.add_argument("--http-token", default=None, metavar="TOKEN",
                       help="require this bearer token on every HTTP request (default: $P2PMESH_HTTP_TOKEN); "
                            "needed for a non-loopback --http")
    agent.add_argument("--no-http", action="store_true", help="do not serve the HTTP API")
    agent.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    agent.add_argument("--log-format", default="text", choices=["text", "json"])


def run(args: argparse.Namespace) -> int:
    import trio

    from p2pmesh.agent import http as http_api
    from p2pmesh.agent import AgentConfig, configure_logging, run_agent
    from p2pmesh.core.errors import StateCorrupted
    from p2pmesh.drivers.keys import KeyError_

    configure_logging(args.log_level, args.log_format)
    try:
        http = None if args.no_http else http_api.endpoint(args.http, args.http_token or os.environ.get(http_api.TOKEN_ENV))
    except http_api.HttpConfigError as exc:
        return failed(exc, EXIT_USAGE)
    config = AgentConfig(
        state_dir=args.state_dir,
        # Every family: the agent advertises its interfaces' IPv6 link-local addresses too.
        listen=tuple(args.listen) or AgentConfig.listen,
        mdns=not args.no_mdns,
        peers=tuple(args.peer),
        interfaces=tuple(args.interface),
        cluster_key_file=args.cluster_key_file,
        advertise=tuple(args.advertise),
        leave_on_exit=args.leave_on_exit,
        configure_links=args.configure_links,
        memory_limit_bytes=args.memory_limit,
        layer_ms=args.layer_ms,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        data_port_base=args.data_port,
        model_root=args.model_root,
        http=http,
        copy_over_tls=args.copy_over_tls,
    )
    try:
        return trio.run(run_agent, config)
    except (StateCorrupted, KeyError_, ValueError) as exc:
        return failed(exc, EXIT_USAGE)
    except OSError as exc:
        return failed(f"cannot start the agent: {exc}", EXIT_UNAVAILABLE)
    except BaseExceptionGroup as group:  # a failure inside the agent's nurseries
        found = http_api.find_config_error(group)
        if found is None:
            raise
        return failed(found, EXIT_UNAVAILABLE)
