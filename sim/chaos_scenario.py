"""A chaos schedule (sim/chaos_schedule.py) played in the simulator, judged like the real
run of the same schedule (scripts/chaos.py): same steps, same client reads, same log
observer, same bound, same verdict (sim/history.py), plus the invariants of sim/checks.py
checked on every event.

How each step is played on virtual time (the real tool's action in brackets):

- kill: crash, keeping what was written (a process dies, the page cache survives), boot
  from disk after the duration [SIGKILL, restart];
- stop: pause (inputs queue up), resume after the duration [SIGSTOP, SIGCONT];
- unplug a ring cable: the cable leaves both ends' ports (the ring is renegotiated) and the
  pair cannot talk for PATH_RECOVERY_S (or until it is plugged back, if sooner) [link down
  on both veth ends: the agents' connection between the two ran over that cable; it stalls
  until the transport gives it up (DEAD_PATH_S in p2pmesh/drivers/transport.py) and
  redials over the LAN];
- unplug a LAN cable: the host cannot talk to any host it has no plugged ring cable to
  [the host's LAN veth down];
- leave: a graceful leave; after the duration (and once the leave finished) the disk is
  wiped, the identity kept, and the node boots fresh [control op leave, wipe the WAL,
  restart];
- join: a spare boots with an empty disk [a spare agent starts].

The simulator runs the agents' own timings (default Settings: nodes are removed only after
minutes down, longer than any chaos step), so one schedule means the same in both worlds.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TextIO

from p2pmesh.core import wire
from p2pmesh.core.machine import Effects, Machine, Ready
from p2pmesh.core.raft import Raft
from p2pmesh.core.settings import Settings
from sim.chaos_schedule import (
    CLIENTS,
    CONVERGE_BOUND_S,
    FORMATION_BOUND_S,
    LOG_PAGE_MAX,
    READ_EVERY_S,
    SAMPLE_EVERY_S,
    ChaosSchedule,
    ChaosStep,
)
from sim.checks import Checker, InvariantViolated
from sim.history import EndState, History, Verdict, judge
from sim.node import SimNode
from sim.observations import Ack, LogSample, MemberView, ReadOp, Violation
from sim.world import World, kept

US = 1_000_000
READ_TIMEOUT_S = 5.0
"""The agent's bound on a linearizable read (p2pmesh/agent.py READ_TIMEOUT_S)."""
CLIENT_TIMEOUT_S = 8.0
"""The chaos client's socket timeout: what a read at a stopped agent ends with."""
LEAVE_WAIT_S = 10.0
PATH_RECOVERY_S = 1.5
"""How long the pair at the ends of a pulled ring cable cannot talk: the agent's transport
ends a connection whose path died after its TCP user timeout (DEAD_PATH_S, 1 s, fired by
the next retransmission) and redials over the LAN (measured: about 1.3 s)."""


def member_view(r: Raft) -> MemberView:
    """The membership register as the agent's `members` op answers it."""
    return MemberView(r.cluster, r.applied, frozenset((m.node_id, m.inc, m.voter, m.up) for m in r.state.members))


