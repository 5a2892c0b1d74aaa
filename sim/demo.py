"""The narrated demo behind scripts/demo (for now: a simulated cluster of 5 Macs).

It tells the story a user cares about, in virtual time: five Macs boot with no
configuration and form one cluster; the leader crashes and another takes over; a sixth Mac
is plugged in and becomes a voter; one Mac leaves gracefully. After each step it checks the
outcome, so the demo fails loudly if the behaviour regresses.
"""
from __future__ import annotations

from collections.abc import Callable

from p2pmesh.core.machine import Effects, Ready
from p2pmesh.core.raft import Role
from sim.node import SimNode
from sim.scenario import SIM_SETTINGS
from sim.world import World

STEP_BOUND_US = 5_000_000


class _Narrator:
    def __init__(self, world: World) -> None:
        self.world = world
        self.names = {n.node_id: n.name for n in world.nodes}
        world.observers.append(self.observe)
        self.seen: set[tuple[str, str, str]] = set()

    def name(self, node_id: str) -> str:
        if node_id not in self.names:
            for n in self.world.nodes:
                self.names[n.node_id] = n.name
        return self.names.get(node_id, node_id[:8])

    def say(self, text: str) -> None:
        print(f"[{self.world.now_us / 1e6:7.3f} s] {text}", flush=True)

    def observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        # Narrate cluster events once, from the leader's point of view.
        m = node.machine
        for ev in effects.events:
            subject = ev.detail.split(" ")[0]
            if ev.kind.startswith("member") and (m is None or m.raft is None or m.raft.role is not Role.LEADER):
                continue
            if ev.kind == "leader elected":
                term = ev.detail.split("term ")[-1]
                key = ("leader", subject, term)
                text = f"{self.name(subject)} is the leader (term {term})"
            elif ev.kind.startswith("member"):
                key = (ev.kind, subject, "")
                text = f"{self.name(subject)}: {ev.kind.replace('member ', '')}"
            else:
                key = (ev.kind, node.name, ev.detail)
                text = f"{node.name}: {ev.kind} {ev.detail}"
            if key not in self.seen:
                self.seen.add(key)
                self.say(text)


def _wait(world: World, until: Callable[[], bool], what: str) -> None:
    if not world.run_until(world.now_us + STEP_BOUND_US, stop=until):
        raise SystemExit(f"demo failed: {what} did not happen within {STEP_BOUND_US // 1_000_000} s")


def run_demo(seed: int) -> int:
    world = World(seed, nodes=5, settings=SIM_SETTINGS)
    narrator = _Narrator(world)
    print("p2pmesh demo: a simulated cluster of 5 Macs on Thunderbolt-class links (0.1-1 ms)")
    print("Every Mac runs the same agent with no configuration; time below is virtual.\n")

    narrator.say("five Macs power on")
    for node in world.nodes:
        world.boot(node)
    _wait(world, world.converged, "formation")
    leader = world.leader()
    assert leader is not None
    narrator.say(f"formed one cluster of 5 voters; {leader.name} leads\n")

    narrator.say(f"{leader.name} crashes (power cut)")
    crashed_at = world.now_us
    world.crash(leader)

    def new_leader() -> bool:
        current = world.leader()
        return current is not None and current is not leader and current.machine.raft.commit >= current.machine.raft.term_start_index  # type: ignore[union-attr]

    _wait(world, new_leader, "re-election")
    new = world.leader()
    assert new is not None
    narrator.say(f"{new.name} took over and committed after {(world.now_us - crashed_at) / 1000:.0f} ms")
    narrator.say(f"{leader.name} restarts from its own disk")
    world.boot(leader)
    _wait(world, world.converged, "rejoin after restart")
    narrator.say("all 5 Macs are up-to-date voters again\n")

    narrator.say("a sixth Mac is cabled in")
    joined_at = world.now_us
    newcomer = world.add_node(boot=True)
    _wait(world, world.converged, "join")
    narrator.say(f"{newcomer.name} is a voter {(world.now_us - joined_at) / 1000:.0f} ms after it appeared\n")

    current = world.leader()
    assert current is not None
    narrator.say(f"{current.name} (the leader) leaves gracefully: leadership transfer, then removal")
    world.leave(current)
    _wait(world, lambda: current.left and world.converged(), "graceful leave")
    final = world.leader()
    assert final is not None
    members = len(final.machine.raft.state.members)  # type: ignore[union-attr]
    narrator.say(f"{current.name} left; {final.name} leads a cluster of {members} voters\n")
    print(f"done: {world.events} events, {world.now_us / 1e6:.2f} s of virtual time, every invariant held")
    return 0
