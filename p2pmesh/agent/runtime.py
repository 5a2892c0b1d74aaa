"""The agent's runtime: one trio task owns the core Machine; drivers feed it inputs and carry
out its effects; the tasks (agent/tasks/) get ports (agent/ports.py), never this class.

The loop, for every input (a frame, a discovered peer, a timer, a control request):
  ready = machine.handle(input, now_ms)   # consensus output only
  storage.save(ready)          # durable part, fsynced, BEFORE anything leaves
  transport.send(messages)     # then the messages
  effects = machine.advance(ready)        # the core learns what is on disk
  act on applied entries, reads, left and the effects (events, worker submits, client tokens)
  publish a new ClusterView snapshot   # what tasks and status may act on: durable only
Timers: the loop waits on the inbox until machine.next_deadline_ms(), then feeds TimerFired.
Every other task (listeners, dialers, the control socket, the agent's tasks) only puts
inputs into the one bounded inbox, so the core needs no locks.

Only this module (and the package's __init__, which re-exports it) names the Agent class;
the control socket (drivers/control.py) and the HTTP API see it through narrow protocols.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import random
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from p2pmesh.agent import models
from p2pmesh.agent.config import AgentConfig
from p2pmesh.agent.http import serve_http
from p2pmesh.agent.ports import HubDownloads, Inbox, Snapshot, ViewPublisher
from p2pmesh.agent.status import status_json
from p2pmesh.agent.tasks import fetch, links, measure, pairing, peer_copy
from p2pmesh.agent.tasks.workers import Supervisor, WorkersConfig
from p2pmesh.core import transfers, validate, wire
from p2pmesh.core.errors import LocalProtocolError
from p2pmesh.core.identity import Identity
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import (
    FrameReceived,
    Input,
    GenerateCancelled,
    GenerateRequested,
    LeaveRequested,
    Machine,
    PeerDiscovered,
    ProposalRequested,
    ReadRequested,
    Ready,
    TimerFired,
)
from p2pmesh.core.messages import Capabilities, FetchReport, LoadReport, SetModel
from p2pmesh.core import protocol
from p2pmesh.core.protocol import ErrorCode, RequestInvalid, error_answer
from p2pmesh.core.placement import PARALLELISM_CHOICES
from p2pmesh.core.serving import LOAD_STALE_MS, ClientEvent, GenerateParams
from p2pmesh.drivers import control, files, keys
from p2pmesh.drivers.storage import Storage
from p2pmesh.core.advert import Advert
from p2pmesh.core.wire import PROTOCOL_VERSION
from p2pmesh.drivers.discovery import Discovery, DiscoveryConfig, interface_addresses
from p2pmesh.drivers.tls import Credentials, cluster_fingerprint
from p2pmesh.drivers.transport import Transport

log = logging.getLogger("p2pmesh.agent")

INBOX_LEN_MAX = 4096
DEFAULT_CONTEXT_TOKENS = protocol.CONTEXT_TOKENS_DEFAULT
CLIENT_EVENTS_MAX = 8192
READ_TIMEOUT_S = 5.0
"""A linearizable read that no leader confirmed in this time fails (the client retries)."""
READS_PENDING_MAX = 256
LOG_ENTRIES_MAX = 256


def _capabilities(data_port: int) -> Capabilities:
    """What this machine offers (memory and chip; the Metal working-set limit comes with
    the inference issue) and where its workers listen: the data port goes into the
    committed member record, so every member renders this Mac's ranks at its own port."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return Capabilities(int(memory), platform.processor() or platform.machine(), data_port)


_CHANGED_CLUSTERS = error_answer(ErrorCode.RETRY, "this agent changed clusters during the read; retry")


@dataclass(slots=True)
class _PendingRead:
    """A control client's linearizable read, waiting for the core's ReadIndex answer."""

    cluster: ClusterId
    done: trio.Event
    answer: dict[str, Any] | None = None


