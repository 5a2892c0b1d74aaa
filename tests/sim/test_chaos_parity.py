"""Chaos schedules in the simulator (sim/chaos_schedule.py, sim/chaos_scenario.py): the
schedules scripts/chaos.py plays on real agents pass here too, deterministically; the
checkers have teeth on planted bugs and on doctored histories. The real side of the parity
is tests/agent/test_chaos_netns.py."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.chaos_scenario import run_chaos
from sim.chaos_schedule import KINDS, ChaosSchedule, ChaosStep, ScheduleError, draw, ring_cables
from sim.history import EndState, History, judge
from sim.observations import Ack, LogSample, ReadOp
from sim.plants import machine_class_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_schedule_is_a_function_of_its_seed_and_survives_json() -> None:
    a = draw(11, hosts=4, minutes=2, spares=2)
    assert a == draw(11, hosts=4, minutes=2, spares=2)
    assert a != draw(12, hosts=4, minutes=2, spares=2)
    assert ChaosSchedule.from_json(a.to_json()) == a
    assert a.cables == ring_cables(6)
    assert all(s.kind in KINDS for s in a.steps) and a.end_s <= 120
    for prev, nxt in zip(a.steps, a.steps[1:]):
        assert nxt.at_s >= prev.end_s + 2.0  # sequential, with time to settle


def test_schedules_cover_every_kind_of_fault() -> None:
    kinds = {s.kind for seed in range(10) for s in draw(seed, hosts=5, minutes=3, spares=1).steps}
    assert kinds == set(KINDS)
    targets = {(s.host is None, s.peer is None) for seed in range(10) for s in draw(seed, hosts=5, minutes=3).steps
               if s.kind == "unplug"}
    assert targets == {(False, True), (False, False)}  # LAN cables and ring cables


@pytest.mark.parametrize("bad, why", [
    (dict(steps=(ChaosStep(1.0, "kill", 0, 5.0), ChaosStep(3.0, "stop", 1, 1.0))), "overlap"),
    (dict(steps=(ChaosStep(1.0, "explode", 0, 1.0),)), "unknown kind"),
    (dict(steps=(ChaosStep(1.0, "kill", 3, 1.0),)), "not a running host"),
    (dict(steps=(ChaosStep(1.0, "join", 4, 0.0),)), "next spare"),
    (dict(steps=(ChaosStep(1.0, "unplug", 0, 1.0, peer=2),)), "no ring cable"),
    (dict(steps=(ChaosStep(1.0, "unplug", None, 1.0),)), "only kill, stop and leave"),
    (dict(hosts=2), "majority"),
])
def test_unplayable_schedules_are_refused_with_the_reason(bad: dict, why: str) -> None:  # type: ignore[type-arg]
    base = ChaosSchedule(0, 3, 1, 1.0, ring_cables(4), ())
    with pytest.raises(ScheduleError, match=why):
        dataclasses.replace(base, **bad).validate()
    with pytest.raises(ScheduleError, match="not a chaos schedule"):
        ChaosSchedule.from_json('{"version": 1, "seed": 0}')


@pytest.mark.parametrize("seed, hosts, spares", [(0, 3, 1), (1, 3, 1), (2, 4, 1), (3, 5, 2)])
def test_drawn_schedules_pass_in_the_simulator(seed: int, hosts: int, spares: int) -> None:
    schedule = draw(seed, hosts=hosts, minutes=1.5, spares=spares)
    r = run_chaos(schedule)
    assert r.verdict.ok, r.verdict.violations
    counts = r.history.counts()
    assert counts["reads_ok"] > counts["reads"] // 2 and counts["reads_unclear"] == 0
    assert counts["entries_seen"] > 0 and r.converge_s is not None and r.converge_s < 30


def test_the_same_schedule_replays_to_the_same_trace() -> None:
    schedule = draw(5, hosts=3, minutes=0.5)
    assert run_chaos(schedule).trace_digest == run_chaos(schedule).trace_digest


def test_a_confirmed_leave_is_an_acknowledged_write_that_catches_node_id_reuse() -> None:
    """The planted reuse-node-id bug (a wiped Mac rejoins under its old incarnation) shows
    up in the history: a read lists the incarnation whose leave was confirmed."""
    schedule = draw(0, hosts=3, minutes=1)
    assert any(s.kind == "leave" for s in schedule.steps)
    assert run_chaos(schedule).verdict.ok
    planted = run_chaos(schedule, machine_class=machine_class_for("reuse-node-id"))
    assert "read-sees-removed" in planted.verdict.names


def _doctored(h: History, **changes: object) -> History:
    return dataclasses.replace(h, **changes)  # type: ignore[arg-type]


def test_doctored_histories_of_a_passing_run_fail() -> None:
    """The judging path has teeth on a realistic history: one changed record is enough."""
    r = run_chaos(draw(0, hosts=3, minutes=1))
    h, end = r.history, EndState(True, cluster=None, commit=0)
    ok = [x for x in h.reads if x.view is not None]
    cluster = ok[0].view.cluster  # type: ignore[union-attr]
    top = max(s.commit for s in h.samples if s.cluster == cluster)
    end = EndState(True, cluster=cluster, commit=top, initial_cluster=cluster)
    assert judge(h, end).ok
    # A late read answers the very first version: stale.
    last = ok[-1]
    stale = dataclasses.replace(last, view=dataclasses.replace(last.view, index=1))  # type: ignore[arg-type]
    assert "read-stale" in judge(_doctored(h, reads=[*h.reads, stale]), end).names
    # One committed entry reported with another digest: divergence.
    s = next(x for x in h.samples if x.entries)
    forged = dataclasses.replace(s, at_s=s.at_s + 0.01, entries=((s.entries[0][0], s.entries[0][1], "f" * 16),))
    assert "log-divergence" in judge(_doctored(h, samples=[*h.samples, forged]), end).names
    # The leaver listed by a read that began after its confirmed leave.
    ack = h.acks[0]
    assert ack.removed is not None
    ghost = dataclasses.replace(last, view=dataclasses.replace(
        last.view, members=last.view.members | {(*ack.removed, True, True)}))  # type: ignore[union-attr]
    assert "read-sees-removed" in judge(_doctored(h, reads=[*h.reads, ghost]), end).names
    # An answer that is neither a membership nor a clear error.
    odd = ReadOp(0, 1.0, 1.1, unclear="ValueError: malformed members answer")
    assert judge(_doctored(h, reads=[*h.reads, odd]), end).names == ("request-unclear",)
    # The healed cluster lost the last committed entries.
    assert "committed-lost" in judge(h, dataclasses.replace(end, commit=top - 1)).names
    assert isinstance(ack, Ack) and isinstance(s, LogSample)


def test_the_command_line_plays_a_saved_schedule(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(draw(1, hosts=3, minutes=0.5).to_json())
    out = subprocess.run([sys.executable, "-m", "sim", "chaos", "--schedule", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verdict"] == [] and summary["seed"] == 1
    path.write_text("{}")
    bad = subprocess.run([sys.executable, "-m", "sim", "chaos", "--schedule", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "schedule" in bad.stderr
