"""Worker processes: the agent starts, feeds, watches and stops the MLX workers its data-plane
epochs need (core/dataplane.py decides which; this module only carries it out).

One process per epoch and node (MLX cannot re-form a group inside a process). The worker
protocol is JSON lines (docs/inference.md): events on its stdout become core inputs
(WorkerLoaded, WorkerOutput); requests for the head go to rank 0's stdin. A worker that
stops sending heartbeats is killed: MLX hangs forever on a silent peer, so liveness is the
agent's job. A worker never outlives its agent: on Linux the kernel kills it when the agent
dies (PR_SET_PDEATHSIG); everywhere, rank 0 exits when its stdin closes.

Which workers are wanted comes from the ClusterView (committed, durable state): the
supervisor reconciles on every new snapshot, and on a period only to catch hung workers.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pmesh.agent.models import model_dir
from p2pmesh.agent.ports import ClusterView, Inbox
from p2pmesh.core import dataplane
from p2pmesh.core.ids import NodeId
from p2pmesh.core.node_io import WorkerCrashed, WorkerLoaded, WorkerOutput
from p2pmesh.core.messages import WorkerFault
from p2pmesh.core.protocol import BATCH_REQUESTS_DEFAULT, QUEUE_REQUESTS_DEFAULT, ErrorCode
from p2pmesh.core.validate import FAULT_MESSAGE_MAX
from p2pmesh.core.mlx_hostfile import (
    MlxConfigError,
    epoch_ports,
    jaccl_coordinator,
    jaccl_devices,
    ring_hostfile,
)
from p2pmesh.core.serving import WorkerCancel, WorkerCommand
from p2pmesh.worker import protocol

log = logging.getLogger("p2pmesh.workers")

HANG_CHECK_S = 1.0
"""How often the workers' heartbeats are checked when nothing else wakes the supervisor (a
worker hangs outside the cluster's knowledge: this period is why it has a timeout)."""
HEARTBEAT_TIMEOUT_S = 10.0
"""A worker silent this long is hung (a worker sends one every 0.5 s, from a thread)."""
PROGRESS_TIMEOUT_S = 120.0
"""A head with a request that produced nothing for this long is hung inside MLX (a silent
peer: its heartbeat thread still runs, so heartbeats alone cannot tell). Long, because a
long prompt's prefill produces nothing for a while; a Mac that dies or sleeps is caught
much sooner by failure detection, which moves the cluster to a new epoch."""
STOP_GRACE_S = 3.0
LINE_BYTES_MAX = 1 << 20


def request_outcome(kind: str, worker_code: object) -> tuple[bool, str]:
    """(broken, client code) for a request's event from its head worker. Only the request's
    own fault ends it: request_invalid is about the prompt (worker/serve.py: the edge already
    checked every other field against the same limits, core/protocol.py), busy means the
    worker's batch and queue are full (the client may retry shortly). Any other error under a
    request (a peer is gone, or a code we do not know) is the epoch's: the core resumes it."""
    if kind != "error":
        return False, ""
    if worker_code == protocol.BUSY:
        return False, ErrorCode.BUSY
    if worker_code == protocol.REQUEST_INVALID:
        return False, ErrorCode.PROMPT_REFUSED
    return True, ErrorCode.PROMPT_REFUSED


def worker_command(model: str, stages: Any, rank: int, backend: str, config: WorkersConfig, batch: int | None = None) -> list[str]:
    """The command line of one rank's worker process (worker/serve.py): it serves the
    placement's batch (the requests whose KV cache the placement reserved) at most, and this
    agent's --max-batch at most."""
    max_batch = config.max_batch if batch is None else max(1, min(config.max_batch, batch))
    return [sys.executable, "-m", "p2pmesh.worker.serve", "--model", model, "--stages", json.dumps(stages),
            "--rank", str(rank), "--backend", backend,
            "--max-batch", str(max_batch), "--max-queue", str(config.max_queue)]


@dataclass
class _Worker:
    epoch: int
    rank: int
    process: trio.Process
    started: float
    last_heartbeat: float
    ready: bool = False
    stdin_lock: trio.Lock = field(default_factory=trio.Lock)
    pending: set[str] = field(default_factory=set)
    """Requests handed to this (head) worker and not finished."""
    progress: float = 0.0
    """When it last produced output for a request (or was given one while idle)."""
    order: tuple[NodeId, ...] = ()
    """The epoch's members in rank order (to name the peer of a fault)."""
    fault: WorkerFault | None = None
    """Why it could not form its group, when it said so before exiting."""


