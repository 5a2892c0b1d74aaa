"""Worker processes: the agent starts, feeds, watches and stops the MLX workers its data-plane
epochs need (core/dataplane.py decides which; this module only carries it out).

One process per epoch and node (MLX cannot re-form a group inside a process). The worker
protocol is JSON lines (docs/inference.md): events on its stdout become core inputs
(WorkerLoaded, WorkerOutput); requests for the head go to rank 0's stdin. A worker that
stops sending heartbeats is killed: MLX hangs forever on a silent peer, so liveness is the
agent's job. A worker never outlives its agent: every rank writes a heartbeat every 0.5 s
and exits when its stdout is gone (the agent holds the pipe's only read end), and rank 0
exits when its stdin closes. Not PR_SET_PDEATHSIG: Linux sends it when the *thread* that
forked the child ends, and trio forks from its thread cache, whose threads end after 10 s
idle, so the kernel killed healthy workers seconds after they started (`spawn_options`).

Which workers are wanted comes from the ClusterView (committed, durable state): the
supervisor reconciles on every new snapshot, and on a period only to catch hung workers.
What to start, stop or declare hung, and what each event means to the core, is decided by
core/supervision.py's WorkerBook (sans I/O, also driven by the simulator's fake workers);
this module owns the processes, their pipes and their files.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent.models import model_dir
from p2pmesh.agent.ports import ClusterView, Inbox
from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.node_io import WorkerLoaded, WorkerOutput
from p2pmesh.core.protocol import BATCH_REQUESTS_DEFAULT, QUEUE_REQUESTS_DEFAULT
from p2pmesh.core.mlx_hostfile import (
    MlxConfigError,
    epoch_ports,
    jaccl_coordinator,
    jaccl_devices,
    ring_hostfile,
)
from p2pmesh.core.serving import WorkerCancel, WorkerCommand
from p2pmesh.core.tensor_launch import rank_launch
from p2pmesh.core.supervision import (  # noqa: F401 - request_outcome: re-exported
    HEARTBEAT_TIMEOUT_S,
    PROGRESS_TIMEOUT_S,
    WatchedWorker,
    WorkerBook,
    group_hops,
    request_outcome,
)

log = logging.getLogger("p2pmesh.workers")

HANG_CHECK_S = 1.0
"""How often the workers' heartbeats are checked when nothing else wakes the supervisor (a
worker hangs outside the cluster's knowledge: this period is why it has a timeout)."""
STOP_GRACE_S = 3.0
LINE_BYTES_MAX = 1 << 20


def worker_command(model: str, stages: Any, rank: int, backend: str, config: WorkersConfig, batch: int | None = None,
                   extra: Sequence[str] = (), kv_bits: int = 0) -> list[str]:
    """The command line of one rank's worker process (worker/serve.py): it serves the
    placement's batch (the requests whose KV cache the placement reserved) at most, and this
    agent's --max-batch at most; ``extra``: the tensor groups' options (GroupLaunch.args);
    ``kv_bits``: the placement's KV cache bits (0: full precision, no option)."""
    max_batch = config.max_batch if batch is None else max(1, min(config.max_batch, batch))
    quantized = ["--kv-bits", str(kv_bits)] if kv_bits else []
    return [sys.executable, "-m", "p2pmesh.worker.serve", "--model", model, "--stages", json.dumps(stages),
            "--rank", str(rank), "--backend", backend,
            "--max-batch", str(max_batch), "--max-queue", str(config.max_queue), *quantized, *extra]


@dataclass
class _Worker:
    """A running worker process and what the book knows of it."""

    watch: WatchedWorker
    process: trio.Process
    stdin_lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def epoch(self) -> int:
        return self.watch.epoch


@dataclass(frozen=True)
class GroupLaunch:
    """How a worker joins its epoch's group: the backend, environment, and files to write."""

    backend: str
    env: dict[str, str]
    files: dict[str, str]
    """name -> JSON content; written per epoch, their paths go into ``file_env[name]``."""
    file_env: dict[str, str]
    args: tuple[str, ...] = ()
    """Options for the worker's command line (tensor groups: core/tensor_launch.py)."""


def group_launch(want: dataplane.WantedWorker, hops: Any, base_port: int, members: Any) -> GroupLaunch:
    """JACCL (RDMA) when every hop of the group is RDMA-capable (Thunderbolt 5 with RDMA
    enabled on both ends), else MLX's ring backend over TCP. Each rank's port comes from its
    own member's committed data port (`base_port`, this agent's --data-port, only for a
    member that published none). Raises MlxConfigError when the hops lack what the backend
    needs (an address, an interface).

    A pipeline: one group of all ranks. With tensor groups: one MLX group per tensor group
    (its own ring; a rank alone has none), and the side channel's options (WORKER CONTRACT,
    docs/inference.md "Tensor groups")."""
    tensor = rank_launch(want.stages, want.rank, hops, members, want.epoch, base_port)
    if tensor is None:
        order = [s.node_id for s in want.stages]
        return _mlx_group(order, want.rank, hops, epoch_ports(order, members, want.epoch, base_port), members, base_port)
    if len(tensor.order) == 1:
        return GroupLaunch("ring", {}, {}, {}, tensor.args)
    launch = _mlx_group(list(tensor.order), tensor.index, tensor.hops, tensor.ports, members, base_port)
    return replace(launch, args=tensor.args)


