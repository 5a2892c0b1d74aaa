"""A pipeline worker: `python -m p2pmesh.worker.serve --model M --stages '[[0,3],[3,8]]' --rank R`
(and tensor groups chained as a pipeline: --group-sizes, below).

One process per rank of the committed ring. With two or more stages the agent sets
MLX_RANK (= --rank) and MLX_HOSTFILE (core/mlx_hostfile.py) exactly as for ring_check, and
the worker joins the ring group with mx.distributed.init(backend="ring"); a single stage
runs alone, without mx.distributed. Each rank loads layers stages[rank] (worker/model.py),
prints "ready", then rank 0 reads commands from stdin and streams tokens to stdout while
the other ranks run their stage for every step rank 0 sends (worker/pipeline.py). Rank 0
serves up to --max-batch requests at once (continuous batching, worker/scheduler.py) and
queues --max-queue more; beyond that a request is refused with a "busy" error.

Tensor groups and hybrids (issue 16): `--group-sizes [2, 2]` makes consecutive ranks one
tensor group each (all of a group hold the same --stages range, split by --shares or evenly:
worker/tensor.py). Then each group of two or more is its own MLX group (MLX_RANK = the
rank's index in its group, MLX_HOSTFILE that group's), a group of one forms none, and
the steps travel over the side channel (worker/side_link.py: --side-listen on each group's
first rank, --side-next between those, --side-head for the others): rank 0 still reads
stdin and runs the Engine; every group's first rank sends each step to its group first,
and the others run it in lockstep (pipeline.serve_member). worker/group_plan.py parses
and checks the plan. Without --group-sizes (or all ones) nothing of this runs.

The JSON-lines protocol is in worker/protocol.py and docs/inference.md. In short:
  stdout, every rank: ready, heartbeat (every 0.5 s from a thread), error;
  stdout, rank 0: token, done;
  stdin, rank 0: {"op": "generate", ...}, {"op": "cancel", "id": ...}, {"op": "shutdown"};
  EOF means shutdown (the requests taken before it finish first).

Exit status: 0 after a shutdown that every rank drained; 1 on a runtime failure (a peer
lost, the pipeline out of sync, the watchdog); 2 when the arguments, the environment or
the model are unusable (the caller's fault). MLX has no timeouts, so a C-level watchdog
(--timeout-s) ends a rank that cannot form the group and load within that time, and again
bounds the final drain; while serving the agent supervises (SIGTERM and SIGKILL end a
worker at any time: no handler is installed).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from p2pmesh.core import protocol as limits_
from p2pmesh.core.batching import Finished, Sampling, Scheduler
from p2pmesh.worker.group_plan import Plan, Role, SideAddrs, parse_plan, parse_stage_list, side_addrs

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 30.0
HEARTBEAT_S = 0.5
DEFAULT_MAX_BATCH = limits_.BATCH_REQUESTS_DEFAULT
DEFAULT_MAX_QUEUE = limits_.QUEUE_REQUESTS_DEFAULT


class Emitter:
    """JSON lines on stdout, one writer at a time (the heartbeat thread and the main one)."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()


class LoadBoard:
    """Rank 0's batch load, written by the command loop and read by the heartbeat thread
    (one attribute holding an immutable value: a read never sees half an update)."""

    def __init__(self) -> None:
        from p2pmesh.worker import protocol

        self.value = protocol.Load()


def start_heartbeat(emitter: Emitter, rank: int, board: LoadBoard | None = None) -> threading.Event:
    """Heartbeats every HEARTBEAT_S until the returned event is set (rank 0's with its batch
    load). If stdout is gone the agent is gone: the worker exits (nothing else would end a
    rank idling in MLX's recv)."""
    from p2pmesh.worker import protocol

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                emitter.emit(protocol.heartbeat(rank, time.time(), board.value if board is not None else None))
            except (OSError, ValueError):
                os._exit(EXIT_FAILED)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return stop