class _ChaosChecker(Checker):
    """sim/checks.py, plus what each Ready showed when it was handled: the agent answers
    reads and reports its commit index only once that Ready is on disk, with the machine as
    that Ready left it, and the world's observers run later (after the fsync)."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.at_handle: dict[int, tuple[str, int, int, dict[int, MemberView]]] = {}

    def after_handle(self, node: SimNode, ready: Ready) -> None:
        super().after_handle(node, ready)
        m = node.machine
        r = m.raft if m is not None else None
        if r is None or not kept(ready, m.effects_of(ready)):  # type: ignore[union-attr]
            return  # a Ready the world never syncs (nothing to keep) is never observed either
        view = member_view(r) if any(ok for _, ok in ready.reads) else None
        self.at_handle[id(ready)] = (r.cluster, node.machine.inc, r.commit,  # type: ignore[union-attr]
                                     {ctx: view for ctx, ok in ready.reads if ok and view})


@dataclass(slots=True)
class _Read:
    host: int
    invoke_s: float
    gen: int
    cluster: str


@dataclass(slots=True)
class ChaosResult:
    verdict: Verdict
    history: History
    skipped: list[str] = field(default_factory=list)
    formation_s: float | None = None
    converge_s: float | None = None
    events: int = 0
    trace_digest: str = ""


class ChaosScenario:
    def __init__(self, schedule: ChaosSchedule, *, machine_class: type[Machine] = Machine,
                 settings: Settings | None = None, trace: TextIO | None = None) -> None:
        self.schedule = schedule
        total = schedule.hosts + schedule.spares
        self.world = w = World(schedule.seed, nodes=total, settings=settings or Settings(),
                               machine_class=machine_class, trace=trace)
        self.checker = w.checker = _ChaosChecker(w)
        w.observers.append(self._observe)
        for a, b in schedule.cables:
            w.plug(w.nodes[a], w.nodes[b])
        self.rng = random.Random(schedule.seed ^ 0xC4A05)
        self.history = History()
        self.running = set(range(schedule.hosts))
        """Hosts that should run once everything heals (the starters and joined spares)."""
        self.reads: dict[int, _Read] = {}
        self.ctx = 0
        self.acted: dict[int, tuple[str, int, int]] = {}
        """host -> (cluster, incarnation, commit) as of its last Ready on disk: what it may report."""
        self.sampled: dict[tuple[int, int, str], int] = {}
        self.t0_us = 0
        self.skipped: list[str] = []
        self.leaving: dict[int, tuple[str, int]] = {}
        self.clients_done = False

    # ------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        result = ChaosResult(Verdict(), self.history)
        extra: list[Violation] = []
        end = EndState(False, "the run did not finish")
        try:
            end = self._run(result)
        except InvariantViolated as exc:
            extra.append(Violation(exc.invariant, exc.detail))
            end = EndState(True)  # judged by the safety violation, not by liveness
        except Exception as exc:  # a crash inside the core is a finding too
            extra.append(Violation("core-exception", f"{type(exc).__name__}: {exc}"))
            end = EndState(True)
        verdict = judge(self.history, end)
        result.verdict = Verdict(tuple(extra) + verdict.violations)
        result.skipped = self.skipped
        result.events = self.world.events
        result.trace_digest = self.world.trace_digest()
        return result

    @property
    def now_s(self) -> float:
        return (self.world.now_us - self.t0_us) / US

    def _run(self, result: ChaosResult) -> EndState:
        w = self.world
        s = self.schedule
        for i in range(s.hosts):
            w.at(w.rng.randint(0, 50_000), lambda node=w.nodes[i]: w.boot(node))
        starters = w.nodes[: s.hosts]
        if not w.run_until(int(FORMATION_BOUND_S * US), stop=lambda: all(n.alive for n in starters) and w.converged()):
            return EndState(False, f"no single cluster of {s.hosts} within {FORMATION_BOUND_S:g} s of starting")
        result.formation_s = w.now_us / US
        leader = w.leader()
        assert leader is not None and leader.machine is not None and leader.machine.raft is not None
        initial = leader.machine.raft.cluster
        self.t0_us = w.now_us
        # The clients and the observer run from the first step until the cluster converged
        # after the last one healed (or the bound passed).
        heal_s = s.end_s
        for step in s.steps:
            w.at(self._us(step.at_s), lambda step=step: self._fire(step))
        for c in range(CLIENTS):
            t = READ_EVERY_S * (c + 1) / CLIENTS
            while t < heal_s + CONVERGE_BOUND_S:
                w.at(self._us(t), self._client_read)
                t += READ_EVERY_S
        t = SAMPLE_EVERY_S
        while t < heal_s + CONVERGE_BOUND_S:
            w.at(self._us(t), self._sample_all)
            t += SAMPLE_EVERY_S
        w.run_until(self._us(heal_s))
        self._heal_all()
        healed_us = w.now_us
        converged = w.run_until(healed_us + int(CONVERGE_BOUND_S * US), stop=w.converged)
        self.clients_done = True
        if not converged:
            return EndState(False, f"not one healthy cluster of every running host {CONVERGE_BOUND_S:g} s after the last "
                            "fault healed")
        result.converge_s = (w.now_us - healed_us) / US
        w.run_until(w.now_us + int(CLIENT_TIMEOUT_S * US) + 1)  # reads still in flight end (answer or bound)
        self._sample_all(full=True)
        top = w.leader()
        assert top is not None and top.machine is not None and top.machine.raft is not None
        r = top.machine.raft
        return EndState(True, cluster=r.cluster, commit=self.acted.get(top.index, (r.cluster, 0, r.commit))[2],
                        initial_cluster=initial)

    def _us(self, t_s: float) -> int:
        return self.t0_us + int(round(t_s * US))

    # ------------------------------------------------------------------------------
    # Steps

    def _resolve(self, step: ChaosStep) -> SimNode | None:
        w = self.world
        if step.host is None:
            node = w.leader()
            if node is None:
                self.skipped.append(f"{step.describe()}: no leader")
            return node
        return w.nodes[step.host]

    def _fire(self, step: ChaosStep) -> None:
        w = self.world
        w.note(f"chaos {step.describe()}")
        node = self._resolve(step)
        if node is None:
            return
        later = self.world.now_us + int(step.duration_s * US)
        if step.kind == "kill":
            self._crash(node)
            w.at(later, lambda: self._restart(node))
        elif step.kind == "stop":
            w.pause(node)
            w.at(later, lambda: w.resume(node))
        elif step.kind == "unplug":
            cut = self._unplug(node, step.peer)
            if step.peer is not None:
                recovered = w.now_us + int(min(step.duration_s, PATH_RECOVERY_S) * US)
                w.at(recovered, lambda: w.net.mend(cut))  # type: ignore[arg-type]
            w.at(later, lambda: self._replug(node, step.peer, [] if step.peer is not None else cut))
        elif step.kind == "leave":
            m = node.machine
            if m is None or not node.alive:
                self.skipped.append(f"{step.describe()}: h{node.index} is not running")
                return
            self.leaving[node.index] = (node.node_id, m.inc)
            w.leave(node)
            w.at(later, lambda: self._rejoin(node, tries=int(LEAVE_WAIT_S * 10)))
        elif step.kind == "join":
            self.running.add(node.index)
            w.boot(node)

    def _crash(self, node: SimNode) -> None:
        self._fail_reads(node, "the agent closed the connection without answering")
        self.acted.pop(node.index, None)  # a restarted process reports only what it saved itself
        self.world.crash(node)

    def _restart(self, node: SimNode) -> None:
        if not node.alive and not node.left:
            self.world.boot(node)

    def _unplug(self, node: SimNode, peer: int | None) -> list[tuple[str, str]]:
        w = self.world
        if peer is not None:
            cable = w.cabling.between(node.index, peer)
            if cable is not None:
                w.unplug(cable)
            return w.net.cut(node.node_id, w.nodes[peer].node_id)  # type: ignore[return-value]
        # The LAN cable: only the ring cables still plugged at this host carry its traffic.
        pairs: list[tuple[str, str]] = []
        for other in w.nodes:
            if other is not node and w.cabling.between(node.index, other.index) is None:
                pairs += w.net.cut(node.node_id, other.node_id)
        return pairs

    def _replug(self, node: SimNode, peer: int | None, pairs: list[tuple[str, str]]) -> None:
        w = self.world
        if peer is not None and w.cabling.between(node.index, peer) is None:
            w.plug(node, w.nodes[peer])
        w.net.mend(pairs)  # type: ignore[arg-type]

    def _rejoin(self, node: SimNode, tries: int) -> None:
        w = self.world
        if node.alive and not node.left and tries > 0:
            # The leave has not finished (the real tool waits for the leave op too).
            w.at(w.now_us + 100_000, lambda: self._rejoin(node, tries - 1))
            return
        if node.alive:
            self._crash(node)
        if not node.alive:
            w.wipe(node)
            w.boot(node)

    def _heal_all(self) -> None:
        w = self.world
        w.note("chaos heal")
        w.net.heal()
        for a, b in self.schedule.cables:
            if w.cabling.between(a, b) is None:
                w.plug(w.nodes[a], w.nodes[b])
        for i in sorted(self.running):
            w.revive(w.nodes[i])

    # ------------------------------------------------------------------------------
    # Clients and the log observer

    def _client_read(self) -> None:
        if self.clients_done:
            return
        w = self.world
        host = self.rng.choice(sorted(self.running))
        node = w.nodes[host]
        now = self.now_s
        r = node.machine.raft if node.machine is not None else None
        if not node.alive or node.machine is None:
            self.history.reads.append(ReadOp(host, now, now, error="no agent is running"))
            return
        if r is None or host not in self.acted:
            self.history.reads.append(ReadOp(host, now, now, error="this agent is not in a cluster yet"))
            return
        self.ctx += 1
        ctx = self.ctx
        self.reads[ctx] = _Read(host, now, node.gen, r.cluster)
        # A stopped agent's socket still accepts: the request waits in the backlog and is
        # served after SIGCONT, unless the client's own timeout ends it first.
        w.read(node, ctx)
        bound = CLIENT_TIMEOUT_S if node.paused else READ_TIMEOUT_S
        w.at(w.now_us + int(bound * US), lambda: self._read_timeout(ctx, bound))

    def _read_timeout(self, ctx: int, bound: float) -> None:
        pending = self.reads.pop(ctx, None)
        if pending is not None:
            self.history.reads.append(ReadOp(pending.host, pending.invoke_s, pending.invoke_s + bound,
                                             error=f"no answer within {bound:g} s"))

    def _fail_reads(self, node: SimNode, why: str) -> None:
        for ctx, pending in list(self.reads.items()):
            if pending.host == node.index:
                del self.reads[ctx]
                self.history.reads.append(ReadOp(pending.host, pending.invoke_s, self.now_s, error=why))

    def _observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        seen = self.checker.at_handle.pop(id(ready), None)
        if seen is None:
            return
        cluster, inc, commit, views = seen
        self.acted[node.index] = (cluster, inc, commit)
        for ctx, ok in ready.reads:
            pending = self.reads.get(ctx)
            if pending is None or pending.host != node.index or pending.gen != node.gen:
                continue
            del self.reads[ctx]
            view = views.get(ctx)
            now = self.now_s
            if not ok:
                self.history.reads.append(ReadOp(node.index, pending.invoke_s, now, error="the cluster could not confirm its leader"))
            elif view is None or view.cluster != pending.cluster:
                self.history.reads.append(ReadOp(node.index, pending.invoke_s, now, error="this agent changed clusters"))
            else:
                self.history.reads.append(ReadOp(node.index, pending.invoke_s, now, view=view))
        if ready.left and node.index in self.leaving:
            node_id, inc = self.leaving.pop(node.index)
            m = node.machine
            if m is not None and m.raft is not None and m.leave_confirmed:
                # The removal's index is not known here (the leader stops replicating to a
                # member once its removal is appended): the ack binds membership, not version.
                self.history.acks.append(Ack(self.now_s, m.raft.cluster, 0, (node_id, inc)))
        if ready.left or not node.alive:
            self.acted.pop(node.index, None)

    def _sample_all(self, *, full: bool = False) -> None:
        if self.clients_done and not full:
            return
        for host in sorted(self.running):
            node = self.world.nodes[host]
            if not node.alive or node.paused or node.machine is None or host not in self.acted:
                continue
            r = node.machine.raft
            cluster, inc, commit = self.acted[host]
            if r is None or (r.cluster, node.machine.inc) != (cluster, inc):
                continue  # switching to a new log: the agent answers "retry"
            key = (host, node.gen, cluster)
            after = 0 if full else self.sampled.get(key, 0)
            entries: list[tuple[int, int, str]] = []
            while True:  # pages of LOG_PAGE_MAX, as the real observer asks
                lo = max(after + 1, r.log.first_index)
                count = max(0, min(LOG_PAGE_MAX, commit - lo + 1))
                page = r.log.slice(lo, count) if count else ()
                entries += [(e.index, e.term, wire.digest(e.command)) for e in page]
                if not full or not page:
                    break
                after = page[-1].index
            if entries:
                self.sampled[key] = max(self.sampled.get(key, 0), entries[-1][0])
            self.history.samples.append(LogSample(self.now_s, host, node.gen, cluster, inc, commit, tuple(entries)))


def run_chaos(schedule: ChaosSchedule, *, machine_class: type[Machine] = Machine, trace: TextIO | None = None) -> ChaosResult:
    return ChaosScenario(schedule, machine_class=machine_class, trace=trace).run()