@dataclass(frozen=True)
class GroupLaunch:
    """How a worker joins its epoch's group: the backend, environment, and files to write."""

    backend: str
    env: dict[str, str]
    files: dict[str, str]
    """name -> JSON content; written per epoch, their paths go into ``file_env[name]``."""
    file_env: dict[str, str]


def group_launch(want: dataplane.WantedWorker, hops: Any, base_port: int, members: Any) -> GroupLaunch:
    """JACCL (RDMA) when every hop of the group is RDMA-capable (Thunderbolt 5 with RDMA
    enabled on both ends), else MLX's ring backend over TCP. Each rank's port comes from its
    own member's committed data port (`base_port`, this agent's --data-port, only for a
    member that published none). Raises MlxConfigError when the hops lack what the backend
    needs (an address, an interface)."""
    order = [s.node_id for s in want.stages]
    ports = epoch_ports(order, members, want.epoch, base_port)
    env = {"MLX_RANK": str(want.rank)}
    devices = jaccl_devices(order, hops)
    if devices is not None:
        rank0 = next((m for m in members if m.node_id == order[0]), None)
        address = next((a.rsplit(":", 1)[0] for a in (rank0.addresses if rank0 else ()) if a.count(":") == 1), None)
        env["MLX_JACCL_COORDINATOR"] = jaccl_coordinator(order, hops, ports[0], rank0_address=address)
        env["MLX_JACCL_RING"] = "1"  # our groups follow the ring: neighbours only
        return GroupLaunch("jaccl", env, {"devices": json.dumps(devices)}, {"devices": "MLX_IBV_DEVICES"})
    hostfile = ring_hostfile(order, hops, base_port, ports=ports)
    return GroupLaunch("ring", env, {"hostfile": json.dumps(hostfile)}, {"hostfile": "MLX_HOSTFILE"})


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


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
        self.workers: dict[int, _Worker] = {}
        self.failed: set[int] = set()
        """Epochs whose worker failed here: not restarted (the group cannot re-form with
        one new rank); the leader moves the cluster to a new epoch instead."""

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
        wanted = {w.epoch: w for w in dataplane.wanted_workers(state, self.config.node_id)}
        for epoch, w in list(self.workers.items()):
            if epoch not in wanted:
                del self.workers[epoch]
                nursery.start_soon(self._stop, w)
            elif trio.current_time() - w.last_heartbeat > HEARTBEAT_TIMEOUT_S or (
                w.pending and trio.current_time() - w.progress > PROGRESS_TIMEOUT_S
            ):
                log.warning("worker of epoch %d is hung (no heartbeat for %.0f s or no progress for %.0f s): stopping it",
                            epoch, HEARTBEAT_TIMEOUT_S, PROGRESS_TIMEOUT_S)
                del self.workers[epoch]
                self.failed.add(epoch)
                nursery.start_soon(self._stop, w)
                await self.inbox.put(WorkerCrashed(epoch))
        for epoch, want in wanted.items():
            if epoch not in self.workers and epoch not in self.failed:
                hops = state.placement_hops if epoch == state.placement_epoch else state.active_hops
                await self._start(nursery, want, hops, state.members)

    async def _start(self, nursery: trio.Nursery, want: dataplane.WantedWorker, hops: Any, members: Any) -> None:
        cfg_dir = self.config.state_dir / "workers"
        cfg_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # hostfiles and worker logs: the owner's only
        env = dict(os.environ)
        stages = [[s.start, s.end] for s in want.stages]
        backend = "ring"
        if len(want.stages) >= 2:
            try:
                launch = group_launch(want, hops, self.config.base_port, members)
            except MlxConfigError as exc:
                log.warning("cannot start the worker of epoch %d: %s", want.epoch, exc)
                self.failed.add(want.epoch)
                await self.inbox.put(WorkerCrashed(want.epoch))
                return
            backend = launch.backend
            for name, content in launch.files.items():
                path = cfg_dir / f"{name}-{want.epoch}.json"
                path.write_text(content, encoding="utf-8")
                env[launch.file_env[name]] = str(path)
            env.update(launch.env)
        model = model_dir(want.model, self.config.model_root, self.config.state_dir)
        cmd = worker_command(model, stages, want.rank, backend, self.config, want.batch)
        log_file = open(cfg_dir / f"worker-{want.epoch}.log", "ab")  # noqa: SIM115 - owned by the process
        try:
            process = await trio.lowlevel.open_process(
                cmd, stdin=-1, stdout=-1, stderr=log_file, env=env, preexec_fn=_die_with_parent  # -1: subprocess.PIPE
            )
        finally:
            log_file.close()
        now = trio.current_time()
        worker = _Worker(want.epoch, want.rank, process, now, now, order=tuple(s.node_id for s in want.stages))
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
        if self.workers.get(w.epoch) is w:
            del self.workers[w.epoch]
            self.failed.add(w.epoch)
            log.warning("the worker of epoch %d exited with %s", w.epoch, code)
            await self.inbox.put(WorkerCrashed(w.epoch, w.fault))

    async def _event(self, w: _Worker, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind = event["event"]
        except (ValueError, KeyError, TypeError):
            log.debug("worker of epoch %d: not an event: %r", w.epoch, line[:200])
            return
        w.last_heartbeat = trio.current_time()
        inbox = self.inbox
        if kind == "ready":
            w.ready = True
            log.info("worker of epoch %d ready (rank %d, loaded in %.2f s)", w.epoch, w.rank, float(event.get("load_s") or 0))
            await inbox.put(WorkerLoaded(w.epoch))
        elif kind in ("token", "done", "error") and event.get("id") is not None:
            req, _, attempt = str(event["id"]).rpartition("@")
            done = kind != "token"
            w.progress = trio.current_time()
            if done:
                w.pending.discard(str(event["id"]))
            tokens = (int(event["token"]),) if kind == "token" else ()
            finish = str(event.get("finish") or ("error" if kind == "error" else ""))
            text = str(event.get("text") or event.get("message") or "")
            prompt = tuple(int(t) for t in event.get("prompt_tokens") or ())
            broken, code = request_outcome(kind, event.get("code"))
            if broken:
                log.warning("worker of epoch %d: %s (%s): the request resumes on the next epoch",
                            w.epoch, event.get("message"), event.get("code"))
            await inbox.put(WorkerOutput(w.epoch, req, tokens, text, done, finish, prompt,
                                          int(attempt) if attempt.isdigit() else 0, broken, code))
        elif kind == "error":
            w.fault = self._fault(w, event) if not w.ready else None
            if w.fault is not None:
                f = w.fault
                log.warning("worker of epoch %d cannot form its ring: %s (node %s at %s:%d): %s",
                            w.epoch, f.code, f.node_id, f.address, f.port, f.message)
            else:
                log.warning("worker of epoch %d: %s", w.epoch, event.get("message"))

    def _fault(self, w: _Worker, event: dict[str, Any]) -> WorkerFault | None:
        """The worker's fault (worker/protocol.py error) with the rank at fault named by its
        node id, or None when it sent none or a malformed one."""
        f = event.get("fault")
        if not isinstance(f, dict):
            return None
        code, rank, address, port = f.get("code"), f.get("rank"), f.get("address"), f.get("port")
        if not (isinstance(code, str) and isinstance(address, str) and type(rank) is int and type(port) is int
                and 0 <= rank < len(w.order) and 0 <= port <= 65535 and len(code) <= 64 and len(address) <= 256):
            return None
        message = str(event.get("message") or "")[:FAULT_MESSAGE_MAX]
        return WorkerFault(code, w.order[rank], address, port, self.config.node_id, w.epoch, message)

    async def submit(self, s: WorkerCommand) -> None:
        """Hand a request to the local head worker of its epoch (rank 0), or tell it to stop
        one whose client hung up (the worker answers that one's end with finish "cancelled")."""
        w = self.workers.get(s.epoch)
        if w is None or w.rank != 0 or w.process.stdin is None:
            # The epoch's head worker is gone (reported as WorkerCrashed): the request waits
            # with its origin for the next epoch, not the client's error.
            log.info("request %s: no head worker for epoch %d here", s.req, s.epoch)
            return
        worker_id = f"{s.req}@{s.attempt}"
        if isinstance(s, WorkerCancel):
            log.info("request %s: its client hung up; cancelling it in the worker of epoch %d", s.req, s.epoch)
            line = json.dumps({"op": "cancel", "id": worker_id}).encode() + b"\n"
        else:
            p = s.params
            line = json.dumps({
                "op": "generate", "id": worker_id, "prompt": p.prompt, "prompt_tokens": list(p.prompt_tokens) or None,
                "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
            }).encode() + b"\n"
            if not w.pending:
                w.progress = trio.current_time()
            w.pending.add(worker_id)
        async with w.stdin_lock:
            try:
                await w.process.stdin.send_all(line)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("request %s: the head worker of epoch %d is gone", s.req, s.epoch)

    async def _stop(self, w: _Worker) -> None:
        """Ask a worker to drain and exit; kill it if it does not within the grace time."""
        p = w.process
        if p.returncode is None and p.stdin is not None and w.rank == 0:
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