def _mlx_group(order: list[NodeId], rank: int, hops: Any, ports: Sequence[int], members: Any, base_port: int) -> GroupLaunch:
    """The backend, env and files of one MLX group: ``order`` with ``hops`` its ring."""
    env = {"MLX_RANK": str(rank)}
    devices = jaccl_devices(order, hops)
    if devices is not None:
        rank0 = next((m for m in members if m.node_id == order[0]), None)
        address = next((a.rsplit(":", 1)[0] for a in (rank0.addresses if rank0 else ()) if a.count(":") == 1), None)
        env["MLX_JACCL_COORDINATOR"] = jaccl_coordinator(order, hops, ports[0], rank0_address=address)
        env["MLX_JACCL_RING"] = "1"  # our groups follow the ring: neighbours only
        return GroupLaunch("jaccl", env, {"devices": json.dumps(devices)}, {"devices": "MLX_IBV_DEVICES"})
    hostfile = ring_hostfile(order, hops, base_port, ports=ports)
    return GroupLaunch("ring", env, {"hostfile": json.dumps(hostfile)}, {"hostfile": "MLX_HOSTFILE"})


def spawn_options() -> dict[str, Any]:
    """How a worker process is started besides its command, pipes and environment: nothing
    that ties its life to the starting thread (trio.lowlevel.open_process forks from a
    cached worker thread that ends when idle; the module comment says what ends a worker)."""
    return {}


@dataclass(frozen=True, slots=True)
class WorkersConfig:
    """What the supervisor needs of the agent's configuration."""

    node_id: NodeId
    state_dir: Path
    """Hostfiles and worker logs go to ``<state_dir>/workers/``; copied models are here too."""
    base_port: int
    """This agent's --data-port (for a member that published none)."""
    model_root: Path | None = None
    max_batch: int = BATCH_REQUESTS_DEFAULT
    """Passed to the head worker (--max-batch): requests served at once."""
    max_queue: int = QUEUE_REQUESTS_DEFAULT
    """Passed to the head worker (--max-queue): requests waiting for a slot."""


