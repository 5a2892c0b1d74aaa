"""The world: an event queue on virtual time that drives real core Machines.

The world plays the agent's driver for every node with the same contract: on each Ready it
writes the durable part to the node's disk, waits for the fsync (virtual latency), then
sends the messages through the virtual network, advances the Ready and hands it and its
Effects to the observers. The node keeps handling inputs while its disk syncs (a pipelined
driver, core/outbox.py); its trace records the events it decides when it decides them.
Messages are checked against the wire codec and the receiver's semantic checks by sample
(``WIRE_CHECK_EVERY``): the sampled ones travel as decoded frames, the others as the objects
the sender made (MessageReceived, which the receiving core does not check again). Events are
(time_us, seq, ...) in a heap, so ties break by insertion order and a run is a pure
function of its seed.
"""
from __future__ import annotations

import hashlib
import heapq
import random
from typing import Any, Callable, TextIO

from p2pmesh.core import validate, wire
from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.identity import Identity
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import (
    Effects,
    Input,
    LeaveRequested,
    Machine,
    MessageReceived,
    MEMBER,
    PeerDiscovered,
    PortsObserved,
    ProposalRequested,
    ReadRequested,
    Ready,
    TimerFired,
)
from p2pmesh.core.messages import Capabilities, Put
from p2pmesh.core.raft import LEADER
from p2pmesh.core.settings import Settings
from sim.cabling import Cabling, SimCable
from sim.checks import Checker, InvariantViolated
from sim.disk import SimDisk
from sim.network import LinkProfile, Network
from sim.node import SimNode

TIMER, DELIVER, SYNCED, CALL = 0, 1, 2, 3
FSYNC_US = 200
_TIMER_FIRED = TimerFired()
WIRE_CHECK_EVERY = 16
"""The first message of each type in a world, and every 16th message, makes the full trip
through the wire codec: encoded, decoded with every schema check, compared with what the
sender made, and put through the semantic checks a receiver makes of a decoded frame
(``validate.problem``; invariant ``wire-roundtrip``). Decoding every message cost a seventh
of the simulator's time and checked less: the decoded copy was never compared. The others
skip all three: a correct core makes no message that fails them."""


def kept(ready: Ready, effects: Effects) -> bool:
    """Whether the world writes a Ready, syncs it and shows it to its observers: anything but
    log lines (submits and client events too: with no durable part, after no delay)."""
    return bool(ready.durable_part() or ready.messages or ready.applied or ready.reads or ready.left
                or effects.submits or effects.client)


