"""Fault kinds and the seeded schedule that injects them.

A schedule is a list of (time_us, Fault) drawn from the run's seed before the run starts;
which node a fault hits is decided when it fires (e.g. "the current leader"), from the
world's seeded generator, so the run stays a pure function of the seed. Every fault heals
itself after a drawn duration; the liveness phase heals whatever is still broken.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_KINDS = (
    "crash",  # crash a node, restart it later from its disk
    "crash-leader",  # the same, aimed at the current leader
    "power-loss",  # crash losing writes not yet fsynced, restart later
    "wipe",  # crash, lose the whole disk (identity kept), restart as a fresh node
    "pause",  # stop a node's process (a Mac asleep), resume later
    "pause-leader",  # the same, aimed at the current leader (its old-term messages arrive late)
    "partition",  # split the nodes into two groups (symmetric)
    "one-way",  # a link that delivers in one direction only (asymmetric)
    "cable",  # unplug the cable between two nodes, plug it back later
    "loss",  # a burst of 10-30% message loss everywhere
    "join",  # a brand-new node appears
    "leave",  # a member leaves gracefully
)


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    duration_us: int


def parse_fault_list(text: str) -> tuple[str, ...]:
    """'all', 'none', or a comma list of FAULT_KINDS; raises ValueError naming the bad one."""
    if text in ("", "none"):
        return ()
    if text == "all":
        return FAULT_KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    for k in kinds:
        if k not in FAULT_KINDS:
            raise ValueError(f"unknown fault {k!r}; choose from: all, {', '.join(FAULT_KINDS)}")
    return kinds


def schedule(
    rng: random.Random,
    kinds: tuple[str, ...],
    *,
    start_us: int,
    end_us: int,
    mean_gap_us: int = 700_000,
    events_max: int = 10_000,
) -> list[tuple[int, Fault]]:
    """Draw fault times as a Poisson process over [start_us, end_us)."""
    out: list[tuple[int, Fault]] = []
    if not kinds:
        return out
    t = start_us
    while len(out) < events_max:
        t += int(rng.expovariate(1.0 / mean_gap_us))
        if t >= end_us:
            break
        kind = rng.choice(kinds)
        duration = int(rng.uniform(0.05, 2.5) * 1_000_000)
        out.append((t, Fault(kind, duration)))
    return out
