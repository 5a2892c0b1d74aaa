"""The CLI's model commands, all through the embedded client API (so the CLI, Python
programs and the HTTP API see one truth and one set of errors):

  p2pmesh load MODEL [--context-tokens N] [--timeout S] [--json]   (waits, with a progress bar)
  p2pmesh model set MODEL [--context-tokens N] | model clear        (commit and return)
  p2pmesh generate PROMPT [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--json]
  p2pmesh chat [MESSAGE] [--system TEXT] [...same sampling options] [--json]
  p2pmesh watch [--json] [--count N] [--interval S]                 (cluster events, live)

Exit codes: 0 done; 1 the agent is not running, failed or refused; 2 bad usage or input
(a model no Mac can load, with their errors, included); 3 the cluster is not ready (no
quorum in time, no model loaded, not serving in time, the model does not fit its memory).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from typing import Any

from p2pmesh import client as api
from p2pmesh.cli.common import EXIT_NOT_READY, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, add_target, socket_of
from p2pmesh.core.placement import PARALLELISM_CHOICES
from p2pmesh.core.protocol import KV_BITS_CHOICES

CHAT_TURNS_MAX = 32
"""Conversation turns kept in an interactive chat (older ones are dropped, the system
message stays): bounds the prompt the cluster is asked to process."""
CHAT_LINE_CHARS_MAX = 16_384


def add_parser(subparsers: Any) -> None:
    """Add load, model, generate, chat and watch, each with the options naming the agent."""
    load = subparsers.add_parser("load", help="serve a model cluster-wide and wait until it serves (progress bar)")
    load.add_argument("model", help="a local directory in the Hugging Face layout, or a Hugging Face id (org/name)")
    load.add_argument("--context-tokens", type=int, default=api.DEFAULT_CONTEXT_TOKENS,
                      help="context length the KV cache is sized for (default %(default)s)")
    load.add_argument("--batch", type=_batch, default=None,
                      help="requests to serve at once: KV cache is reserved for them where memory allows, "
                           "fewer where it does not (default: the agent's --max-batch)")
    load.add_argument("--parallelism", choices=PARALLELISM_CHOICES, default="auto",
                      help="auto (default: the fastest plan), pipeline, tensor (one group of Macs sharing every "
                           "layer) or hybrid (tensor groups in a row); see docs/placement.md")
    load.add_argument("--kv-bits", type=int, choices=KV_BITS_CHOICES, default=None,
                      help="quantize the KV cache to 4 or 8 bits once a request holds 5000 tokens (mlx-lm's "
                           "QuantizedKVCache; the planner counts it), serving one request at a time "
                           "(default: full precision)")
    load.add_argument("--timeout", type=float, default=api.LOAD_TIMEOUT_S, help="seconds (default %(default)s)")
    load.add_argument("--json", action="store_true", help="one JSON object per progress step, then the result")
    add_target(load)

    model = subparsers.add_parser("model", help="choose the model the cluster serves, without waiting (see `load`)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    mset = model_sub.add_parser("set", help="serve this model (a local Hugging Face-layout directory or a Hugging Face id)")
    mset.add_argument("name")
    mset.add_argument("--context-tokens", type=int, default=api.DEFAULT_CONTEXT_TOKENS,
                      help="context length the KV cache is sized for")
    mset.add_argument("--batch", type=_batch, default=None, help="requests to serve at once (default: the agent's --max-batch)")
    mset.add_argument("--parallelism", choices=PARALLELISM_CHOICES, default="auto", help="as for `load`")
    mset.add_argument("--kv-bits", type=int, choices=KV_BITS_CHOICES, default=None, help="as for `load`")
    clear = model_sub.add_parser("clear", help="serve no model")
    for sp in (mset, clear):
        add_target(sp)

    gen = subparsers.add_parser("generate", help="generate text with the cluster's model (streams to stdout)")
    gen.add_argument("prompt")
    _sampling(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per event")
    add_target(gen)

    chat = subparsers.add_parser("chat", help="chat with the cluster's model (one message, or interactive from stdin)")
    chat.add_argument("message", nargs="?", default=None, help="one message; without it, read one message per line")
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _sampling(chat)
    chat.add_argument("--json", action="store_true", help="one JSON object per reply")
    add_target(chat)

    watch = subparsers.add_parser("watch", help="follow the cluster's events (members, leader, ring, rebalancing)")
    watch.add_argument("--json", action="store_true", help="one JSON object per event")
    watch.add_argument("--count", type=int, default=None, help="stop after this many events")
    watch.add_argument("--interval", type=float, default=api.POLL_S, help="seconds between polls of the agent")
    add_target(watch)
    for sp in (load, model, gen, chat, watch):
        sp.set_defaults(run=run)


def _batch(text: str) -> int:
    from p2pmesh.core.protocol import BATCH_REQUESTS_MAX

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= BATCH_REQUESTS_MAX:
        raise argparse.ArgumentTypeError(f"the batch is 1 to {BATCH_REQUESTS_MAX} requests")
    return value


def _sampling(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    handlers = {"load": _load, "model": _model, "generate": _generate, "chat": _chat, "watch": _watch}
    try:
        with api.connect(socket_of(args)) as cluster:
            return handlers[args.command](args, cluster)
    except KeyboardInterrupt:
        return 130
    except api.P2PMeshError as exc:
        return _failed(exc)


def _failed(exc: api.P2PMeshError) -> int:
    print(f"\np2pmesh: {exc}" if not isinstance(exc, api.AgentNotRunning) else f"p2pmesh: {exc}", file=sys.stderr)
    if isinstance(exc, (api.BadRequest, api.ModelCannotLoad)):
        return EXIT_USAGE  # the model itself is unusable: the input's fault
    if isinstance(exc, (api.NoQuorum, api.ModelNotLoaded)):
        return EXIT_NOT_READY
    return EXIT_UNAVAILABLE


# ---------------------------------------------------------------------------------------
# load / model set / model clear


def _load(args: argparse.Namespace, cluster: api.Client) -> int:
    from p2pmesh.cli import terminal

    con = terminal.console()
    if args.json:
        def report(p: api.LoadProgress) -> None:
            print(json.dumps({"model": p.model, "stage": p.stage, "ready": p.ready, "stages": p.stages,
                              "epoch": p.epoch, "detail": p.detail,
                              "transfers": [dataclasses.asdict(t) for t in p.transfers]}), flush=True)

        loaded = cluster.load(args.model, context_tokens=args.context_tokens, timeout=args.timeout, on_progress=report,
                              batch=args.batch, parallelism=args.parallelism, kv_bits=args.kv_bits)
        print(json.dumps({"model": loaded.name, "layers": loaded.layers, "layer_bytes": loaded.layer_bytes,
                          "context_tokens": loaded.context_tokens, "epoch": loaded.placement.epoch,
                          "batch": loaded.placement.batch, "batch_asked": loaded.placement.batch_asked,
                          "stages": [{"node_id": s.node_id, "layers": [s.start, s.end]} for s in loaded.placement.stages],
                          "parallelism": loaded.placement.parallelism, "kv_bits": loaded.placement.kv_bits,
                          "groups": [{"node_ids": list(g.node_ids), "layers": [g.start, g.end]} for g in loaded.placement.groups]}))
        return EXIT_OK
    with ProgressReport(con, f"loading {args.model}") as bar:
        loaded = cluster.load(args.model, context_tokens=args.context_tokens, timeout=args.timeout,
                              on_progress=lambda p: bar.update(p.detail, p.ready, p.stages), batch=args.batch,
                              parallelism=args.parallelism, kv_bits=args.kv_bits)
    con.print(f"serving {loaded.name}: {loaded.layers} layers on {len(loaded.placement.stages)} "
              f"stage{'s' if len(loaded.placement.stages) != 1 else ''} (epoch {loaded.placement.epoch}), "
              f"{terminal.batch_words(loaded.placement.batch, loaded.placement.batch_asked)}"
              + (f", KV cache {loaded.placement.kv_bits}-bit" if loaded.placement.kv_bits else ""), style="green")
    if loaded.placement.parallelism in ("tensor", "hybrid"):
        con.print(f"  {loaded.placement.parallelism}:")
        for i, g in enumerate(loaded.placement.groups):
            con.print(f"  group {i}: {', '.join(terminal.short(n) for n in g.node_ids)} layers {g.start}-{g.end - 1}")
        return EXIT_OK
    for i, s in enumerate(loaded.placement.stages):
        con.print(f"  stage {i}: {terminal.short(s.node_id)} layers {s.start}-{s.end - 1}")
    return EXIT_OK


class ProgressReport:
    """A progress bar of ready workers on a terminal; one line per change in a pipe (a bar
    redrawn in place would be noise in a log)."""

    def __init__(self, con: Any, title: str) -> None:
        self.con, self.title = con, title
        self._bar: Any = None
        self._task: Any = None
        self._last: tuple[str, int, int] | None = None

    def __enter__(self) -> ProgressReport:
        if self.con.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.con, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=None)
        return self

    def update(self, detail: str, done: int, total: int) -> None:
        if (detail, done, total) == self._last:
            return
        self._last = (detail, done, total)
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.title}: {detail}", completed=done, total=total or None)
        else:
            self.con.print(f"{self.title}: {detail}" + (f" [{done}/{total}]" if total else ""))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


def _model(args: argparse.Namespace, cluster: api.Client) -> int:
    # `model set` commits the choice and returns (the placement follows): one request,
    # the same op `load` starts with.
    try:
        if args.model_command == "set":
            model = cluster.set_model(args.name, context_tokens=args.context_tokens, batch=args.batch,
                                      parallelism=args.parallelism, kv_bits=args.kv_bits)
        else:
            model = cluster.set_model(None)
    except api.P2PMeshError as exc:
        # Any refusal exits 1 here (load tells a bad model, 2, from a cluster not ready, 3).
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    # The op returns once the agent proposed the choice, before it commits: say so.
    print(f"asked the cluster to serve {model.name} ({model.layers} layers); `p2pmesh load` waits until "
          "it serves, `p2pmesh status` shows the placement" if model else "asked the cluster to serve no model")
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# generate / chat


def _generate(args: argparse.Namespace, cluster: api.Client) -> int:
    gen = cluster.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed)
    _stream(gen, args.json)
    return EXIT_OK


def _stream(gen: api.Generation, as_json: bool) -> api.GenerationResult | None:
    """Print a generation as it comes: text pieces, or one JSON object per piece then the end."""
    for piece in gen:
        if as_json:
            print(json.dumps({"text": piece}), flush=True)
        else:
            print(piece, end="", flush=True)
    result = gen.result
    if as_json and result is not None:
        print(json.dumps({"done": True, "request_id": result.request_id, "finish": result.finish,
                          "tokens": len(result.tokens), "text": result.text, "ttft_s": result.ttft_s}), flush=True)
    elif not as_json:
        print(flush=True)
    return result


def _chat(args: argparse.Namespace, cluster: api.Client) -> int:
    history: list[dict[str, str]] = []
    system = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None and sys.stdin.isatty()
    for line in _messages(args.message, interactive):
        history.append({"role": "user", "content": line})
        del history[:-CHAT_TURNS_MAX]
        gen = cluster.chat(system + history, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed)
        if args.json:
            text = "".join(gen)
            result = gen.result
            print(json.dumps({"role": "assistant", "content": text, "finish": result.finish if result else None,
                              "tokens": len(result.tokens) if result else None}), flush=True)
        else:
            result = _stream(gen, False)
            text = result.text if result else ""
        history.append({"role": "assistant", "content": text})
    return EXIT_OK


def _messages(message: str | None, interactive: bool) -> Iterator[str]:
    """The user's messages: the one given, or one per line of stdin until EOF (or /exit)."""
    if message is not None:
        if not message.strip():
            raise api.BadRequest("the message is empty")
        yield message
        return
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline(CHAT_LINE_CHARS_MAX + 1)
        if not line or line.strip() in ("/exit", "/quit"):
            return
        if len(line) > CHAT_LINE_CHARS_MAX:
            raise api.BadRequest(f"a message is longer than {CHAT_LINE_CHARS_MAX} characters")
        if line.strip():
            yield line.rstrip("\n")


