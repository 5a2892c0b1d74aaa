"""One simulated run: formation, a failover probe, a fault phase with a client workload,
then healing and a convergence check. ``run_seed`` is what ``python -m sim run`` calls and
what ``sweep`` calls once per seed (in worker processes).

Phases (virtual time):
1. all nodes boot within 50 ms; they must form exactly one cluster within FORMATION_BOUND;
2. failover probe (3+ nodes): crash the leader, measure until a new leader commits an
   entry of its own term, restart the old leader;
3. faults from the seeded schedule for ``duration_s``, while clients write and read;
4. heal everything; the cluster must converge (one leader, every live node an up-to-date
   voter of the same cluster) within CONVERGE_BOUND.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TextIO

from p2pmesh.core.machine import Effects, Machine, Ready
from p2pmesh.core.messages import MarkDown, Promote
from p2pmesh.core.raft import LEADER
from p2pmesh.core.settings import Settings
from sim.checks import InvariantViolated
from sim.faults import Fault, schedule
from sim.network import LinkProfile
from sim.node import SimNode
from sim.world import World

FORMATION_BOUND_US = 5_000_000
FAILOVER_BOUND_US = 5_000_000
CONVERGE_BOUND_US = 20_000_000
CLIENT_EVERY_US = 50_000
NODES_MAX_FACTOR = 2
SIM_SETTINGS = Settings(remove_after_ms=8_000)
"""The simulator shortens remove_after_ms (minutes in production) so removal happens."""


@dataclass(slots=True)
class RunResult:
    seed: int
    events: int = 0
    sim_us: int = 0
    violation: str | None = None
    detail: str = ""
    formation_ms: float | None = None
    failover_ms: float | None = None
    converge_ms: float | None = None
    down_detect_ms: list[float] = field(default_factory=list)
    join_to_voter_ms: list[float] = field(default_factory=list)
    trace_digest: str = ""
    faults: int = 0
    reads_ok: int = 0


class _Metrics:
    """Observes synced Readies to time failovers, down detections and promotions."""

    def __init__(self, world: World, result: RunResult) -> None:
        self.world = world
        self.result = result
        self.failover_from: tuple[int, str] | None = None
        self.silent_since: dict[str, int] = {}
        self.fresh_since: dict[str, int] = {}
        world.observers.append(self.observe)

    def observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        m = node.machine
        if not ready.applied or m is None or m.raft is None or m.raft.role is not LEADER:
            return
        r = m.raft
        now = self.world.now_us
        if self.failover_from is not None and node.node_id != self.failover_from[1]:
            if any(e.term == r.term for e in ready.applied):
                self.result.failover_ms = (now - self.failover_from[0]) / 1000
                self.failover_from = None
        for e in ready.applied:
            cmd = e.command
            if isinstance(cmd, MarkDown) and cmd.node_id in self.silent_since:
                self.result.down_detect_ms.append((now - self.silent_since.pop(cmd.node_id)) / 1000)
            elif isinstance(cmd, Promote) and cmd.node_id in self.fresh_since:
                self.result.join_to_voter_ms.append((now - self.fresh_since.pop(cmd.node_id)) / 1000)


class Scenario:
    def __init__(
        self,
        seed: int,
        *,
        nodes: int,
        duration_s: float,
        faults: tuple[str, ...],
        machine_class: type[Machine] = Machine,
        trace: TextIO | None = None,
        profile: LinkProfile | None = None,
    ) -> None:
        self.seed = seed
        self.nodes_at_start = nodes
        self.duration_us = int(duration_s * 1_000_000)
        self.faults = faults
        self.world = World(
            seed, nodes=nodes, settings=SIM_SETTINGS, machine_class=machine_class, trace=trace, profile=profile
        )
        self.result = RunResult(seed)
        self.metrics = _Metrics(self.world, self.result)
        self.fault_rng = random.Random(seed ^ 0x5EED)
        self.ctx = 0
        self.keys = 0

    # ------------------------------------------------------------------------------

    def run(self) -> RunResult:
        try:
            self._run()
        except InvariantViolated as exc:
            self.result.violation = exc.invariant
            self.result.detail = exc.detail
        except Exception as exc:  # an assertion or crash inside the core is a finding too
            self.result.violation = "core-exception"
            self.result.detail = f"{type(exc).__name__}: {exc}"
        w = self.world
        self.result.events = w.events
        self.result.sim_us = w.now_us
        self.result.trace_digest = w.trace_digest()
        self.result.reads_ok = w.checker.reads_ok
        return self.result

    def _run(self) -> None:
        w = self.world
        for node in w.nodes:
            w.at(w.rng.randint(0, 50_000), lambda node=node: w.boot(node))
        if not w.run_until(FORMATION_BOUND_US, stop=self._converged_after_boot):
            self._violation("formation", f"no single cluster after {FORMATION_BOUND_US // 1000} ms")
        self.result.formation_ms = w.now_us / 1000
        if len(w.nodes) >= 3:
            self._failover_probe()
        start = w.now_us
        end = start + self.duration_us
        plan = schedule(self.fault_rng, self.faults, start_us=start, end_us=end)
        self.result.faults = len(plan)
        for t, fault in plan:
            w.at(t, lambda fault=fault: self._inject(fault))
        for t in range(start + CLIENT_EVERY_US, end, CLIENT_EVERY_US):
            w.at(t, self._client_step)
        w.run_until(end)
        self._heal_all()
        healed = w.now_us
        if not w.run_until(healed + CONVERGE_BOUND_US, stop=self._converged_check):
            self._violation("convergence", f"not converged {CONVERGE_BOUND_US // 1000} ms after the last fault healed")
        self.result.converge_ms = (w.now_us - healed) / 1000

    def _violation(self, name: str, detail: str) -> None:
        raise InvariantViolated(name, detail)

    def _converged_after_boot(self) -> bool:
        w = self.world
        return all(n.alive for n in w.nodes) and w.converged()

    def _converged_check(self) -> bool:
        return self.world.converged()

    def _failover_probe(self) -> None:
        w = self.world
        leader = w.leader()
        assert leader is not None
        w.crash(leader)
        self.metrics.failover_from = (w.now_us, leader.node_id)
        w.run_until(w.now_us + FAILOVER_BOUND_US, stop=lambda: self.metrics.failover_from is None)
        if self.metrics.failover_from is not None:
            self._violation("failover", f"no new leader committed within {FAILOVER_BOUND_US // 1000} ms")
        w.boot(leader)
        w.run_until(w.now_us + 2_000_000, stop=w.converged)

    # ------------------------------------------------------------------------------
    # Client workload

    def _client_step(self) -> None:
        w = self.world
        live = [n for n in w.live_nodes() if not n.paused]
        if not live:
            return
        writer = w.rng.choice(live)
        self.keys += 1
        w.put(writer, f"k{self.keys}", f"v{self.seed}-{self.keys}")
        reader = w.rng.choice(live)
        self.ctx += 1
        w.read(reader, self.ctx)

    # ------------------------------------------------------------------------------
    # Faults

    def _pick(self) -> SimNode | None:
        w = self.world
        live = [n for n in w.live_nodes() if not n.paused]
        if not live:
            return None
        return w.rng.choice(live)

    def _later(self, fault: Fault, fn: object) -> None:
        w = self.world
        w.at(w.now_us + fault.duration_us, fn)  # type: ignore[arg-type]

    def _inject(self, fault: Fault) -> None:
        w = self.world
        kind = fault.kind
        w.note(f"fault {kind} for {fault.duration_us // 1000} ms")
        if kind in ("crash", "power-loss", "wipe", "crash-leader"):
            node = w.leader() if kind == "crash-leader" else self._pick()
            if node is None:
                return
            self._note_silent(node)
            w.crash(node, lose_unsynced=(kind == "power-loss") or None)
            if kind == "wipe":
                w.wipe(node)
            self._later(fault, lambda: self._restart(node))
        elif kind in ("pause", "pause-leader"):
            node = w.leader() if kind == "pause-leader" else self._pick()
            if node is None:
                return
            self._note_silent(node)
            w.pause(node)
            self._later(fault, lambda: self._resume(node))
        elif kind == "partition":
            ids = [n.node_id for n in w.nodes]
            w.rng.shuffle(ids)
            cut = w.rng.randint(1, len(ids) - 1)
            pairs = w.net.partition([ids[:cut], ids[cut:]])
            self._later(fault, lambda: w.net.mend(pairs))
        elif kind in ("one-way", "cable"):
            a, b = w.rng.sample([n.node_id for n in w.nodes], 2)
            pairs = w.net.cut(a, b, both_ways=(kind == "cable"))
            self._later(fault, lambda: w.net.mend(pairs))
        elif kind == "loss":
            w.net.loss_override = w.rng.uniform(0.1, 0.3)
            self._later(fault, self._end_loss)
        elif kind == "join":
            if len(w.nodes) < self.nodes_at_start * NODES_MAX_FACTOR:
                node = w.add_node(boot=True)
                self.metrics.fresh_since[node.node_id] = w.now_us
        elif kind == "leave":
            node = self._pick()
            if node is None or len(w.live_nodes()) <= 2:
                return
            w.leave(node)
            self._later(fault, lambda: self._rejoin(node))

    def _end_loss(self) -> None:
        self.world.net.loss_override = None

    def _note_silent(self, node: SimNode) -> None:
        leader = self.world.leader()
        if leader is not None and leader is not node:
            self.metrics.silent_since.setdefault(node.node_id, self.world.now_us)

    def _restart(self, node: SimNode) -> None:
        if not node.alive and not node.left:
            self.metrics.silent_since.pop(node.node_id, None)
            self.world.boot(node)

    def _resume(self, node: SimNode) -> None:
        self.metrics.silent_since.pop(node.node_id, None)
        self.world.resume(node)

    def _rejoin(self, node: SimNode) -> None:
        if node.left:
            self.world.wipe(node)
            self.world.boot(node)
            self.metrics.fresh_since[node.node_id] = self.world.now_us

    def _heal_all(self) -> None:
        w = self.world
        w.net.heal()
        for node in list(w.nodes):
            w.revive(node)
        self.metrics.silent_since.clear()


def run_seed(
    seed: int,
    *,
    nodes: int,
    duration_s: float,
    faults: tuple[str, ...],
    machine_class: type[Machine] = Machine,
    trace: TextIO | None = None,
) -> RunResult:
    return Scenario(seed, nodes=nodes, duration_s=duration_s, faults=faults, machine_class=machine_class, trace=trace).run()