class Supervisor:
    def __init__(self, view: ClusterView, inbox: Inbox, config: WorkersConfig) -> None:
        self.view = view
        self.inbox = inbox
        self.config = config
        self.book = WorkerBook(config.node_id)
        """What runs, what failed, and what each event means (core/supervision.py)."""
        self.workers: dict[int, _Worker] = {}
        """epoch -> its process: the ones ``book.workers`` watches."""

    # ------------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                seen = -1
                while True:  # for the agent's lifetime: on each new snapshot, or to check heartbeats
                    snapshot = await self.view.changed(seen, timeout_s=HANG_CHECK_S)
                    seen = snapshot.version
                    await self._reconcile(nursery)
            finally:
                with trio.CancelScope(shield=True):
                    for w in list(self.workers.values()):
                        await self._stop(w)

    async def _reconcile(self, nursery: trio.Nursery) -> None:
        state = self.view.current.state
        if state is None:
            return
        moves = self.book.reconcile(state, trio.current_time())
        for watch in moves.stop:
            nursery.start_soon(self._stop, self.workers.pop(watch.epoch))
        for watch in moves.hung:
            log.warning("worker of epoch %d is hung (no heartbeat for %.0f s or no progress for %.0f s): stopping it",
                        watch.epoch, HEARTBEAT_TIMEOUT_S, PROGRESS_TIMEOUT_S)
            nursery.start_soon(self._stop, self.workers.pop(watch.epoch))
        for crash in moves.crashed:
            await self.inbox.put(crash)
        for want in moves.start:
            await self._start(nursery, want, group_hops(state, want.epoch), state.members)

    async def _start(self, nursery: trio.Nursery, want: dataplane.WantedWorker, hops: Any, members: Any) -> None:
        cfg_dir = self.config.state_dir / "workers"
        cfg_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # hostfiles and worker logs: the owner's only
        env = dict(os.environ)
        stages = [[s.start, s.end] for s in want.stages]
        backend = "ring"
        args: tuple[str, ...] = ()
        if len(want.stages) >= 2:
            try:
                launch = group_launch(want, hops, self.config.base_port, members)
            except MlxConfigError as exc:
                log.warning("cannot start the worker of epoch %d: %s", want.epoch, exc)
                await self.inbox.put(self.book.could_not_start(want.epoch))
                return
            backend, args = launch.backend, launch.args
            for name, content in launch.files.items():
                path = cfg_dir / f"{name}-{want.epoch}.json"
                path.write_text(content, encoding="utf-8")
                env[launch.file_env[name]] = str(path)
            env.update(launch.env)
        model = model_dir(want.model, self.config.model_root, self.config.state_dir)
        cmd = worker_command(model, stages, want.rank, backend, self.config, want.batch, args, want.kv_bits)
        log_file = open(cfg_dir / f"worker-{want.epoch}.log", "ab")  # noqa: SIM115 - owned by the process
        try:
            process = await trio.lowlevel.open_process(
                cmd, stdin=-1, stdout=-1, stderr=log_file, env=env, **spawn_options()  # -1: subprocess.PIPE
            )
        finally:
            log_file.close()
        worker = _Worker(self.book.started(want, trio.current_time()), process)
        self.workers[want.epoch] = worker
        log.info("started the worker of epoch %d: rank %d of %d, layers %s", want.epoch, want.rank, len(stages), stages[want.rank])
        nursery.start_soon(self._read_events, worker)

    async def _read_events(self, w: _Worker) -> None:
        stream = w.process.stdout
        assert stream is not None
        buffer = b""
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            if len(buffer) > LINE_BYTES_MAX and b"\n" not in buffer:
                log.warning("worker of epoch %d wrote an oversized line: dropped", w.epoch)
                buffer = b""
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                await self._event(w, line)
        code = await w.process.wait()
        crash = self.book.exited(w.watch)
        if crash is not None:
            if self.workers.get(w.epoch) is w:
                del self.workers[w.epoch]
            log.warning("the worker of epoch %d exited with %s", w.epoch, code)
            await self.inbox.put(crash)

    async def _event(self, w: _Worker, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind = event["event"]
        except (ValueError, KeyError, TypeError):
            log.debug("worker of epoch %d: not an event: %r", w.epoch, line[:200])
            return
        watch = w.watch
        got = self.book.heard(watch, event, trio.current_time())
        if isinstance(got, WorkerLoaded):
            log.info("worker of epoch %d ready (rank %d, loaded in %.2f s)", w.epoch, watch.rank, float(event.get("load_s") or 0))
        elif isinstance(got, WorkerOutput) and got.broken:
            log.warning("worker of epoch %d: %s (%s): the request resumes on the next epoch",
                        w.epoch, event.get("message"), event.get("code"))
        elif got is None and kind == "error":
            if watch.fault is not None:
                f = watch.fault
                log.warning("worker of epoch %d cannot form its ring: %s (node %s at %s:%d): %s",
                            w.epoch, f.code, f.node_id, f.address, f.port, f.message)
            else:
                log.warning("worker of epoch %d: %s", w.epoch, event.get("message"))
        if got is not None:
            await self.inbox.put(got)

    async def submit(self, s: WorkerCommand) -> None:
        """Hand a request to the local head worker of its epoch (rank 0), or tell it to stop
        one whose client hung up (the worker answers that one's end with finish "cancelled")."""
        ident = f"{s.req}@{s.attempt}"
        w = self.workers.get(s.epoch)
        held = self.book.head(s.epoch) if isinstance(s, WorkerCancel) else self.book.submit(s.epoch, ident, trio.current_time())
        if w is None or w.process.stdin is None or held is None:
            # The epoch's head worker is gone (reported as WorkerCrashed): the request waits
            # with its origin for the next epoch, not the client's error.
            log.info("request %s: no head worker for epoch %d here", s.req, s.epoch)
            return
        if isinstance(s, WorkerCancel):
            log.info("request %s: its client hung up; cancelling it in the worker of epoch %d", s.req, s.epoch)
            line = json.dumps({"op": "cancel", "id": ident}).encode() + b"\n"
        else:
            p = s.params
            line = json.dumps({
                "op": "generate", "id": ident, "prompt": p.prompt, "prompt_tokens": list(p.prompt_tokens) or None,
                "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
            }).encode() + b"\n"
        async with w.stdin_lock:
            try:
                await w.process.stdin.send_all(line)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("request %s: the head worker of epoch %d is gone", s.req, s.epoch)

    async def _stop(self, w: _Worker) -> None:
        """Ask a worker to drain and exit; kill it if it does not within the grace time."""
        p = w.process
        if p.returncode is None and p.stdin is not None and w.watch.rank == 0:
            with trio.move_on_after(0.5):
                try:
                    await p.stdin.send_all(b'{"op": "shutdown"}\n')
                    await p.stdin.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            await p.wait()
        if p.returncode is None:
            p.kill()
            with trio.move_on_after(STOP_GRACE_S):
                await p.wait()
        log.info("worker of epoch %d stopped (%s)", w.epoch, p.returncode)
