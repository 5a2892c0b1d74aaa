#!/usr/bin/env python3
"""Chaos with real processes: agents in network namespaces, a seeded schedule of faults,
client reads, and a verdict the simulator gives too (needs root; docs/reliability.md).

    sudo .venv/bin/python scripts/chaos.py --hosts 3 --minutes 0.75 --seed 1
    sudo .venv/bin/python scripts/chaos.py --schedule FILE [--history FILE] [--keep]

The bench: hosts+spares namespaces on one Ethernet switch, cabled in a Thunderbolt-marked
ring (p2pmesh/netns.py). The first ``--hosts`` agents start and must form one cluster; then
the schedule (sim/chaos_schedule.py) runs in real time: SIGKILL and restart, SIGSTOP and
SIGCONT, a ring or LAN cable unplugged and plugged back, a graceful leave and a rejoin with
a wiped state directory, a spare host joining. Meanwhile:

- clients read the membership at random hosts through the control op ``members`` (a
  linearizable ReadIndex read) and record invoke time, completion time and the answer or
  the error (sim/history.py ``ReadOp``); a confirmed leave is an acknowledged write;
- an observer asks every host for its committed entries (op ``log``: index, term, digest).

At the end every fault is healed (SIGCONT, cables up, dead agents restarted, departed ones
rejoined) and the cluster must converge within CONVERGE_BOUND_S. The history is judged by
sim/history.py and sim/linearizability.py, the same code that judges
``python -m sim chaos --schedule FILE`` on the same schedule. Prints the seed, the
schedule, the history counts and the verdict; exits 1 on any violation, 2 on bad input.
Namespaces and processes are cleaned up on every exit path.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pmesh import netns  # noqa: E402
from p2pmesh.drivers.control import ControlError, request  # noqa: E402
from p2pmesh.drivers.keys import write_key  # noqa: E402
from sim.chaos_schedule import (  # noqa: E402
    CLIENTS,
    CONVERGE_BOUND_S,
    FORMATION_BOUND_S,
    LOG_PAGE_MAX,
    READ_EVERY_S,
    SAMPLE_EVERY_S,
    ChaosSchedule,
    ChaosStep,
    ScheduleError,
    draw,
)
from sim.history import Ack, EndState, History, LogSample, MemberView, ReadOp, Verdict, Violation, judge  # noqa: E402
from tests.agent.harness import AgentProc  # noqa: E402
from tests.agent.netns import Bench  # noqa: E402

CLIENT_TIMEOUT_S = 8.0
"""A read's client gives up after this (the agent's own bound is 5 s once it runs)."""
SAMPLE_TIMEOUT_S = 2.0
LEAVE_WAIT_S = 10.0
EXIT_WAIT_S = 10.0
POLL_S = 0.25
PAGES_MAX = 10_000


class ChaosAbort(Exception):
    """The run could not be carried out (the bench, not the cluster, failed)."""


def _view(answer: dict[str, Any]) -> MemberView:
    """The register value of a `members` answer; ValueError if it is malformed."""
    cluster, index, members = answer.get("cluster_id"), answer.get("index"), answer.get("members")
    if not isinstance(cluster, str) or not isinstance(index, int) or not isinstance(members, list):
        raise ValueError(f"malformed members answer: {str(answer)[:200]}")
    out = set()
    for m in members:
        if not (isinstance(m, dict) and isinstance(m.get("node_id"), str) and isinstance(m.get("inc"), int)
                and isinstance(m.get("voter"), bool) and isinstance(m.get("up"), bool)):
            raise ValueError(f"malformed member: {str(m)[:200]}")
        out.add((m["node_id"], m["inc"], m["voter"], m["up"]))
    return MemberView(cluster, index, frozenset(out))


class Chaos:
    def __init__(self, schedule: ChaosSchedule, root: Path) -> None:
        self.schedule = schedule
        self.root = root
        self.bench: Bench | None = None
        self.agents: list[AgentProc] = []
        self.history = History()
        self.lock = threading.Lock()
        self.running: set[int] = set(range(schedule.hosts))
        """Hosts that should run once everything heals (starters and joined spares)."""
        self.stopped: set[int] = set()
        self.lan_down: set[int] = set()
        self.stop_clients = threading.Event()
        self.rng = random.Random(schedule.seed ^ 0xC4A05)
        self.t0 = time.monotonic()
        self.skipped: list[str] = []
        self.log_after: dict[int, int] = {}
        """host -> the last committed index the observer got from it."""
        self.initial_cluster: str | None = None
        self.formation_s: float | None = None
        self.converge_s: float | None = None
        self.errors: dict[str, int] = {}
        self.exits: list[str] = []

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------------------
    # Bench

    def build(self) -> None:
        s = self.schedule
        total = s.hosts + s.spares
        self.bench = bench = Bench.create(total, prefix="chaos")
        bench.lan()
        bench.plug_ring(thunderbolt=True)
        plugged = tuple((bench.hosts.index(c.a), bench.hosts.index(c.b)) for c in bench.cables)
        if plugged != s.cables:
            raise ChaosAbort(f"the bench's cables {plugged} are not the schedule's {s.cables}")
        key = self.root / "cluster.key"
        write_key(key, random.Random(s.seed).randbytes(32))
        self.agents = bench.agents(self.root, key, tag="h")

    def sock(self, host: int) -> Path:
        return self.agents[host].state_dir / "agent.sock"

    def alive(self, host: int) -> bool:
        p = self.agents[host].proc
        return p is not None and p.poll() is None

    def close(self) -> None:
        self.stop_clients.set()
        for host in list(self.stopped):
            self._signal(host, signal.SIGCONT)
        for a in self.agents:
            try:
                if a.proc is not None and a.proc.poll() is None:
                    a.proc.send_signal(signal.SIGCONT)
                a.stop()
            except Exception as exc:  # cleanup goes on with the others
                print(f"stopping {a.state_dir.name}: {exc}", file=sys.stderr)
        if self.bench is not None:
            self.bench.close()

    # ------------------------------------------------------------------------------
    # Observing

    def ask(self, host: int, op: str, timeout_s: float = SAMPLE_TIMEOUT_S, **fields: Any) -> dict[str, Any] | None:
        try:
            return request(self.sock(host), op, timeout_s=timeout_s, **fields)
        except (ControlError, ValueError, OSError):
            return None

    def views(self, hosts: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for h in hosts:
            a = self.ask(h, "members", linearizable=False)
            if a is not None:
                out[h] = a
        return out

    def one_cluster(self, hosts: list[int]) -> tuple[bool, str, dict[int, dict[str, Any]]]:
        """The convergence check (the simulator's World.converged on real agents): one
        cluster, one leader everybody follows in one term, everybody at the same applied
        index, members exactly the running agents' incarnations, all voters and up."""
        views = self.views(hosts)
        if len(views) != len(hosts):
            return False, f"no answer from h{sorted(set(hosts) - set(views))}", views
        first = views[hosts[0]]
        keys = {(v["cluster_id"], v["leader"], v["term"], v["index"]) for v in views.values()}
        if len(keys) != 1 or first["leader"] is None:
            return False, f"disagree on (cluster, leader, term, index): {sorted(map(str, keys))[:4]}", views
        incs = {(v["me"]["node_id"], v["me"]["inc"]) for v in views.values()}
        members = {(m["node_id"], m["inc"]) for m in first["members"]}
        if members != incs or not all(m["voter"] and m["up"] for m in first["members"]):
            return False, f"members {len(members)} (voters and up: {sum(m['voter'] and m['up'] for m in first['members'])}) " \
                          f"vs {len(incs)} running", views
        return True, "", views

    def client(self, offset_s: float) -> None:
        next_at = time.monotonic() + offset_s
        while not self.stop_clients.is_set():
            delay = next_at - time.monotonic()
            if delay > 0 and self.stop_clients.wait(delay):
                return
            next_at = max(next_at + READ_EVERY_S, time.monotonic())
            with self.lock:
                host = self.rng.choice(sorted(self.running))
            invoke = self.now_s()
            try:
                answer = request(self.sock(host), "members", timeout_s=CLIENT_TIMEOUT_S)
                op = ReadOp(host, invoke, self.now_s(), view=_view(answer))
            except ControlError as exc:
                op = ReadOp(host, invoke, self.now_s(), error=str(exc))
                kind = re.split(r" \(|;", re.sub(r" at /\S+", "", str(exc)))[0][:80]
                with self.lock:
                    self.errors[kind] = self.errors.get(kind, 0) + 1
            except Exception as exc:  # neither an answer nor a clear error: what the check is for
                op = ReadOp(host, invoke, self.now_s(), unclear=f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.history.reads.append(op)

    def observer(self, host: int) -> None:
        while not self.stop_clients.wait(SAMPLE_EVERY_S):
            with self.lock:
                if host not in self.running:
                    continue
            self.sample(host)

    def sample(self, host: int, *, full: bool = False) -> None:
        """One `log` page from ``host`` (with ``full``, every page from the start) as a
        LogSample: its commit index and the committed entries after the last it sent."""
        after = 0 if full else self.log_after.get(host, 0)
        head: dict[str, Any] | None = None
        entries: list[tuple[int, int, str]] = []
        commit = 0
        for _ in range(PAGES_MAX if full else 1):
            page = self.ask(host, "log", after=after, count_max=LOG_PAGE_MAX)
            if page is None or (head is not None and page["pid"] != head["pid"]):
                break  # stopped answering, or restarted between pages: keep what came
            if head is not None and (page["cluster_id"], page["inc"]) != (head["cluster_id"], head["inc"]):
                break
            head = head or page
            commit = max(commit, int(page["commit"]))
            entries += [(int(i), int(t), str(d)) for i, t, d in page["entries"]]
            if not page["entries"]:
                break
            after = entries[-1][0]
        if head is None:
            return
        with self.lock:
            # A new process or log answers from `after` on too: its entries are just as
            # committed, the window merely starts later.
            self.log_after[host] = entries[-1][0] if entries else min(after, commit)
            self.history.samples.append(LogSample(self.now_s(), host, head["pid"], head["cluster_id"], head["inc"],
                                                  commit, tuple(entries)))

    # ------------------------------------------------------------------------------
    # Steps

    def _signal(self, host: int, sig: int) -> None:
        p = self.agents[host].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def leader(self) -> int | None:
        with self.lock:
            hosts = sorted(self.running)
        best: tuple[int, int] | None = None
        for h, v in self.views(hosts).items():
            if v.get("leader") is not None and v["leader"] == v["me"]["node_id"] and (best is None or v["term"] > best[0]):
                best = (v["term"], h)
        return None if best is None else best[1]

    def cable(self, a: int, b: int) -> netns.Cable:
        assert self.bench is not None
        return self.bench.cables[self.schedule.cables.index((a, b))]

    def set_lan(self, host: int, up: bool) -> None:
        assert self.bench is not None
        netns.ip("-n", self.bench.hosts[host], "link", "set", f"lan{host}", "up" if up else "down")
        (self.lan_down.discard if up else self.lan_down.add)(host)

    def restart(self, host: int, *, wipe: bool) -> None:
        a = self.agents[host]
        if self.alive(host):
            return
        if wipe:
            # A rejoin as a fresh node: the log and hard state go, the identity key stays.
            for f in a.state_dir.iterdir():
                if f.name != "identity":
                    f.unlink() if not f.is_dir() else shutil.rmtree(f)
        a.start()

    def check_exits(self) -> None:
        """Between steps every running host's agent must be alive: one that exited by
        itself is a finding (its exit code and last log line are kept), then restarted."""
        with self.lock:
            hosts = sorted(self.running)
        for host in hosts:
            p = self.agents[host].proc
            if p is not None and p.poll() is not None:
                tail = self.agents[host].log_text().strip().splitlines()[-1:] or [""]
                self.exits.append(f"h{host} exited with code {p.returncode} at {self.now_s():.2f}s: {tail[0][-200:]}")
                self.restart(host, wipe=False)

    def wait_exit(self, host: int) -> None:
        p = self.agents[host].proc
        if p is None:
            return
        try:
            p.wait(timeout=EXIT_WAIT_S)
        except Exception:
            self.agents[host].kill()

    def sleep_until(self, t_s: float) -> None:
        while True:
            left = t_s - self.now_s()
            if left <= 0:
                return
            time.sleep(min(left, POLL_S))

    def play(self, step: ChaosStep) -> None:
        self.sleep_until(step.at_s)
        print(f"  {step.describe()}  (at {self.now_s():.2f}s)", flush=True)
        if step.kind == "join":
            assert step.host is not None
            with self.lock:
                self.running.add(step.host)
            self.agents[step.host].start()
            return
        host = self.leader() if step.host is None else step.host
        if host is None:
            self.skipped.append(f"{step.describe()}: no leader")
            print("           skipped: no leader", flush=True)
            return
        if step.host is None:
            print(f"           the leader is h{host}", flush=True)
        heal_at = self.now_s() + step.duration_s
        if step.kind == "kill":
            self.agents[host].kill()
            self.sleep_until(heal_at)
            self.restart(host, wipe=False)
        elif step.kind == "stop":
            self._signal(host, signal.SIGSTOP)
            self.stopped.add(host)
            self.sleep_until(heal_at)
            self._signal(host, signal.SIGCONT)
            self.stopped.discard(host)
        elif step.kind == "unplug":
            assert self.bench is not None
            if step.peer is None:
                self.set_lan(host, False)
                self.sleep_until(heal_at)
                self.set_lan(host, True)
            else:
                cable = self.cable(host, step.peer)
                self.bench.set_link(cable, False)
                self.sleep_until(heal_at)
                self.bench.set_link(cable, True)
        elif step.kind == "leave":
            if not self.alive(host):
                self.skipped.append(f"{step.describe()}: h{host} is not running")
                return
            answer = self._leave(host)
            if answer is not None and answer.get("confirmed") and isinstance(answer.get("cluster_id"), str):
                # An acknowledged write: from now on no read may list this incarnation.
                removed = (str(answer["node_id"]), int(answer["inc"]))
                with self.lock:
                    self.history.acks.append(Ack(self.now_s(), answer["cluster_id"], 0, removed))
            self.wait_exit(host)
            self.sleep_until(heal_at)
            self.restart(host, wipe=True)

    def _leave(self, host: int) -> dict[str, Any] | None:
        # The agent answers once it stopped: within its leave_timeout_ms (5 s) when it holds
        # no model layers, which is always the case here.
        try:
            return request(self.sock(host), "leave", timeout_s=LEAVE_WAIT_S)
        except ControlError as exc:
            print(f"           leave of h{host}: {exc}", flush=True)
            return None

    def heal_all(self) -> None:
        assert self.bench is not None
        for host in list(self.stopped):
            self._signal(host, signal.SIGCONT)
            self.stopped.discard(host)
        for cable in self.bench.cables:
            self.bench.set_link(cable, True)
        for host in list(self.lan_down):
            self.set_lan(host, True)
        with self.lock:
            hosts = sorted(self.running)
        for host in hosts:
            self.restart(host, wipe=False)

    # ------------------------------------------------------------------------------

    def run(self) -> tuple[Verdict, EndState]:
        s = self.schedule
        self.build()
        start = time.monotonic()
        for host in range(s.hosts):
            self.agents[host].start()
        starters = list(range(s.hosts))
        ok, why, views = False, "", {}
        while time.monotonic() - start < FORMATION_BOUND_S:
            ok, why, views = self.one_cluster(starters)
            if ok:
                break
            time.sleep(POLL_S)
        if not ok:
            end = EndState(False, f"formation: no single cluster of {s.hosts} within {FORMATION_BOUND_S:g} s ({why})")
            return self.judge(end), end
        self.formation_s = time.monotonic() - start
        self.initial_cluster = views[0]["cluster_id"]
        print(f"formed cluster {self.initial_cluster[:8]} of {s.hosts} in {self.formation_s:.1f} s", flush=True)
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.client, args=(READ_EVERY_S * (c + 1) / CLIENTS,), daemon=True)
                   for c in range(CLIENTS)]
        threads += [threading.Thread(target=self.observer, args=(h,), daemon=True) for h in range(s.hosts + s.spares)]
        for t in threads:
            t.start()
        for step in s.steps:
            self.check_exits()
            self.play(step)
        # The clients and the observer keep going until the cluster converged after the last
        # fault healed (or the bound passed).
        self.sleep_until(s.end_s)
        self.check_exits()
        print(f"  {self.now_s():7.2f}s heal everything", flush=True)
        self.heal_all()
        healed = time.monotonic()
        with self.lock:
            hosts = sorted(self.running)
        while time.monotonic() - healed < CONVERGE_BOUND_S:
            ok, why, views = self.one_cluster(hosts)
            if ok:
                break
            time.sleep(POLL_S)
        converged_at = time.monotonic()
        self.stop_clients.set()
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + SAMPLE_TIMEOUT_S * 4)
        if not ok:
            end = EndState(False, f"not one healthy cluster of every running host {CONVERGE_BOUND_S:g} s after healing: {why}")
            return self.judge(end), end
        self.converge_s = converged_at - healed
        for h in hosts:
            self.sample(h, full=True)
        leader = next(h for h, v in views.items() if v["leader"] == v["me"]["node_id"])
        last = [x for x in self.history.samples if x.host == leader]
        commit = last[-1].commit if last else 0
        end = EndState(True, cluster=views[hosts[0]]["cluster_id"], commit=commit, initial_cluster=self.initial_cluster)
        return self.judge(end), end

    def judge(self, end: EndState) -> Verdict:
        verdict = judge(self.history, end)
        exits = tuple(Violation("agent-exit", e) for e in self.exits)
        return Verdict(exits + verdict.violations)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/chaos.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    ap.add_argument("--schedule", type=Path, default=None, help="play this saved schedule instead of drawing one")
    ap.add_argument("--save-schedule", type=Path, default=None, help="write the schedule (JSON) here")
    ap.add_argument("--history", type=Path, default=None, help="write the recorded history (JSON) here")
    ap.add_argument("--keep", action="store_true", help="keep the state directories and logs")
    args = ap.parse_args(argv)
    why = netns.usable()
    if why is not None:
        print(f"scripts/chaos.py: {why}", file=sys.stderr)
        return 2
    try:
        if args.schedule is not None:
            schedule = ChaosSchedule.from_json(args.schedule.read_text(encoding="utf-8"))
        else:
            seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
            schedule = draw(seed, hosts=args.hosts, minutes=args.minutes, spares=args.spares)
    except (ScheduleError, OSError) as exc:
        print(f"scripts/chaos.py: {exc}", file=sys.stderr)
        return 2
    if args.save_schedule is not None:
        args.save_schedule.write_text(schedule.to_json(), encoding="utf-8")
    print(f"chaos {schedule.summary()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="p2pmesh-chaos-"))
    chaos = Chaos(schedule, root)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    verdict: Verdict | None = None
    try:
        verdict, end = chaos.run()
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr)
        return 130
    except (ChaosAbort, netns.NetnsError) as exc:
        print(f"scripts/chaos.py: the bench failed: {exc}", file=sys.stderr)
        return 2
    finally:
        chaos.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.history is not None:
            args.history.write_text(chaos.history.to_json(), encoding="utf-8")
        keep = args.keep or (verdict is not None and not verdict.ok)
        if keep:
            print(f"state directories and agent logs: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    counts = chaos.history.counts()
    print(f"seed {schedule.seed}: history {json.dumps(counts)}")
    if chaos.errors:
        print(f"read errors: {json.dumps(dict(sorted(chaos.errors.items(), key=lambda kv: -kv[1])))}")
    if chaos.skipped:
        print(f"skipped steps: {chaos.skipped}")
    for v in verdict.violations:
        print(f"seed {schedule.seed}: violated {v.invariant}: {v.detail}")
    summary = {
        "seed": schedule.seed,
        "verdict": list(verdict.names),
        "steps": schedule.counts(),
        "history": counts,
        "formation_s": None if chaos.formation_s is None else round(chaos.formation_s, 2),
        "converge_s": None if chaos.converge_s is None else round(chaos.converge_s, 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return 1 if verdict.names else 0


if __name__ == "__main__":
    sys.exit(main())