class Agent:
    """A running agent: the machine, its storage and its transport."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.storage = Storage.open(config.state_dir)
        seed = self.storage.load_identity_seed()
        if seed is None:
            seed = os.urandom(32)
            self.storage.save_identity_seed(seed)
        self.identity = Identity.from_seed(seed)
        self.cluster_key = keys.load_or_create(config.state_dir, config.cluster_key_file)
        self.credentials = Credentials.issue(self.identity, self.cluster_key)
        self.rng = random.Random(os.urandom(16))
        self.inbox_send, self.inbox = trio.open_memory_channel[Input](INBOX_LEN_MAX)
        self.machine: Machine | None = None
        self.transport: Transport | None = None
        self.left = trio.Event()
        self.new_key: bytes | None = None
        """A cluster key pairing received (p2pmesh/agent/tasks/pairing.py): the agent stops, forgets its
        one-Mac cluster, installs the key and starts again (run_agent)."""
        self.finished = trio.Event()
        """Set when the core loop has ended: a completed leave, or a new key to start over with."""
        self.restartable = False
        """Whether whoever runs this agent starts it again after a new key (run_agent does)."""
        self.discovery: Discovery | None = None
        self.bound_port = 0
        self.control_active = 0
        self.started_ms = 0
        self.clients: dict[str, trio.MemorySendChannel[ClientEvent]] = {}
        self._load: tuple[LoadReport | None, int] = (None, 0)
        """The serving head's batch report and when the core made or heard it."""
        self._transfers: dict[NodeId, tuple[FetchReport, int]] = {}
        """Each member's latest fetch report and when the core made or heard it (core/transfers.py)."""
        self.hub_downloads = HubDownloads(lambda: transfers.hub_downloads(self._transfers, self.identity.node_id,
                                                                           self.now_ms()))
        """The files other Macs are downloading from the hub: the fetch task's port."""
        self._publisher = ViewPublisher(self.identity.node_id)
        self.view = self._publisher.view
        """What the tasks read: committed state that is on disk (agent/ports.py)."""
        self.inbox_port = Inbox(self.inbox_send)
        self.places = peer_copy.ModelPlaces(config.state_dir, config.model_root)
        self.supervisor = Supervisor(self.view, self.inbox_port, WorkersConfig(
            self.identity.node_id, config.state_dir, config.data_port_base, config.model_root,
            config.max_batch, config.max_queue))
        self._pairing: pairing.Pairing | None = None
        """Set once the agent listens (pairing's host listens at the bound port + 3)."""
        self._requests = 0
        self.reads: dict[int, _PendingRead] = {}
        self._read_ctx = 0
        self._acted: tuple[ClusterId, int, int] | None = None
        """(cluster, incarnation, commit index) as of the last Ready whose durable part is saved: what
        may be shown as committed (the leader counts its own entries before they are on disk,
        so the live commit index can run ahead of the persistence contract)."""

    def interface_advert(self, port: int) -> tuple[str, ...]:
        """The control-plane addresses of this Mac's interfaces (``--interface`` ones only
        when given), with the agent's port: what a wildcard listener is reachable at."""
        return tuple(_dial(a, port) for a in interface_addresses(self.config.interfaces, include_loopback=False))

    async def _serve_model_files(self, nursery: trio.Nursery, listeners: list[trio.SocketListener],
                                 server_ctx: ssl.SSLContext) -> None:
        """Serve this Mac's model files to the other members (drivers/files.py) on every
        listen address at its port + FILES_PORT_OFFSET. A port already taken costs only
        this Mac's ability to share models, not the agent."""
        file_listeners: list[trio.SocketListener] = []
        for address, listener in zip(self.config.listen, listeners):
            host, _ = _split(address)
            port = listener.socket.getsockname()[1] + peer_copy.FILES_PORT_OFFSET
            try:
                file_listeners += await trio.open_tcp_listeners(port, host=host or None)
            except OSError as exc:
                log.warning("cannot share model files on %s port %d: %s", host or "*", port, exc)
        if file_listeners:
            await nursery.start(partial(files.serve_files, tls_only=self.config.copy_over_tls), file_listeners, server_ctx,
                                lambda name: peer_copy.lookup(self.view, self.places, name))

    @staticmethod
    def now_ms() -> int:
        return int(trio.current_time() * 1000)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        listeners: list[trio.SocketListener] = []
        for address in cfg.listen:
            host, port = _split(address)
            listeners += await trio.open_tcp_listeners(port, host=host or None)
        bound_port = self.bound_port = listeners[0].socket.getsockname()[1]
        fixed = cfg.advertise or tuple(
            f"{_split(a)[0]}:{l.socket.getsockname()[1]}" for a, l in zip(cfg.listen, listeners) if _split(a)[0] not in _WILDCARDS
        )
        advertise = fixed or self.interface_advert(bound_port)
        server_ctx, client_ctx = self.credentials.contexts()
        self.transport = Transport(
            me=self.identity.node_id, server_ctx=server_ctx, client_ctx=client_ctx, inbox=self.inbox_send, rng=self.rng
        )
        # With no address yet (a cable still coming up), peers learn ours from mDNS.
        log.info("agent %s listening on %s (state %s)", self.identity.node_id, ", ".join(advertise) or f"port {bound_port}", cfg.state_dir)
        caps = _capabilities(cfg.data_port_base)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.transport.run, listeners)
            await self._serve_model_files(nursery, listeners, server_ctx)
            for peer in cfg.peers:
                nursery.start_soon(self.transport.dial_static, peer)
            if cfg.mdns:
                me = Advert(self.identity.node_id, PROTOCOL_VERSION, cluster_fingerprint(self.cluster_key), caps.memory_bytes, caps.chip)
                self.discovery = Discovery(DiscoveryConfig(me, bound_port, cfg.interfaces), self.inbox_send)
                await nursery.start(self.discovery.run)
            # Boot the core only once discovery browses: its formation wait (who founds the
            # cluster) must count from when peers can be seen, not from process start.
            persisted = await trio.to_thread.run_sync(self.storage.load)
            self.machine, ready = Machine.boot(
                node_id=self.identity.node_id,
                persisted=persisted,
                settings=cfg.settings,
                rng=self.rng,
                now_ms=self.now_ms(),
                addresses=advertise,
                caps=caps,
            )
            discovery = self.discovery
            self._pairing = pairing.Pairing(
                self.view, pairing.PairingConfig(self.identity.node_id, self.cluster_key, bound_port, cfg.cluster_key_file),
                self.adopt_cluster_key, (lambda: discovery.strangers) if discovery is not None else None)
            await nursery.start(control.serve, cfg.socket_path, self)
            if cfg.http is not None:
                await nursery.start(partial(serve_http, self, cfg.http.host, cfg.http.port, token=cfg.http.token,
                                            model_root=cfg.model_root, state_dir=cfg.state_dir))
            # The tasks: each gets the view, the inbox and its own config, never this object.
            inbox, view = self.inbox_port, self.view
            copier = peer_copy.PeerCopy(view, self.places, client_ctx, over_tls=cfg.copy_over_tls,
                                        hub_downloads=self.hub_downloads)
            nursery.start_soon(links.watch_ports, inbox, cfg.interfaces)
            nursery.start_soon(links.probes, view, inbox, links.ProbeConfig(
                bound_port + links.PROBE_PORT_OFFSET, *self.credentials.contexts(),
                transport_hosts=tuple(h for h in (_split(a)[0] for a in cfg.listen) if h not in _WILDCARDS)))
            nursery.start_soon(links.warn_bridges, view)
            nursery.start_soon(self.supervisor.run)
            nursery.start_soon(measure.measure_loop, view, inbox, copier,
                               measure.MeasureConfig(cfg.memory_limit_bytes, cfg.layer_ms))
            if not fixed:  # listening on every address: follow them as cables and networks change
                nursery.start_soon(links.watch_addresses, inbox, partial(self.interface_advert, bound_port), advertise)
            nursery.start_soon(fetch.fetch_loop, view, inbox, copier)
            if cfg.configure_links:
                nursery.start_soon(links.configure_links, view)
            await self._act(ready)
            task_status.started()
            await self._loop()
            self.finished.set()
            # Let control requests that waited for the leave answer before we go.
            with trio.move_on_after(2.0):
                while self.control_active:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    async def pair(self, request: dict[str, Any], emit: pairing.Emit, ask: pairing.Ask) -> dict[str, Any]:
        """`p2pmesh pair` (docs/pairing.md): let a Mac in over a cable, or with ``join``,
        get the key of the Mac at the other end of one."""
        try:
            if self._pairing is None:
                raise pairing.PairingError("the agent is still starting; try again in a few seconds")
            return await pairing.pair(self._pairing, request, emit, ask)
        except pairing.PairingError as exc:
            return {"paired": False, "error": str(exc)}
        except Exception as exc:  # our bug: the user gets an answer, the agent keeps running
            log.exception("pairing failed")
            return {"paired": False, "error": f"pairing failed inside the agent: {exc!r}"}

    def adopt_cluster_key(self, key: bytes) -> None:
        """Start over in the cluster this key opens (pairing's guest side): the core loop
        ends, and run_agent forgets this Mac's one-Mac cluster, installs the key and starts
        the agent again. Only for an agent that run_agent restarts."""
        if not self.restartable:
            raise LocalProtocolError("this agent is embedded in a program and cannot restart itself with a new key; "
                                     "pair with `p2pmesh agent` running, or install the key with `p2pmesh key set`")
        if type(key) is not bytes or len(key) != keys.KEY_BYTES:
            raise LocalProtocolError(f"a cluster key is {keys.KEY_BYTES} bytes")
        self.new_key = key
        # Wake the loop now, not at its next deadline (a full inbox wakes it anyway).
        self.inbox_port.put_nowait(TimerFired())

    async def _loop(self) -> None:
        machine = self.machine
        assert machine is not None
        while not self.left.is_set() and self.new_key is None:
            delay = max(0.0, (machine.next_deadline_ms() - self.now_ms()) / 1000)
            event: Input = TimerFired()
            with trio.move_on_after(delay):
                event = await self.inbox.receive()
            if isinstance(event, PeerDiscovered) and self.transport is not None:
                self.transport.learn(event.node_id, event.addresses)
            malformed = machine.malformed_frames
            ready = machine.handle(event, self.now_ms())
            if machine.malformed_frames > malformed and isinstance(event, FrameReceived) and self.transport is not None:
                log.warning("closing the connection to %s: it sent a malformed frame", event.peer)
                self.transport.close(event.peer)
            await self._act(ready)

    async def _act(self, ready: Ready) -> None:
        # 1. durable part first (fsync in a worker thread; the loop waits for it).
        await trio.to_thread.run_sync(self.storage.save, ready)
        # 2. then messages.
        transport = self.transport
        assert transport is not None
        for dst, message in ready.messages:
            transport.send(dst, wire.encode(message))
        # 3. tell the core the Ready is durable; then everything that may be observed.
        assert self.machine is not None
        effects = self.machine.advance(ready)
        for ev in effects.events:
            log.info("%s %s", ev.kind, ev.detail)
        if ready.applied and self.machine is not None and self.machine.raft is not None:
            for m in self.machine.raft.state.members:
                transport.learn(m.node_id, m.addresses)
        for submit in effects.submits:
            await self.supervisor.submit(submit)
        for event in effects.client:
            channel = self.clients.get(event.req)
            if channel is not None:
                try:
                    channel.send_nowait(event)
                except trio.WouldBlock:  # a client that stopped reading: drop it, not the loop
                    self.clients.pop(event.req, None)
                    channel.close()
        if ready.reads or self.reads:
            self._answer_reads(ready.reads)
        m = self.machine
        r = m.raft if m is not None else None
        self._acted = (r.cluster, m.inc, r.commit) if m is not None and r is not None else None
        if m is not None:
            # 4. the tasks see the state this Ready left, now that its durable part is saved.
            self._publisher.publish(Snapshot(
                0, self.identity.node_id, m.status(), r.state if r is not None else None, m.facts.ports,
                m.facts.probes, m.facts.measure, m.router.resumed, m.router.asked_again))
            # The serving head's batch, for status only (kept out of the tasks' view: it
            # changes twice a second and no task acts on it).
            self._load = (m.router.load, m.router.load_ms)
            if m.transfers.reports is not self._transfers:  # (replaced, never changed in place)
                self._transfers = m.transfers.reports
                self.hub_downloads.refresh()
        if ready.left:
            self.left.set()

    # ------------------------------------------------------------------------------
    # Reads for control clients (the chaos tool's history, scripts/chaos.py)

    async def read_members(self, *, linearizable: bool = True) -> dict[str, Any]:
        """Control op `members`: the committed membership. Linearizable (the default) goes
        through ReadIndex: the answer reflects every entry committed before the request."""
        m = self.machine
        r = m.raft if m is not None else None
        if r is None or self._acted is None:
            return error_answer(ErrorCode.NO_CLUSTER, "this agent is not in a cluster yet")
        if not linearizable:
            return {"ok": True, **self._membership()}
        if len(self.reads) >= READS_PENDING_MAX:
            return error_answer(ErrorCode.BUSY, f"{READS_PENDING_MAX} reads are already waiting here; retry later")
        self._read_ctx += 1
        ctx = self._read_ctx
        pending = self.reads[ctx] = _PendingRead(r.cluster, trio.Event())
        try:
            await self.inbox_send.send(ReadRequested(ctx))
            with trio.move_on_after(READ_TIMEOUT_S):
                await pending.done.wait()
        finally:
            self.reads.pop(ctx, None)
        return pending.answer or error_answer(ErrorCode.NO_QUORUM, f"no leader confirmed the read within {READ_TIMEOUT_S:g} s; retry")

    def _answer_reads(self, results: list[tuple[int, bool]]) -> None:
        # Called after the Ready's durable part is saved, with the machine as that Ready
        # left it: the applied state is at least the read's index.
        r = self.machine.raft if self.machine is not None else None
        for ctx, ok in results:
            pending = self.reads.get(ctx)
            if pending is None or pending.done.is_set():
                continue
            if not ok:
                pending.answer = error_answer(ErrorCode.NO_QUORUM, "the cluster could not confirm its leader for the read "
                                              "(an election or a partition); retry")
            elif r is None or r.cluster != pending.cluster:
                pending.answer = dict(_CHANGED_CLUSTERS)
            else:
                pending.answer = {"ok": True, **self._membership()}
            pending.done.set()
        # The old cluster's Raft held the reads still waiting: they end with it.
        for pending in self.reads.values():
            if not pending.done.is_set() and (r is None or r.cluster != pending.cluster):
                pending.answer = dict(_CHANGED_CLUSTERS)
                pending.done.set()

    def _membership(self) -> dict[str, Any]:
        m = self.machine
        assert m is not None and m.raft is not None
        r = m.raft
        return {
            "cluster_id": r.cluster,
            "index": r.applied,
            "term": r.term,
            "leader": r.leader.node_id if r.leader is not None else None,
            "me": {"node_id": self.identity.node_id, "inc": m.inc},
            "members": [{"node_id": x.node_id, "inc": x.inc, "voter": x.voter, "up": x.up} for x in r.state.members],
        }

    def leave_outcome(self) -> dict[str, Any]:
        """How a graceful leave ended: ``confirmed`` when the cluster committed the removal
        of this incarnation (``inc``) before the agent stopped."""
        m = self.machine
        if m is None or not self.left.is_set():
            return {"confirmed": False}
        return {"confirmed": m.leave_confirmed, "cluster_id": m.raft.cluster if m.raft is not None else None,
                "node_id": self.identity.node_id, "inc": m.inc}

    def committed_log(self, after: int, count_max: int) -> dict[str, Any]:
        """Control op `log`: committed entries after index ``after`` as [index, term,
        digest], at most ``count_max`` (and LOG_ENTRIES_MAX), from what the log still holds
        (entries up to a snapshot are compacted away: ``snapshot_index``)."""
        m = self.machine
        r = m.raft if m is not None else None
        if r is None or self._acted is None:
            return error_answer(ErrorCode.NO_CLUSTER, "this agent is not in a cluster yet")
        if self._acted[:2] != (r.cluster, m.inc):  # type: ignore[union-attr]
            # A merge or a rejoin started a new log whose first Ready is still being saved.
            return error_answer(ErrorCode.RETRY, "this agent is switching to a new log; retry")
        commit = self._acted[2]
        lo = max(after + 1, r.log.first_index)
        count = max(0, min(count_max, LOG_ENTRIES_MAX, commit - lo + 1))
        entries = r.log.slice(lo, count) if count else ()
        return {
            "ok": True,
            "cluster_id": r.cluster,
            "inc": m.inc,  # type: ignore[union-attr]
            "pid": os.getpid(),
            "commit": commit,
            "snapshot_index": r.log.snapshot.index,
            "entries": [[e.index, e.term, wire.digest(e.command)] for e in entries],
        }

    def request_leave(self) -> None:
        self.inbox_send.send_nowait(LeaveRequested())

    async def set_model(self, request: dict[str, Any]) -> dict[str, Any]:
        """Control op `model`: serve this model (or none), cluster-wide."""
        name = request.get("name")
        context = request.get("context_tokens", DEFAULT_CONTEXT_TOKENS)
        # A quantized KV cache (kv_bits 4 or 8) serves one request at a time (mlx-lm's batched
        # cache has no quantized form), so batch defaults to 1 with it; else to this agent's
        # --max-batch.
        kv_bits = request.get("kv_bits") or 0
        batch = request.get("batch") or (1 if kv_bits else self.config.max_batch)
        if name is None:
            await self.inbox_send.send(ProposalRequested(SetModel(None)))
            return {"ok": True, "model": None}
        if not isinstance(name, str) or not protocol.is_int(context) or not 1 <= context <= protocol.CONTEXT_TOKENS_MAX:
            return error_answer(ErrorCode.BAD_REQUEST, "model needs a name (path or Hugging Face id) and "
                                f"1 <= context_tokens <= {protocol.CONTEXT_TOKENS_MAX}", param="context_tokens")
        if not protocol.is_int(batch) or not 1 <= batch <= protocol.BATCH_REQUESTS_MAX:
            return error_answer(ErrorCode.BAD_REQUEST, f"batch (requests served at once) is 1 to {protocol.BATCH_REQUESTS_MAX}",
                                param="batch")
        parallelism = request.get("parallelism", "auto")
        if parallelism not in PARALLELISM_CHOICES:
            return error_answer(ErrorCode.BAD_REQUEST, f"parallelism is one of {', '.join(PARALLELISM_CHOICES)}, "
                                f"not {str(parallelism)[:40]!r}", param="parallelism")
        if kv_bits not in (0, *protocol.KV_BITS_CHOICES) or not protocol.is_int(kv_bits):
            return error_answer(ErrorCode.BAD_REQUEST, f"kv_bits (the KV cache's bits) is one of "
                                f"{', '.join(map(str, protocol.KV_BITS_CHOICES))}, or absent for full precision, "
                                f"not {str(kv_bits)[:40]!r}", param="kv_bits")
        if kv_bits and batch != 1:
            return error_answer(ErrorCode.BAD_REQUEST, "a quantized KV cache (kv_bits) serves one request at a time: "
                                f"batch must be 1, not {batch} (mlx-lm's batched cache has no quantized form)",
                                param="batch", reason="kv_bits_batch")
        local = models.located(name, self.config.model_root)
        try:
            path = await trio.to_thread.run_sync(models.resolve, local)
            info = await trio.to_thread.run_sync(models.describe, name, path, context, batch, parallelism, kv_bits)
        except models.KvBitsUnsupported as exc:
            return error_answer(ErrorCode.BAD_REQUEST, str(exc), param="kv_bits", reason="kv_not_quantizable")
        except models.ModelError as exc:
            return error_answer(ErrorCode.MODEL_INVALID, str(exc))
        problem = validate.model_problem(info)
        if problem is not None:
            return error_answer(ErrorCode.MODEL_INVALID, problem)
        if parallelism in ("tensor", "hybrid") and not info.hidden_size:
            return error_answer(ErrorCode.BAD_REQUEST, f"a {parallelism} plan needs the model's shape (hidden_size, "
                                "num_attention_heads, num_key_value_heads and intermediate_size in config.json, the "
                                f"heads dividing evenly): {name} does not say it; use --parallelism auto or pipeline",
                                param="parallelism", reason="model_shape_unknown")
        await self.inbox_send.send(ProposalRequested(SetModel(info)))
        return {"ok": True, "model": {"name": info.name, "layers": info.layers, "layer_bytes": info.layer_bytes,
                                      "context_tokens": info.context_tokens, "batch": info.batch,
                                      "parallelism": info.parallelism, "kv_bits": info.kv_bits or None}}

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Control op `generate`: stream a generation's tokens (this agent is its origin)."""
        try:
            params = _generate_params(request)
        except RequestInvalid as exc:
            yield error_answer(ErrorCode.BAD_REQUEST, str(exc), final=True, param=exc.param)
            return
        self._requests += 1
        req = f"{self.identity.node_id[:8]}-{os.getpid()}-{self._requests}"
        send, receive = trio.open_memory_channel[ClientEvent](CLIENT_EVENTS_MAX)
        self.clients[req] = send
        asked = finished = False
        try:
            await self.inbox_send.send(GenerateRequested(req, params))
            asked = True
            async for event in receive:
                finished = event.done
                out: dict[str, Any] = {"ok": True, "id": req, "tokens": list(event.tokens), "text": event.text}
                if event.done:
                    out.update(final=True, finish=event.finish)
                    if event.ttft_ms is not None:
                        out.update(ttft_ms=event.ttft_ms)
                    if event.finish == "error":
                        out.update(ok=False, error=event.text, code=event.code or ErrorCode.AGENT_ERROR)
                yield out
                if event.done:
                    return
            yield error_answer(ErrorCode.CLIENT_TOO_SLOW, "the client fell too far behind the stream", final=True)
        finally:
            self.clients.pop(req, None)
            if asked and not finished:
                # The client hung up (or fell behind): free the request's slot in the head
                # worker now. No await here (this may run while cancelled); a full inbox
                # only means the request runs to its end unheard, which is bounded.
                try:
                    self.inbox_send.send_nowait(GenerateCancelled(req))
                except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    log.info("request %s: could not cancel it (the core's inbox is full or closed)", req)

    def status(self) -> dict[str, Any]:
        """Control op `status`: this agent's view (agent/status.py), as of the last Ready
        whose durable part is saved."""
        load, load_ms = self._load
        return status_json(self.view.current, self.config.state_dir, load if self.now_ms() - load_ms <= LOAD_STALE_MS else None,
                           transfers.fresh(self._transfers, self.now_ms()))


