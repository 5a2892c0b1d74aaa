"""A short chaos run on real agents in network namespaces (scripts/chaos.py), and the
simulator's verdict on the very same schedule: both pass. The recorded real history is
then doctored, one record at a time, to show the judging path fails what it should.

Seed 7's 45 s schedule has every kind of fault: SIGSTOP (once aimed at the leader), SIGKILL,
a graceful leave of the leader and of a follower with rejoins, a spare joining, a ring
cable and a LAN cable unplugged. Longer runs: docs/reliability.md."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from sim.chaos_scenario import run_chaos
from sim.chaos_schedule import ChaosSchedule
from sim.history import EndState, History, judge
from tests.agent.harness import ROOT
from tests.agent.netns import require_root

SEED = 7
RUN_TIMEOUT_S = 240


def test_a_short_real_chaos_run_passes_and_the_simulator_agrees(tmp_path: Path) -> None:
    require_root()
    schedule_file, history_file = tmp_path / "schedule.json", tmp_path / "history.json"
    out = subprocess.run(
        [sys.executable, "scripts/chaos.py", "--hosts", "3", "--minutes", "0.75", "--seed", str(SEED),
         "--tiny-model", "--save-schedule", str(schedule_file), "--history", str(history_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"chaos seed {SEED}:")
    real = json.loads(lines[-1])
    assert real["seed"] == SEED and real["verdict"] == []
    history = History.from_json(history_file.read_text())
    counts = history.counts()
    assert counts["reads_ok"] > 100 and counts["reads_unclear"] == 0 and counts["acks"] >= 1
    assert counts["entries_seen"] > 10 and real["converge_s"] is not None
    generations = real["generations"]
    assert generations["wrong"] == 0 and generations["unclear"] == 0
    assert generations["completed"] >= 10 and generations["completed"] + generations["failed_clear"] == generations["generations"]

    # Parity: the simulator plays the saved schedule and gives the same verdict.
    schedule = ChaosSchedule.from_json(schedule_file.read_text())
    assert {s.kind for s in schedule.steps} == {"kill", "stop", "unplug", "leave", "join"}
    sim = run_chaos(schedule)
    assert list(sim.verdict.names) == real["verdict"], sim.verdict.violations

    # The real history, doctored, fails: a late read answering the first version, and one
    # committed entry reported with another digest.
    ok = [r for r in history.reads if r.view is not None]
    cluster = ok[0].view.cluster  # type: ignore[union-attr]
    top = max(s.commit for s in history.samples if s.cluster == cluster)
    end = EndState(True, cluster=cluster, commit=top, initial_cluster=cluster)
    assert judge(history, end).ok
    late = ok[-1]
    stale = dataclasses.replace(late, view=dataclasses.replace(late.view, index=1))  # type: ignore[arg-type]
    assert judge(dataclasses.replace(history, reads=[*history.reads, stale]), end).names == ("read-stale",)
    s = next(x for x in history.samples if x.entries)
    forged = dataclasses.replace(s, at_s=s.at_s + 0.001, entries=((s.entries[0][0], s.entries[0][1], "0" * 16),))
    assert judge(dataclasses.replace(history, samples=[*history.samples, forged]), end).names == ("log-divergence",)