def read_line(stream: IO[bytes], limit: int) -> bytes | None:
    """The next line (without its newline) of at most `limit` bytes; None at EOF. A longer
    line raises LineTooLong after its remainder has been skipped."""
    line = stream.readline(limit + 1)
    if not line:
        return None
    if len(line) > limit and not line.endswith(b"\n"):
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 16)
        raise LineTooLong(f"command line longer than {limit} bytes")
    return line.rstrip(b"\r\n")


class LineTooLong(Exception):
    """A stdin line over the limit: the agent's fault; the line is skipped."""


def build_parser() -> argparse.ArgumentParser:
    """The worker's options (the agent's supervisor builds its command line: worker_command)."""
    parser = argparse.ArgumentParser(prog="python -m p2pmesh.worker.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory or a Hugging Face id")
    parser.add_argument("--stages", required=True, help="JSON [[start, end], ...], one layer range per rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--backend", choices=["ring", "jaccl"], default="ring",
                        help="ring: TCP (MLX_HOSTFILE); jaccl: RDMA over Thunderbolt 5 (MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="watchdog for group formation and loading")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="max prompt tokens per pipeline step")
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--max-tokens-cap", type=int, default=None)
    parser.add_argument("--max-line-bytes", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=None,
                        help=f"requests served at once (default {DEFAULT_MAX_BATCH}; 1 with --kv-bits)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="requests waiting for a slot; more are refused (busy)")
    parser.add_argument("--kv-bits", type=int, choices=limits_.KV_BITS_CHOICES, default=None,
                        help="quantize the KV caches to 4 or 8 bits as they grow (worker/kv_cache.py); "
                             "needs --max-batch 1 (default: full precision)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="decode groups in flight along the ring (default: one per stage)")
    parser.add_argument("--group-sizes", default=None,
                        help="JSON [n, ...]: consecutive ranks forming one tensor group each (default: all 1, a pipeline)")
    parser.add_argument("--shares", default=None,
                        help="JSON [[heads, kv_heads, columns], ...], one per rank (default: an even split per group)")
    parser.add_argument("--side-listen", default=None, help="a group head: JSON [\"ip:port\", ...] it listens on (side channel)")
    parser.add_argument("--side-next", default=None, help="a group head: HOST:PORT of the next group's head")
    parser.add_argument("--side-head", default=None, help="a group member: HOST:PORT of its group's head")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emitter = Emitter(sys.stdout)
    # Armed before MLX is even imported: it fires while native code blocks (accept, recv).
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    args.deadline = time.monotonic() + args.timeout_s
    try:
        stages = parse_stage_list(args.stages)
        plan = parse_plan(stages, args.group_sizes, args.shares)
        if not 0 <= args.rank < len(stages):
            raise ValueError(f"--rank {args.rank} is not one of the {len(stages)} stages")
        role = plan.role(args.rank)
        side = _side_addrs(args, plan, role) if plan.tensor else None
        if args.max_batch is None:
            args.max_batch = 1 if args.kv_bits else DEFAULT_MAX_BATCH
        if args.max_batch < 1 or args.max_queue < 0 or (args.micro_batches is not None and args.micro_batches < 1):
            raise ValueError("--max-batch and --micro-batches must be >= 1, --max-queue >= 0")
        if args.prefill_chunk is not None and args.prefill_chunk < 1:
            raise ValueError("--prefill-chunk must be >= 1")
        if args.kv_bits and args.max_batch != 1:
            raise ValueError("--kv-bits needs --max-batch 1: mlx-lm's batched KV cache has no quantized form")
    except ValueError as e:
        return _fail(emitter, EXIT_USAGE, str(e))
    board = LoadBoard() if args.rank == 0 else None
    heartbeat_stop = start_heartbeat(emitter, args.rank, board)
    try:
        return _run(args, plan, role, side, emitter, board)
    finally:
        heartbeat_stop.set()


def _fail(emitter: Emitter, code: int, message: str, request_ids: list[str] | None = None,
          fault: dict[str, Any] | None = None) -> int:
    """Report why the worker ends (an error event per request it was running, or one
    without an id, and stderr); the exit status ``code``."""
    from p2pmesh.worker import protocol

    print(f"serve: {message}" + (f" ({fault})" if fault else ""), file=sys.stderr, flush=True)
    # Exit 1 is a runtime failure of the epoch's group, never a request's fault: the agent
    # resumes any request named here on the next epoch (protocol.PIPELINE_BROKEN).
    kind = protocol.UNUSABLE if code == EXIT_USAGE else protocol.PIPELINE_BROKEN
    try:
        for request_id in request_ids or [None]:
            emitter.emit(protocol.error(kind, message, request_id, fault))
    except (OSError, ValueError):
        pass
    return code


def _run(args: argparse.Namespace, plan: Plan, role: Role, side: SideAddrs | None, emitter: Emitter,
         board: LoadBoard | None) -> int:
    import mlx.core as mx

    from p2pmesh.worker import kv_cache, protocol
    from p2pmesh.worker.checkpoint import CheckpointError, read_config
    from p2pmesh.worker.model import ModelError, load_shard, load_tokenizer, resolve_model
    from p2pmesh.worker.pipeline import PREFILL_CHUNK, Engine, Link, Stage, serve_member, serve_stage
    from p2pmesh.worker.ring_check import EnvError, read_env, read_hosts, ring_fault
    from p2pmesh.worker.ring_wake import left_sockets
    from p2pmesh.worker.side_link import open_side
    from p2pmesh.worker.tensor import TENSOR_FAMILIES, load_tensor_shard

    rank, size = args.rank, len(plan.stages)
    # The MLX group this process joins: the whole ring of a pipeline; its own tensor group
    # in a tensor plan (none for a group of one).
    mlx_rank, mlx_size = (role.index, role.size) if plan.tensor else (rank, size)
    group: Any = None
    link: Any = None
    fan: Any = None
    try:
        if mlx_size >= 2:
            env_rank, env_size = read_env()
            if (env_rank, env_size) != (mlx_rank, mlx_size):
                mine = (f"--rank/--group-sizes say index {mlx_rank} of tensor group {role.group} of {mlx_size} ranks"
                        if plan.tensor else f"--rank/--stages say {rank} of {size}")
                raise EnvError(f"MLX_RANK/MLX_HOSTFILE say rank {env_rank} of {env_size}; {mine}")
    except EnvError as e:
        return _fail(emitter, EXIT_USAGE, str(e))
    try:
        start, end = role.layers
        path = resolve_model(args.model, layers=(start, end))
        config = read_config(path)
        num_layers = int(config.get("text_config", config)["num_hidden_layers"])
        if plan.stages[-1][1] != num_layers:
            raise ModelError(f"--stages end at layer {plan.stages[-1][1]} but the model has {num_layers} layers")
        shares = _check_shares(plan, config.get("text_config", config))[role.group] if plan.tensor else None
    except (ModelError, CheckpointError, KeyError, ValueError) as e:
        return _fail(emitter, EXIT_USAGE, f"{type(e).__name__}: {e}")
    try:
        if mlx_size >= 2:
            # init() once per process: MLX caches the group for the life of the process.
            group = mx.distributed.init(backend=args.backend, strict=True)
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError for a group that cannot form
        fault = ring_fault(str(e), mlx_rank, read_hosts(os.environ["MLX_HOSTFILE"])) if args.backend == "ring" else None
        return _fail(emitter, EXIT_FAILED, f"{type(e).__name__}: {e}", fault=fault)
    try:
        t0 = time.monotonic()
        if not plan.tensor:
            shard = load_shard(path, start, end)
        elif shares is not None:
            shard, _ = load_tensor_shard(path, start, end, shares, role.index, group)
        else:
            shard = load_shard(path, start, end, families=TENSOR_FAMILIES)
        load_s = time.monotonic() - t0
        tokenizer = load_tokenizer(path, config) if rank == 0 else None
        if group is not None:  # everyone loaded: the group is formed and usable
            mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group, stream=mx.cpu))
        if group is not None and not plan.tensor:
            # The ring backend's left sockets, to sleep on between steps (ring_wake.py).
            own = read_hosts(os.environ["MLX_HOSTFILE"])[rank] if args.backend == "ring" else []
            link = Link(group, shard.hidden_size, left_sockets(own))
        if plan.tensor:
            assert side is not None
            # Before the watchdog fires, so a peer that never comes is an error event.
            opened = open_side(plan, role, side, group, args.deadline - SIDE_MARGIN_S)
            link, fan = opened.link, opened.fan
    except (ModelError, CheckpointError) as e:
        return _fail(emitter, EXIT_USAGE, f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError for a failed group; report whatever it was
        return _fail(emitter, EXIT_FAILED, f"{type(e).__name__}: {e}")
    faulthandler.cancel_dump_traceback_later()
    emitter.emit(protocol.ready(rank, (start, end), load_s))
    quant, note = kv_cache.setup(args.kv_bits, shard.make_cache(), config)
    if note is not None:
        print(f"serve: {note}", file=sys.stderr, flush=True)
    stage = Stage(shard, quant)
    try:
        if rank != 0:
            assert link is not None
            (serve_member if plan.tensor and not role.head else serve_stage)(stage, link)
        else:
            limits = protocol.Limits(
                max_line_bytes=args.max_line_bytes or protocol.MAX_LINE_BYTES,
                max_prompt_tokens=args.max_prompt_tokens or protocol.MAX_PROMPT_TOKENS,
                max_tokens_cap=args.max_tokens_cap or protocol.MAX_TOKENS_CAP,
            )
            engine = Engine(stage, link, fan)
            scheduler = Scheduler(args.max_batch, args.max_queue, args.prefill_chunk or PREFILL_CHUNK,
                                  args.micro_batches or len(plan.sizes))
            context = int(config.get("text_config", config).get("max_position_embeddings") or 0) or None
            server = Server(engine, tokenizer, shard.vocab_size, limits, context, emitter, scheduler, board)
            server.run(sys.stdin.buffer)
            # Bound the drain: a peer that died after SHUTDOWN left would hang it forever.
            faulthandler.dump_traceback_later(DRAIN_TIMEOUT_S, exit=True)
            engine.shutdown()
    except Exception as e:  # noqa: BLE001 - a dead peer, a desync or a bug: this epoch is over
        return _fail(emitter, EXIT_FAILED, f"{type(e).__name__}: {e}", getattr(e, "request_ids", None))
    return EXIT_OK


SIDE_MARGIN_S = 1.0
"""The side channel stops dialing this long before the watchdog, to say why it failed."""


def _side_addrs(args: argparse.Namespace, plan: Plan, role: Role) -> SideAddrs:
    return side_addrs(plan, role, args.side_listen, args.side_next, args.side_head)


def _check_shares(plan: Plan, config: dict[str, Any]) -> list[Any]:
    """Each group's shares (None for a group of one): --shares, or an even split; a
    TensorShardError (exit 2) when they do not fit the model. Every group is checked, so
    every rank refuses a bad plan alike."""
    from p2pmesh.worker.tensor import check_shares, even_shares

    out: list[Any] = []
    for g, n in enumerate(plan.sizes):
        if n == 1:
            out.append(None)
            continue
        shares = plan.group_shares(g) or even_shares(config, n)
        check_shares(config, shares)
        out.append(shares)
    return out


class RequestFailed(Exception):
    """Generation failed mid-request (the pipeline broke): carries the ids of every request
    it was running. Reported as pipeline_broken, so they resume on the next epoch instead
    of failing."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


STDIN_QUEUE = 256
"""Lines read ahead of the main loop; a fuller queue makes the reader wait (the pipe
then holds the rest), so memory stays bounded whatever the agent writes."""
EOF_ITEM = None


def start_reader(stdin: IO[bytes], limit: int) -> queue.Queue[bytes | LineTooLong | None]:
    """A thread reading stdin lines into a bounded queue, so commands (a cancel, a new
    request) arrive while the batch runs; None marks EOF."""
    q: queue.Queue[bytes | LineTooLong | None] = queue.Queue(maxsize=STDIN_QUEUE)

    def read() -> None:
        while True:
            try:
                line = read_line(stdin, limit)
            except LineTooLong as e:
                q.put(e)
                continue
            except (OSError, ValueError):
                line = None
            q.put(line)
            if line is None:
                return

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return q


@dataclass
class _Text:
    """A request's streaming text and the prompt its first token event carries."""

    prompt: list[int]
    text: ContinuationText


class Server:
    """Rank 0's command loop: requests join and leave a running batch (worker/scheduler.py
    decides the steps, pipeline.Engine runs them), commands are read while it runs."""

    def __init__(self, engine: Any, tokenizer: Any, vocab_size: int, limits: Any, context: int | None, emitter: Emitter,
                 scheduler: Scheduler, board: LoadBoard | None = None) -> None:
        self.engine, self.tokenizer, self.vocab_size = engine, tokenizer, vocab_size
        self.limits, self.context, self.emitter = limits, context, emitter
        self.scheduler = scheduler
        self.board = board if board is not None else LoadBoard()
        self.tokens = 0
        """Tokens generated since the worker started (the heartbeat's counter)."""
        self.texts: dict[str, _Text] = {}
        self.eos = frozenset(self.tokenizer.eos_token_ids or ())
        self.closing = False

    def run(self, stdin: IO[bytes]) -> None:
        """Until {"op": "shutdown"} or EOF and every request taken before it has finished.
        Bad commands get an error event; a failure of the pipeline itself raises (the
        worker cannot continue)."""
        commands = start_reader(stdin, self.limits.max_line_bytes)
        sched, engine = self.scheduler, self.engine
        while True:
            self._take(commands, block=sched.idle and not self.closing)
            self._publish_load()
            if sched.idle:
                if self.closing:
                    return
                continue  # the commands started nothing (refused, cancelled): wait for more
            try:
                steps = sched.plan()
                for step in steps:
                    engine.submit(step)
                if not steps and not engine.pending:
                    raise RuntimeError("the scheduler has requests but nothing to run")
                if engine.pending:
                    self._complete(*engine.collect())
                while engine.ready():
                    self._complete(*engine.collect())
                self._publish_load()
            except Exception as e:  # noqa: BLE001 - report it against the requests, then end the worker
                ids = [*sched.active, *(r.rid for r in sched.queue)]
                raise RequestFailed(f"generation failed: {type(e).__name__}: {e}", ids) from e

    def _publish_load(self) -> None:
        from p2pmesh.worker import protocol

        s = self.scheduler
        self.board.value = protocol.Load(s.running, len(s.queue), self.tokens)

    def _take(self, commands: queue.Queue[bytes | LineTooLong | None], block: bool) -> None:
        """Handle the commands that arrived (waiting for one when there is nothing to run)."""
        from p2pmesh.worker import protocol

        while not self.closing:
            try:
                item = commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, LineTooLong):
                self.emitter.emit(protocol.error(protocol.COMMAND_INVALID, str(item)))
                continue
            if item is None:
                self.closing = True
                return
            if not item.strip():
                continue
            try:
                command = protocol.parse_command(item, self.limits)
            except protocol.CommandError as e:
                code = protocol.REQUEST_INVALID if e.request_id is not None else protocol.COMMAND_INVALID
                self.emitter.emit(protocol.error(code, str(e), e.request_id))
                continue
            if isinstance(command, protocol.Shutdown):
                self.closing = True
            elif isinstance(command, protocol.Cancel):
                finished = self.scheduler.cancel(command.id)
                if finished is not None:
                    self._finished(finished)
            else:
                self.submit(command)

    def submit(self, cmd: Any) -> None:
        from p2pmesh.worker import protocol

        if cmd.prompt_tokens is not None:
            tokens = list(cmd.prompt_tokens)
        else:
            tokens = list(self.tokenizer.encode(cmd.prompt))
        problem = None
        if not tokens:
            problem = "the prompt is empty"
        elif len(tokens) > self.limits.max_prompt_tokens:
            problem = f"the prompt has {len(tokens)} tokens, more than {self.limits.max_prompt_tokens}"
        elif max(tokens) >= self.vocab_size:
            problem = f"prompt token {max(tokens)} is outside the model's vocabulary of {self.vocab_size}"
        elif self.context is not None and len(tokens) >= self.context:
            problem = f"the prompt has {len(tokens)} tokens; the model's context is {self.context}"
        elif self.scheduler.known(cmd.id):
            problem = f"request {cmd.id!r} is already running"
        if problem is not None:
            self.emitter.emit(protocol.error(protocol.REQUEST_INVALID, problem, cmd.id))
            return
        max_new = cmd.max_tokens if self.context is None else min(cmd.max_tokens, self.context - len(tokens))
        sampling = Sampling(cmd.temperature, cmd.top_p, cmd.seed)
        if not self.scheduler.submit(cmd.id, tokens, max_new, sampling, self.eos):
            s = self.scheduler
            self.emitter.emit(protocol.error(protocol.BUSY, f"{s.running} requests running and {len(s.queue)} queued: "
                                             "the worker is full, try again later", cmd.id))
            return
        self.texts[cmd.id] = _Text(tokens, ContinuationText(self.tokenizer.detokenizer, self.tokenizer))

    def _complete(self, step: Any, tokens: list[int]) -> None:
        from p2pmesh.worker import protocol

        for outcome in self.scheduler.complete(step, tokens):
            if isinstance(outcome, Finished):
                self._finished(outcome)
                continue
            t = self.texts[outcome.rid]
            self.tokens += 1
            t.text.detok.add_token(outcome.token)
            self.emitter.emit(protocol.token(outcome.rid, outcome.token, t.text.segment(outcome.token),
                                             t.prompt if outcome.first else None))

    def _finished(self, f: Finished) -> None:
        from p2pmesh.worker import protocol

        t = self.texts.pop(f.rid)
        t.text.detok.finalize()
        self.emitter.emit(protocol.done(f.rid, f.tokens, f.finish, t.text.segment(None)))


class ContinuationText:
    """The text of a generation as the continuation of its prompt. mlx-lm's streaming
    detokenizers drop the space the first generated token starts with (they assume a fresh
    text, as a chat reply is), which glues a completion to its prompt ("plans" + "the" ->
    "plansthe"); the space is put back when the first token's own piece starts with one."""

    SPACE_MARKS = ("\u0120", "\u2581", " ")
    """How a token that starts with a space is spelt: byte-level BPE, SentencePiece, plain."""

    def __init__(self, detok: Any, tokenizer: Any) -> None:
        self.detok, self.tokenizer = detok, tokenizer
        self.first: int | None = None
        self.started = False

    def segment(self, tok: int | None) -> str:
        if self.first is None and tok is not None:
            self.first = tok
        piece = self.detok.last_segment
        if not self.started and piece:
            self.started = True
            if not piece.startswith(" ") and self.first is not None and self._starts_with_space(self.first):
                piece = " " + piece
        return piece

    def _starts_with_space(self, tok: int) -> bool:
        try:
            raw = self.tokenizer.convert_ids_to_tokens(tok)
        except Exception:  # noqa: BLE001 - a tokenizer without the method: keep the detokenizer's text
            return False
        return isinstance(raw, str) and raw.startswith(self.SPACE_MARKS)


if __name__ == "__main__":
    status = main()
    # The stdin reader (a daemon thread) may still wait in readline, holding the buffered
    # reader's lock, and interpreter finalization would then abort: leave without it.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