def _generate_params(r: dict[str, Any]) -> GenerateParams:
    """Validate a generate request against core/protocol.py's limits, once, at the edge (the
    worker re-checks the same constants). RequestInvalid names the field at fault."""
    P = protocol
    prompt, tokens = r.get("prompt"), r.get("prompt_tokens")
    if prompt is None and not tokens:
        raise RequestInvalid("generate needs a prompt (text) or prompt_tokens", "prompt")
    if prompt is not None and (not isinstance(prompt, str) or len(prompt) > P.PROMPT_CHARS_MAX):
        raise RequestInvalid(f"prompt must be text of at most {P.PROMPT_CHARS_MAX} characters", "prompt")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) > P.PROMPT_TOKENS_MAX
                               or not all(P.is_int(t) and 0 <= t < P.TOKEN_ID_LIMIT for t in tokens)):
        raise RequestInvalid(f"prompt_tokens must be a list of at most {P.PROMPT_TOKENS_MAX} token ids", "prompt_tokens")
    max_tokens, temperature = r.get("max_tokens", P.GENERATE_TOKENS_DEFAULT), r.get("temperature", 0.0)
    top_p, seed = r.get("top_p", 1.0), r.get("seed", 0)
    if not P.is_int(max_tokens) or not 1 <= max_tokens <= P.GENERATE_TOKENS_MAX:
        raise RequestInvalid(f"max_tokens must be an integer from 1 to {P.GENERATE_TOKENS_MAX}", "max_tokens")
    if not P.is_number(temperature) or not 0 <= temperature <= P.TEMPERATURE_MAX:
        raise RequestInvalid(f"temperature must be a number from 0 (greedy) to {P.TEMPERATURE_MAX:g}", "temperature")
    if not P.is_number(top_p) or not 0 < top_p <= 1:
        raise RequestInvalid("top_p must be a number in (0, 1]", "top_p")
    if not P.is_int(seed) or not 0 <= seed < P.SEED_LIMIT:
        raise RequestInvalid(f"seed must be an integer from 0 to {P.SEED_LIMIT - 1}", "seed")
    return GenerateParams(prompt, tuple(tokens or ()), max_tokens, float(temperature), float(top_p), seed)