class World:
    def __init__(
        self,
        seed: int,
        *,
        nodes: int,
        settings: Settings | None = None,
        profile: LinkProfile | None = None,
        machine_class: type[Machine] = Machine,
        trace: TextIO | None = None,
        checker: Checker | None = None,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.settings = settings or Settings()
        self.net = Network(self.rng, profile or LinkProfile())
        self.machine_class = machine_class
        self.now_us = 0
        self.queue: list[tuple[int, int, int, int, Any]] = []
        self.seq = 0
        self.events = 0
        self.nodes: list[SimNode] = []
        self.by_id: dict[NodeId, SimNode] = {}
        self.trace = trace
        self.hasher = hashlib.sha256()
        self.checker = checker or Checker(self)
        self.observers: list[Callable[[SimNode, Ready, Effects], None]] = []
        self.lose_unsynced_on_crash = False
        self.cabling = Cabling()
        self.fifo_types: tuple[type, ...] = ()
        """Message types delivered in order per link (a stream, as over the agent's TLS
        connections); others may reorder. Empty by default: only the serving scenario
        orders its inference messages (sim/serving_scenario.py)."""
        self.fifo_at: dict[tuple[NodeId, NodeId], int] = {}
        self.wire_checked = 0
        """Messages that made the full trip through the codec (see WIRE_CHECK_EVERY)."""
        self._wire_sent = 0
        self._wire_types: set[type] = set()
        for _ in range(nodes):
            self.add_node(boot=False)

    # ------------------------------------------------------------------------------
    # Nodes

    def add_node(self, *, boot: bool = True) -> SimNode:
        index = len(self.nodes)
        ident = Identity.from_seed(self.rng.getrandbits(256).to_bytes(32, "big"))
        memory = self.rng.choice((16, 24, 32, 64, 96, 128, 192)) * 2**30
        chip = self.rng.choice(("M2 Max", "M3 Ultra", "M4 Pro", "M4 Max"))
        node = SimNode(index, ident.node_id, SimDisk(), Capabilities(memory, chip))
        self.nodes.append(node)
        self.by_id[node.node_id] = node
        if boot:
            self.boot(node)
        return node

    def boot(self, node: SimNode) -> None:
        node.gen += 1
        node.alive = True
        node.paused = False
        node.left = False
        node.deferred = []
        node.booted_us = self.now_us
        node.disk_free_at = self.now_us
        node_rng = random.Random(self.rng.getrandbits(64))
        machine, ready = self.machine_class.boot(
            node_id=node.node_id,
            persisted=node.disk.load(),
            settings=self.settings,
            rng=node_rng,
            now_ms=self.now_ms,
            addresses=(f"10.0.0.{node.index + 1}",),
            caps=node.caps,
            pipelined=True,
        )
        node.machine = machine
        self.checker.on_boot(node)
        self._log(node, "boot", f"inc={machine.inc}")
        self._process_ready(node, ready)
        if any(node.index in (c.a, c.b) for c in self.cabling.cables):
            self.call(node, PortsObserved(self.cabling.ports_of(node.index)))
        for other in self.nodes:
            if other is not node and other.alive and not other.left:
                self.call(node, PeerDiscovered(other.node_id, (f"10.0.0.{other.index + 1}",)))
                self.call(other, PeerDiscovered(node.node_id, (f"10.0.0.{node.index + 1}",)))

    def plug(self, a: SimNode, b: SimNode) -> SimCable:
        """Cable two Macs with Thunderbolt; both link watchers notice at once."""
        cable = self.cabling.plug(a.index, b.index)
        self._log(a, "cable plugged", b.name)
        self._ports_changed(a, b)
        return cable

    def unplug(self, cable: SimCable) -> None:
        self.cabling.unplug(cable)
        a, b = self.nodes[cable.a], self.nodes[cable.b]
        self._log(a, "cable pulled", b.name)
        self._ports_changed(a, b)

    def _ports_changed(self, *nodes: SimNode) -> None:
        for node in nodes:
            self.call(node, PortsObserved(self.cabling.ports_of(node.index)))

    def crash(self, node: SimNode, *, lose_unsynced: bool | None = None) -> None:
        if not node.alive:
            return
        lose = self.lose_unsynced_on_crash if lose_unsynced is None else lose_unsynced
        node.disk.crash(lose_unsynced=lose)
        node.alive = False
        node.paused = False
        node.machine = None
        node.gen += 1
        node.deferred = []
        self._log(node, "crash", "lose-unsynced" if lose else "")

    def wipe(self, node: SimNode) -> None:
        """Lose a stopped node's whole disk (its identity key survives, as on a Mac whose
        state directory was deleted)."""
        assert not node.alive
        node.disk.wipe()
        self._log(node, "wipe", "")

    def pause(self, node: SimNode) -> None:
        if node.alive and not node.paused:
            node.paused = True
            self._log(node, "pause", "")

    def resume(self, node: SimNode) -> None:
        if not node.paused:
            return
        node.paused = False
        self._log(node, "resume", "")
        deferred, node.deferred = node.deferred, []
        for kind, payload in deferred:
            self._push(self.now_us, kind, node.index, payload)
        self._schedule_timer(node, force=True)

    def revive(self, node: SimNode) -> None:
        """Heal one node: resume it if paused; boot it if it crashed, or, wiped, if it left
        (it comes back as a fresh member)."""
        if node.paused:
            self.resume(node)
        elif node.left:
            self.wipe(node)
            self.boot(node)
        elif not node.alive:
            self.boot(node)

    # ------------------------------------------------------------------------------
    # Event queue

    @property
    def now_ms(self) -> int:
        return self.now_us // 1000

    def _push(self, t_us: int, kind: int, node_index: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t_us, self.seq, kind, node_index, payload))

    def call(self, node: SimNode, event: Input) -> None:
        """Feed an input to a node now (client requests, discovery)."""
        self._push(self.now_us, CALL, node.index, (node.gen, event))

    def at(self, t_us: int, fn: Callable[[], None]) -> None:
        """Run a world-level action (a fault, a client request) at virtual time t_us."""
        self._push(t_us, CALL, -1, fn)

    def run_until(self, t_us: int, stop: Callable[[], bool] | None = None) -> bool:
        """Process events up to t_us (or until ``stop()`` holds). True if stopped early."""
        queue, nodes, pop = self.queue, self.nodes, heapq.heappop
        while queue and queue[0][0] <= t_us:
            t, _, kind, idx, payload = pop(queue)
            self.now_us = t
            self.events += 1
            if idx < 0:
                payload()
            elif kind == DELIVER and nodes[idx].alive and not nodes[idx].paused and nodes[idx].machine is not None:
                # _dispatch's most common case, inline: a message for a running node.
                node = nodes[idx]
                self._process_ready(node, node.machine.handle(MessageReceived(*payload), t // 1000))  # type: ignore[union-attr]
            else:
                self._dispatch(nodes[idx], kind, payload)
            if stop is not None and stop():
                return True
        self.now_us = max(self.now_us, t_us)
        return False

    def _dispatch(self, node: SimNode, kind: int, payload: Any) -> None:
        if kind == SYNCED:
            gen, ready = payload
            if gen == node.gen:
                self._synced(node, ready)
            return
        if not node.alive or node.machine is None:
            return
        if node.paused:
            node.deferred.append((kind, payload))
            return
        if kind == TIMER:
            if payload != node.gen or self.now_us != node.timer_at:
                return
            node.timer_at = -1
            event: Input = _TIMER_FIRED
        elif kind == DELIVER:
            src, message = payload
            event = MessageReceived(src, message)
        else:
            gen, event = payload
            if gen != node.gen:
                return
        ready = node.machine.handle(event, self.now_us // 1000)
        self._process_ready(node, ready)

    # ------------------------------------------------------------------------------
    # The driver contract

    def _process_ready(self, node: SimNode, ready: Ready) -> None:
        machine = node.machine
        assert machine is not None
        effects = machine.effects_of(ready)  # (advanced after the fsync; traced now)
        self.checker.after_handle(node, ready)
        if self.trace is not None or effects.events:
            for ev in effects.events:
                self._log(node, ev.kind, ev.detail)
        if kept(ready, effects):
            durable = ready.durable_part()
            node.disk.write(ready)
            sync_at = max(self.now_us, node.disk_free_at) + (FSYNC_US if durable else 0)
            node.disk_free_at = sync_at
            if sync_at == self.now_us:
                self._synced(node, ready)
            else:
                self._push(sync_at, SYNCED, node.index, (node.gen, ready))
        elif effects.events:
            machine.advance(ready)  # events only: nothing to keep, send or observe
        self._schedule_timer(node)

    def _schedule_timer(self, node: SimNode, force: bool = False) -> None:
        machine = node.machine
        if machine is None:
            return
        due = max(machine.next_deadline_ms() * 1000, self.now_us)
        if force or node.timer_at < self.now_us or due < node.timer_at:
            node.timer_at = due
            self._push(due, TIMER, node.index, node.gen)

    def _synced(self, node: SimNode, ready: Ready) -> None:
        node.disk.sync(through=ready)
        if ready.messages:
            self._send(node.node_id, ready.messages)
        assert node.machine is not None
        effects = node.machine.advance(ready)
        self.checker.after_sync(node, ready)
        for obs in self.observers:
            obs(node, ready, effects)
        if ready.left:
            node.left = True
            node.alive = False
            node.machine = None
            node.gen += 1
            self._log(node, "stopped after leaving", "")

    def _send(self, src: NodeId, messages: list[tuple[NodeId, Any]]) -> None:
        """Put a synced Ready's messages on the network (the hottest loop of the world)."""
        now, by_id, deliveries, fifo_types, queue = self.now_us, self.by_id, self.net.deliveries, self.fifo_types, self.queue
        sent: dict[int, Any] = {}
        for dst, message in messages:
            out = sent.get(id(message))
            if out is None:
                self._wire_sent += 1
                if type(message) in self._wire_types and self._wire_sent % WIRE_CHECK_EVERY:
                    out = message
                else:
                    out = self._wire(message)
                sent[id(message)] = out
            target = by_id.get(dst)
            if target is None:
                continue
            for delay in deliveries(src, dst):
                at = now + delay
                if fifo_types and isinstance(message, fifo_types):
                    at = max(at, self.fifo_at.get((src, dst), 0))
                    self.fifo_at[(src, dst)] = at
                self.seq += 1
                heapq.heappush(queue, (at, self.seq, DELIVER, target.index, (src, out)))

    def _wire(self, message: Any) -> Any:
        """A sampled message's trip through the codec: encoded, decoded with every schema
        check, compared with what was sent and checked as a receiver checks a frame; the
        receivers get the decoded copy."""
        kind = type(message)
        self._wire_types.add(kind)
        self.wire_checked += 1
        try:
            decoded = wire.decode(wire.encode(message))
        except (LocalProtocolError, RemoteProtocolError) as exc:
            raise InvariantViolated("wire-roundtrip", f"{kind.__name__} does not survive the codec: {exc}") from None
        if decoded != message:
            raise InvariantViolated("wire-roundtrip", f"{kind.__name__} decodes to a different value")
        problem = validate.problem(decoded)
        if problem is not None:
            raise InvariantViolated("wire-roundtrip", f"{kind.__name__} fails a receiver's checks: {problem}")
        return decoded

    def note(self, text: str) -> None:
        """A world-level trace line (faults, phases)."""
        line = f"{self.now_us} -- {text}\n"
        self.hasher.update(line.encode())
        if self.trace is not None:
            self.trace.write(line)

    def _log(self, node: SimNode, what: str, detail: str) -> None:
        line = f"{self.now_us} {node.name} {what} {detail}\n"
        self.hasher.update(line.encode())
        if self.trace is not None:
            self.trace.write(line)

    # ------------------------------------------------------------------------------
    # Conveniences for scenarios and tests

    def live_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes if n.alive and not n.left and n.machine is not None]

    def leader(self) -> SimNode | None:
        best: SimNode | None = None
        for n in self.live_nodes():
            r = n.machine.raft if n.machine else None
            if r is not None and r.role is LEADER and (best is None or r.term > best.machine.raft.term):  # type: ignore[union-attr]
                best = n
        return best

    def put(self, node: SimNode, key: str, value: str) -> None:
        self.checker.on_put_issued(node, key, value)
        self.call(node, ProposalRequested(Put(key, value)))

    def read(self, node: SimNode, ctx: int) -> None:
        self.checker.on_read_issued(node, ctx)
        self.call(node, ReadRequested(ctx))

    def leave(self, node: SimNode) -> None:
        self.call(node, LeaveRequested())

    def converged(self) -> bool:
        """One cluster, one leader everybody follows, all live nodes up-to-date voters."""
        # One pass for what live_nodes() and leader() find (scenarios ask after every event).
        live: list[SimNode] = []
        leader: SimNode | None = None
        top = -1
        for n in self.nodes:
            if not n.alive or n.left or n.machine is None:
                continue
            r = n.machine.raft
            if r is not None and r.role is LEADER and r.term > top:
                leader, top = n, r.term
            if not n.paused:
                live.append(n)
        if not live:
            return True
        if leader is None or leader.paused:
            return False
        lr = leader.machine.raft  # type: ignore[union-attr]
        assert lr is not None
        if lr.pending_conf_index > lr.commit:
            return False
        members = {m.node_id: m for m in lr.state.members}
        if len(members) != len(live) or not all(m.voter and m.up for m in members.values()):
            return False
        me = lr.me
        for n in live:
            m = n.machine
            assert m is not None
            r = m.raft
            if m.mode is not MEMBER or r is None or r.cluster != lr.cluster:
                return False
            if r.commit != lr.commit or r.term != lr.term or r.leader is None or r.leader.node_id != me.node_id:
                return False
            member = members.get(n.node_id)
            if member is None or member.inc != m.inc or r.leader.inc != me.inc:
                return False
        return True

    def trace_digest(self) -> str:
        return self.hasher.hexdigest()