# ---------------------------------------------------------------------------------------
# watch


def _watch(args: argparse.Namespace, cluster: api.Client) -> int:
    from p2pmesh.cli import terminal

    if args.count is not None and args.count < 1:
        raise api.BadRequest("--count must be at least 1")
    if args.interval <= 0:
        raise api.BadRequest("--interval must be positive")
    con = terminal.console()
    seen = 0
    bar: ProgressReport | None = None
    try:
        for event in cluster.watch(interval=args.interval):
            if args.json:
                print(json.dumps({"kind": str(event.kind), "detail": event.detail, "node_id": event.node_id,
                                  "epoch": event.epoch, "ready": event.ready, "stages": event.stages,
                                  **(dataclasses.asdict(event.transfer) if event.transfer is not None else {})}), flush=True)
            elif event.kind in (api.EventKind.PLAN_COMMITTED, api.EventKind.REBALANCE_PROGRESS):
                if bar is None:
                    bar = ProgressReport(con, f"rebalancing to epoch {event.epoch}").__enter__()
                bar.update(event.detail, event.ready or 0, event.stages or 0)
            else:
                if bar is not None:
                    bar.__exit__(None, None, None)
                    bar = None
                style = "red" if event.kind == api.EventKind.MEMBER_DOWN else None
                con.print(f"{event.kind.value:18} {event.detail}", style=style)
            seen += 1
            if args.count is not None and seen >= args.count:
                break
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    return EXIT_OK