def _dial(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_WILDCARDS = ("", "0.0.0.0", "::")
"""Listen hosts that mean every address (``_split`` strips the brackets of "[::]")."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--listen must look like HOST:PORT, got {address!r}")
    # An empty host (":7741") means every address, like 0.0.0.0 and :: together.
    return host.strip("[]"), int(port)


RESTARTS_MAX = 4
"""New keys one process takes (pairing); more would mean something loops."""


async def run_agent(config: AgentConfig) -> int:
    """Run until SIGINT/SIGTERM (or a completed leave). Returns the exit code. After pairing
    gave this Mac a cluster key, start over in that cluster: forget the one-Mac cluster
    first (so a crash in between leaves a Mac that simply starts alone again, never one
    with the new key and the old cluster), then install the key."""
    for _ in range(RESTARTS_MAX):
        agent = Agent(config)
        agent.restartable = True
        try:
            signalled = await _run_once(agent, config)
            key = agent.new_key
            if key is None:
                return 0
            await trio.to_thread.run_sync(agent.storage.forget_cluster)
            await trio.to_thread.run_sync(keys.write_key, config.state_dir / keys.KEY_FILE, key)
        finally:
            agent.storage.close()
        if signalled:  # the user confirmed the key, then asked the agent to stop: keep both
            return 0
        log.info("installed the cluster key from pairing; starting again to join that cluster")
    log.error("stopping: %d new cluster keys in one run", RESTARTS_MAX)
    return 1


async def _run_once(agent: Agent, config: AgentConfig) -> bool:
    """Run one agent until its loop ends or a signal; returns whether a signal ended it."""
    signalled = False
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)

        async def watch_signals() -> None:
            nonlocal signalled
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    signalled = True
                    if config.leave_on_exit and not agent.left.is_set():
                        log.info("leaving the cluster before exit")
                        agent.request_leave()
                        with trio.move_on_after((config.settings.leave_timeout_ms + config.settings.drain_timeout_ms) / 1000 + 1):
                            await agent.left.wait()
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch_signals)
        await agent.finished.wait()
        with trio.move_on_after(2.5):
            while agent.control_active:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return signalled


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        class _Json(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return json.dumps({"t": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()})
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("p2pmesh")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
