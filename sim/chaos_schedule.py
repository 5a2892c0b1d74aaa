"""Chaos schedules: the faults the chaos tool performs on real agents (scripts/chaos.py) and
the simulator replays (sim/chaos_scenario.py), as one value both sides read.

A schedule is drawn from a seed, before anything runs, and saved as JSON; either side can
load it and play it in its own world, so the same schedule gets a verdict from real
processes and one from the simulator. Pure: no clock, no I/O, no global random generator.

Steps are sequential: a step's fault heals (restart, SIGCONT, replug, rejoin) and a settle
gap passes before the next one starts. So at most one host is impaired at a time, and a
majority of the voters stays up except for moments (a restarted host catching up, a
rejoined one still a learner). The claim the chaos tool checks is safety always and
liveness once everything has healed.

Hosts are numbered as on the namespace bench: 0..hosts-1 start the run, hosts..hosts+spares-1
are spares that a ``join`` step starts. Cables are the bench's Thunderbolt ring over all of
them (p2pmesh/cli/netns.py ``plug_ring``); every host is also on the LAN switch.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

KINDS = ("kill", "stop", "unplug", "leave", "join")
"""kill: SIGKILL, restart from disk after duration_s.  stop: SIGSTOP, SIGCONT after
duration_s.  unplug: pull a cable, plug it back after duration_s (``peer`` is the far end of
a ring cable; None: the host's LAN cable).  leave: a graceful leave, then after duration_s
a rejoin as a fresh node (state wiped, identity kept).  join: a spare host starts."""

WEIGHTS = {"kill": 3, "stop": 2, "unplug": 3, "leave": 2, "join": 1}
DURATION_S = {"kill": (1.0, 6.0), "stop": (0.3, 5.0), "unplug": (1.0, 8.0), "leave": (2.0, 6.0), "join": (0.0, 0.0)}
SETTLE_S = (2.0, 5.0)
"""Gap between one step's heal and the next step: time to re-elect, catch up, promote."""
SETTLE_AFTER_MEMBERSHIP_S = 3.0
"""At least this after a rejoin or a join: the new member must become a voter before the
next fault, or one more fault would leave the voters without a majority."""
FIRST_AT_S = 1.0
LEADER_SHARE = 0.3
"""Share of kill, stop and leave steps aimed at whoever leads when the step fires."""
LAN_SHARE = 0.3
"""Share of unplug steps that pull a host's LAN cable rather than a ring cable."""
CONVERGE_BOUND_S = 30.0
"""After everything heals, one healthy cluster of every running host within this."""
FORMATION_BOUND_S = 60.0
CLIENTS = 2
READ_EVERY_S = 0.15
"""Each client reads the membership at a random running host this often (both sides)."""
SAMPLE_EVERY_S = 0.5
"""The committed-log observer asks every running host this often."""
LOG_PAGE_MAX = 256
HOSTS_MAX = 16
SPARES_MAX = 4
MINUTES_MAX = 600.0
STEPS_MAX = 10_000
SCHEDULE_VERSION = 1


class ScheduleError(ValueError):
    """A schedule (arguments or a JSON file) that cannot be played, and why."""


@dataclass(frozen=True, slots=True)
class ChaosStep:
    at_s: float
    """Seconds after the fault phase starts (the cluster has formed)."""
    kind: str
    host: int | None
    """The host the fault hits; None: the leader when the step fires (kill, stop, leave)."""
    duration_s: float
    peer: int | None = None
    """unplug only: the far end of the ring cable; None means the host's LAN cable."""

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    def describe(self) -> str:
        who = "leader" if self.host is None else f"h{self.host}"
        if self.kind == "unplug":
            cable = f"h{self.host} LAN" if self.peer is None else f"h{self.host}-h{self.peer}"
            return f"{self.at_s:7.2f}s unplug {cable} for {self.duration_s:.2f}s"
        if self.kind == "join":
            return f"{self.at_s:7.2f}s join {who}"
        return f"{self.at_s:7.2f}s {self.kind} {who} for {self.duration_s:.2f}s"


@dataclass(frozen=True, slots=True)
class ChaosSchedule:
    seed: int
    hosts: int
    spares: int
    minutes: float
    cables: tuple[tuple[int, int], ...]
    steps: tuple[ChaosStep, ...]

    @property
    def end_s(self) -> float:
        """When the last step has healed (the fault phase ends here at the latest)."""
        return max((s.end_s for s in self.steps), default=0.0)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for s in self.steps:
            out[s.kind] += 1
        return out

    def summary(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.counts().items() if n)
        return (f"seed {self.seed}: {self.hosts} hosts + {self.spares} spares, {self.minutes:g} min, "
                f"{len(self.steps)} steps ({counts or 'none'})")

    def to_json(self) -> str:
        body = {
            "version": SCHEDULE_VERSION,
            "seed": self.seed,
            "hosts": self.hosts,
            "spares": self.spares,
            "minutes": self.minutes,
            "cables": [list(c) for c in self.cables],
            "steps": [asdict(s) for s in self.steps],
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ChaosSchedule:
        try:
            raw = json.loads(text)
            if raw.get("version") != SCHEDULE_VERSION:
                raise ScheduleError(f"schedule version {raw.get('version')!r}, expected {SCHEDULE_VERSION}")
            steps = tuple(
                ChaosStep(float(s["at_s"]), str(s["kind"]), None if s["host"] is None else int(s["host"]),
                          float(s["duration_s"]), None if s.get("peer") is None else int(s["peer"]))
                for s in raw["steps"]
            )
            schedule = cls(int(raw["seed"]), int(raw["hosts"]), int(raw["spares"]), float(raw["minutes"]),
                           tuple((int(a), int(b)) for a, b in raw["cables"]), steps)
        except ScheduleError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ScheduleError(f"not a chaos schedule: {type(exc).__name__}: {exc}") from None
        schedule.validate()
        return schedule

    def validate(self) -> None:
        """Raise ScheduleError unless every step can be played in order on this bench."""
        check_size(self.hosts, self.spares, self.minutes)
        total = self.hosts + self.spares
        for a, b in self.cables:
            if not (0 <= a < total and 0 <= b < total and a != b):
                raise ScheduleError(f"cable {a}-{b} does not join two hosts of {total}")
        if len(self.steps) > STEPS_MAX:
            raise ScheduleError(f"{len(self.steps)} steps; at most {STEPS_MAX}")
        members = set(range(self.hosts))
        joined = self.hosts
        healed = 0.0
        for s in self.steps:
            where = f"step at {s.at_s}s ({s.kind})"
            if s.kind not in KINDS:
                raise ScheduleError(f"{where}: unknown kind; choose from {', '.join(KINDS)}")
            if s.at_s < healed or s.duration_s < 0:
                raise ScheduleError(f"{where}: steps must not overlap and durations must be >= 0")
            if s.kind == "join":
                if s.host != joined or joined >= total:
                    raise ScheduleError(f"{where}: the next spare to join is h{joined} (of {total} hosts)")
                joined += 1
                members.add(s.host)
            elif s.host is None:
                if s.kind not in ("kill", "stop", "leave"):
                    raise ScheduleError(f"{where}: only kill, stop and leave may aim at the leader")
            elif s.host not in members:
                raise ScheduleError(f"{where}: h{s.host} is not a running host")
            if s.kind == "unplug" and s.peer is not None and (s.host, s.peer) not in self.cables:
                raise ScheduleError(f"{where}: no ring cable h{s.host}-h{s.peer} (cables are listed as pairs)")
            healed = s.end_s


def check_size(hosts: int, spares: int, minutes: float) -> None:
    if not 3 <= hosts <= HOSTS_MAX:
        raise ScheduleError(f"--hosts must be 3 to {HOSTS_MAX}: fewer cannot keep a majority through one fault")
    if not 0 <= spares <= SPARES_MAX:
        raise ScheduleError(f"--spares must be 0 to {SPARES_MAX}")
    if not 0 < minutes <= MINUTES_MAX:
        raise ScheduleError(f"--minutes must be in (0, {MINUTES_MAX:g}]")


def ring_cables(count: int) -> tuple[tuple[int, int], ...]:
    """The ring the bench plugs over ``count`` hosts (Bench.plug_ring): i to i+1, closed."""
    return tuple((i, (i + 1) % count) for i in range(count if count > 2 else count - 1))


def draw(seed: int, *, hosts: int, minutes: float, spares: int = 1,
         cables: tuple[tuple[int, int], ...] | None = None) -> ChaosSchedule:
    """The schedule of ``seed``: sequential steps until ``minutes`` is used up."""
    check_size(hosts, spares, minutes)
    cables = ring_cables(hosts + spares) if cables is None else cables
    rng = random.Random(seed)
    members = list(range(hosts))
    next_spare = hosts
    end_s = minutes * 60.0
    steps: list[ChaosStep] = []
    t = FIRST_AT_S
    while len(steps) < STEPS_MAX:
        kinds = [k for k in KINDS if k != "join" or next_spare < hosts + spares]
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        lo, hi = DURATION_S[kind]
        duration = round(rng.uniform(lo, hi), 2)
        host: int | None
        peer: int | None = None
        if kind == "join":
            host = next_spare
        elif kind in ("kill", "stop", "leave") and rng.random() < LEADER_SHARE:
            host = None
        elif kind == "unplug":
            # Ring cables with both ends running (a dangling spare's cable changes nothing).
            usable = [c for c in cables if c[0] in members and c[1] in members]
            if usable and rng.random() >= LAN_SHARE:
                host, peer = rng.choice(usable)
            else:
                host = rng.choice(members)
        else:
            host = rng.choice(members)
        if t + duration > end_s:
            break
        steps.append(ChaosStep(round(t, 2), kind, host, duration, peer))
        if kind == "join":
            members.append(next_spare)
            next_spare += 1
        settle = rng.uniform(*SETTLE_S)
        if kind in ("leave", "join"):
            settle = max(settle, SETTLE_AFTER_MEMBERSHIP_S)
        t = round(t + duration + settle, 2)
    schedule = ChaosSchedule(seed, hosts, spares, minutes, cables, tuple(steps))
    schedule.validate()
    return schedule
