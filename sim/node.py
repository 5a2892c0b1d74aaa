"""SimNode: one simulated Mac as the world drives it: its identity and disk, its running
machine (None while it is down), and the world's bookkeeping for it (the generation that
tells a stale timer or fsync from a current one, the pending timer, the disk's queue, the
inputs deferred while it is paused). The world (sim/world.py) owns the nodes; the checker
(sim/checks.py) reads them, so both import this module and neither needs the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import Machine
from p2pmesh.core.messages import Capabilities
from sim.disk import SimDisk


@dataclass(slots=True)
class SimNode:
    index: int
    node_id: NodeId
    disk: SimDisk
    caps: Capabilities
    machine: Machine | None = None
    alive: bool = False
    paused: bool = False
    left: bool = False
    gen: int = 0
    timer_at: int = -1
    disk_free_at: int = 0
    deferred: list[tuple[int, Any]] = field(default_factory=list)
    booted_us: int = 0

    @property
    def name(self) -> str:
        return f"n{self.index}"
