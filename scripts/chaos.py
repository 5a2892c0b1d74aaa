#!/usr/bin/env python3
"""Chaos with real processes: agents in network namespaces, a seeded schedule of faults,
client reads, and a verdict the simulator gives too (needs root; docs/reliability.md).

    sudo .venv/bin/python scripts/chaos.py --hosts 3 --minutes 0.75 --seed 1
    sudo .venv/bin/python scripts/chaos.py --schedule FILE [--history FILE] [--keep]
    sudo .venv/bin/python scripts/chaos.py --hosts 3 --minutes 1 --seed 3 --tiny-model
    sudo .venv/bin/python scripts/chaos.py --hosts 3 --minutes 1 --model DIR
    sudo .venv/bin/python scripts/chaos.py --hosts 3 --minutes 1 --seed 3 --tiny-model --split 2

The bench: hosts+spares namespaces on one Ethernet switch, cabled in a Thunderbolt-marked
ring (p2pmesh/cli/netns.py). The first ``--hosts`` agents start and must form one cluster; then
the schedule (sim/chaos_schedule.py) runs in real time: SIGKILL and restart, SIGSTOP and
SIGCONT, a ring or LAN cable unplugged and plugged back, a graceful leave and a rejoin with
a wiped state directory, a spare host joining. Meanwhile:

- clients read the membership at random hosts through the control op ``members`` (a
  linearizable ReadIndex read) and record invoke time, completion time and the answer or
  the error (sim/history.py ``ReadOp``); a confirmed leave is an acknowledged write;
- an observer asks every host for its committed entries (op ``log``: index, term, digest);
- with ``--model DIR`` (or ``--tiny-model``, which makes a 6-layer llama of hidden size 64
  with scripts/make_tiny_model.py), the model is loaded cluster-wide once the cluster
  formed, a reference greedy generation (GEN_PROMPT, GEN_MAX_TOKENS, temperature 0) is
  taken before any fault, and a generation client streams the same request every 1 to 2 s
  at a live host (not killed, not stopped, not departed). Each one completes with the
  reference's tokens, or fails with a clear error; other tokens are ``generation-wrong``,
  and an answer that never came within the client's bound (AgentTimeout) is
  ``generation-unclear``. The simulator does not model generations. ``--split N``
  gives every agent memory for 1/N of the model, so it is placed on N stages and faults
  cut the pipeline between Macs.

At the end every fault is healed (SIGCONT, cables up, dead agents restarted, departed ones
rejoined) and the cluster must converge within CONVERGE_BOUND_S. The history is judged by
sim/history.py and sim/linearizability.py, the same code that judges
``python -m sim chaos --schedule FILE`` on the same schedule. Prints the seed, the
schedule, the history counts (and the generation counts) and the verdict; exits 1 on any
violation, 2 on bad input or when the bench or the model load fails.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pmesh.cli import netns  # noqa: E402
from p2pmesh.client import AgentTimeout, Client, P2PMeshError  # noqa: E402
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
from sim.history import DETAILS_PER_INVARIANT_MAX, EndState, History, Verdict, judge  # noqa: E402
from sim.observations import Ack, LogSample, MemberView, ReadOp, Violation  # noqa: E402
from tests.agent.harness import AgentProc  # noqa: E402
from tests.agent.netns import Bench  # noqa: E402

CLIENT_TIMEOUT_S = 8.0
"""A read's client gives up after this (the agent's own bound is 5 s once it runs)."""
SAMPLE_TIMEOUT_S = 2.0
LEAVE_WAIT_S = 10.0
EXIT_WAIT_S = 10.0
POLL_S = 0.25
PAGES_MAX = 10_000
LEAVE_WITH_LAYERS_WAIT_S = 75.0
"""With a model, a leaver hands its layers off first: the agent's leave_timeout_ms (5 s) plus
drain_timeout_ms (60 s) bound that, and a little more for the answer."""

GEN_PROMPT = "The quick brown fox jumps over the lazy dog because"
GEN_MAX_TOKENS = 8
GEN_CONTEXT_TOKENS = 256
GEN_EVERY_S = (1.0, 2.0)
"""A generation starts this long (uniform) after the previous one ended."""
GEN_IDLE_TIMEOUT_S = 15.0
"""The generation client's bound between two events: three times the longest SIGSTOP of a
schedule (5 s), so a frozen contact host only delays its answer; past it the request hung."""
GEN_TOTAL_S = 30.0
"""The generation client's bound for the whole request, checked at each event, so a request
ends within GEN_TOTAL_S + GEN_IDLE_TIMEOUT_S (8 tokens of a tiny model take well under a
second when nothing is wrong)."""
MODEL_LOAD_S = 120.0
REFERENCE_TRIES = 5
TINY_MODEL_SEED = 3


@dataclass(frozen=True, slots=True)
class GenOp:
    """One streamed generation during chaos: the tokens it completed with, the clear error it
    failed with, or (``unclear``) what made it neither."""

    host: int
    invoke_s: float
    complete_s: float
    tokens: tuple[int, ...] | None = None
    error: str | None = None
    unclear: str | None = None


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
    def __init__(self, schedule: ChaosSchedule, root: Path, model: Path | None = None, split: int = 1) -> None:
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
        self.model = model
        self.split = split
        """With a model, each agent offers memory for 1/split of it (``--memory-limit``)."""
        self.reference: tuple[int, ...] | None = None
        """The greedy tokens of GEN_PROMPT, taken before any fault."""
        self.generations: list[GenOp] = []
        self.gen_errors: dict[str, int] = {}
        self.gen_rng = random.Random(schedule.seed ^ 0x6E4E)
        """Its own stream, so adding generations does not change which hosts reads go to."""
        self.departed: set[int] = set()
        """Hosts between a leave and their rejoin (their agent exited on purpose)."""

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
        if self.model is not None and self.split > 1:
            from p2pmesh.agent.models import describe, memory_for_share

            limit = memory_for_share(describe(str(self.model), self.model, GEN_CONTEXT_TOKENS), self.split)
            for agent in self.agents:
                agent.extra = [*agent.extra, "--memory-limit", str(limit)]

    def sock(self, host: int) -> Path:
        return self.agents[host].state_dir / "agent.sock"

    def control(self, host: int) -> Client:
        """The client of ``host``'s agent (its typed errors tell an answer from the client
        giving up: AgentTimeout)."""
        return Client(self.sock(host))

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
            return self.control(host).call(op, timeout=timeout_s, **fields)
        except (P2PMeshError, ValueError, OSError):
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
                answer = self.control(host).call("members", timeout=CLIENT_TIMEOUT_S)
                op = ReadOp(host, invoke, self.now_s(), view=_view(answer))
            except P2PMeshError as exc:
                op = ReadOp(host, invoke, self.now_s(), error=str(exc))
                kind = re.split(r" \(|;", re.sub(r" at /\S+", "", str(exc)))[0][:80]
                with self.lock:
                    self.errors[kind] = self.errors.get(kind, 0) + 1
            except Exception as exc:  # neither an answer nor a clear error: what the check is for
                op = ReadOp(host, invoke, self.now_s(), unclear=f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.history.reads.append(op)

    def live_hosts(self) -> list[int]:
        """Hosts a generation may go to: running, not SIGSTOPped, not departed, process up."""
        with self.lock:
            hosts = sorted(self.running - self.stopped - self.departed)
        return [h for h in hosts if self.alive(h)]

    def generate(self, host: int) -> GenOp:
        """One streamed generation at ``host``, classified: completed, a clear error, or
        unclear (the client's own bound passed without an answer, or another exception)."""
        invoke = self.now_s()
        tokens: list[int] = []
        deadline = time.monotonic() + GEN_TOTAL_S
        events = self.control(host).stream("generate", idle_timeout=GEN_IDLE_TIMEOUT_S, prompt=GEN_PROMPT,
                                           max_tokens=GEN_MAX_TOKENS, temperature=0.0)
        try:
            for event in events:
                got = event.get("tokens") or []
                if not isinstance(got, list):
                    return GenOp(host, invoke, self.now_s(), unclear=f"an event of an unknown shape: {str(event)[:200]}")
                tokens += [int(t) for t in got]
                if event.get("final"):
                    return GenOp(host, invoke, self.now_s(), tokens=tuple(tokens))
                if time.monotonic() > deadline:
                    return GenOp(host, invoke, self.now_s(),
                                 unclear=f"no final event within {GEN_TOTAL_S:g} s ({len(tokens)} tokens so far)")
            return GenOp(host, invoke, self.now_s(), unclear="the stream ended without a final event")
        except AgentTimeout as exc:
            # The client giving up on an agent that said nothing, not an error it reported.
            return GenOp(host, invoke, self.now_s(), unclear=f"no answer within {GEN_IDLE_TIMEOUT_S:g} s: {exc}")
        except P2PMeshError as exc:  # the agent's error (by its code), gone, or the stream broke
            return GenOp(host, invoke, self.now_s(), error=str(exc))
        except Exception as exc:  # neither tokens nor a clear error
            return GenOp(host, invoke, self.now_s(), unclear=f"{type(exc).__name__}: {exc}")
        finally:
            events.close()

    def generation_client(self) -> None:
        while not self.stop_clients.wait(self.gen_rng.uniform(*GEN_EVERY_S)):
            hosts = self.live_hosts()
            if not hosts:
                continue
            op = self.generate(self.gen_rng.choice(hosts))
            with self.lock:
                self.generations.append(op)
                if op.error is not None:
                    kind = re.split(r" \(|;|:", re.sub(r" at /\S+", "", op.error))[0][:80]
                    self.gen_errors[kind] = self.gen_errors.get(kind, 0) + 1

    def load_model(self) -> None:
        """Load the model cluster-wide and take the reference generation, before any fault."""
        import p2pmesh

        assert self.model is not None
        start = time.monotonic()
        try:
            loaded = p2pmesh.connect(self.agents[0].state_dir).load(self.model, context_tokens=GEN_CONTEXT_TOKENS,
                                                                   timeout=MODEL_LOAD_S)
        except Exception as exc:
            raise ChaosAbort(f"loading {self.model}: {type(exc).__name__}: {exc}") from None
        print(f"loaded {loaded.name} ({loaded.layers} layers) on {len(loaded.placement.stages)} stage(s) "
              f"in {time.monotonic() - start:.1f} s", flush=True)
        # The reference, from every starter: they must agree before faults make it matter.
        # A just-activated epoch may still refuse a request, so each host gets a few tries.
        refs: dict[int, tuple[int, ...]] = {}
        for host in range(self.schedule.hosts):
            op = self.generate(host)
            for _ in range(REFERENCE_TRIES - 1):
                if op.tokens is not None:
                    break
                time.sleep(1.0)
                op = self.generate(host)
            if op.tokens is None:
                raise ChaosAbort(f"the reference generation at h{host} failed: {op.error or op.unclear}")
            refs[host] = op.tokens
        if len(set(refs.values())) != 1:
            raise ChaosAbort(f"the hosts disagree on the reference generation before any fault: {refs}")
        self.reference = refs[0]
        print(f"reference generation: {len(self.reference)} tokens {list(self.reference)}", flush=True)

    def gen_counts(self) -> dict[str, int]:
        ref = self.reference
        return {
            "generations": len(self.generations),
            "completed": sum(1 for g in self.generations if g.tokens is not None and g.tokens == ref),
            "failed_clear": sum(1 for g in self.generations if g.error is not None),
            "wrong": sum(1 for g in self.generations if g.tokens is not None and g.tokens != ref),
            "unclear": sum(1 for g in self.generations if g.unclear is not None),
        }

    def check_generations(self) -> list[Violation]:
        out = []
        for g in self.generations:
            if g.tokens is not None and g.tokens != self.reference:
                out.append(Violation("generation-wrong", f"h{g.host} generation invoked at {g.invoke_s:.2f}s answered "
                                     f"{list(g.tokens)}, the reference is {list(self.reference or ())}"))
            elif g.unclear is not None:
                out.append(Violation("generation-unclear", f"h{g.host} generation invoked at {g.invoke_s:.2f}s: {g.unclear}"))
        return out

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
            with self.lock:
                self.departed.add(host)
            answer = self._leave(host)
            if answer is not None and answer.get("confirmed") and isinstance(answer.get("cluster_id"), str):
                # An acknowledged write: from now on no read may list this incarnation.
                removed = (str(answer["node_id"]), int(answer["inc"]))
                with self.lock:
                    self.history.acks.append(Ack(self.now_s(), answer["cluster_id"], 0, removed))
            self.wait_exit(host)
            self.sleep_until(heal_at)
            self.restart(host, wipe=True)
            with self.lock:
                self.departed.discard(host)

    def _leave(self, host: int) -> dict[str, Any] | None:
        # The agent answers once it stopped: within its leave_timeout_ms (5 s) when it holds
        # no model layers (always without --model); with a model it hands its layers off first.
        wait_s = LEAVE_WAIT_S if self.model is None else LEAVE_WITH_LAYERS_WAIT_S
        try:
            return self.control(host).call("leave", timeout=wait_s)
        except P2PMeshError as exc:
            print(f"           leave of h{host}: {exc}", flush=True)
            return None

    def heal_all(self) -> None:
        assert self.bench is not None
        for host in list(self.stopped):
            self._signal(host, signal.SIGCONT)
            self.stopped.discard(host)
        with self.lock:
            self.departed.clear()
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
        if self.model is not None:
            self.load_model()
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.client, args=(READ_EVERY_S * (c + 1) / CLIENTS,), daemon=True)
                   for c in range(CLIENTS)]
        if self.model is not None:
            threads.append(threading.Thread(target=self.generation_client, daemon=True))
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
            t.join(timeout=max(CLIENT_TIMEOUT_S + SAMPLE_TIMEOUT_S * 4, GEN_TOTAL_S + GEN_IDLE_TIMEOUT_S))
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
        # Generations are judged here, not in sim/history.py: only the real tool makes them.
        gens: list[Violation] = []
        per: dict[str, int] = {}
        for v in self.check_generations():
            per[v.invariant] = per.get(v.invariant, 0) + 1
            if per[v.invariant] <= DETAILS_PER_INVARIANT_MAX:
                gens.append(v)
        return Verdict(exits + verdict.violations + tuple(gens))


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
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, default=None,
                       help="load this model directory cluster-wide and stream generations during the chaos")
    model.add_argument("--tiny-model", action="store_true",
                       help="as --model, with a tiny llama made by scripts/make_tiny_model.py")
    ap.add_argument("--split", type=int, default=1, metavar="N",
                    help="with a model, give each agent memory for 1/N of it, so the model needs N stages "
                         "(a fault then cuts the pipeline between Macs, not only its one holder)")
    args = ap.parse_args(argv)
    if args.split < 1 or args.split > args.hosts:
        print(f"scripts/chaos.py: --split {args.split}: between 1 and --hosts ({args.hosts})", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.is_dir():
        print(f"scripts/chaos.py: --model {args.model}: not a directory", file=sys.stderr)
        return 2
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
    model_dir: Path | None = None if args.model is None else args.model.resolve()
    if args.tiny_model:
        from tests.fixtures.tiny_model import make_tiny_model

        model_dir = root / "tiny-llama"
        make_tiny_model(model_dir, family="llama", layers=6, hidden=64, seed=TINY_MODEL_SEED)
    chaos = Chaos(schedule, root, model_dir, args.split)

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
            text = chaos.history.to_json()
            if model_dir is not None:
                # An extra key: History.from_json reads the rest and ignores it.
                raw = json.loads(text)
                raw["generations"] = [asdict(g) for g in chaos.generations]
                raw["reference"] = None if chaos.reference is None else list(chaos.reference)
                text = json.dumps(raw) + "\n"
            args.history.write_text(text, encoding="utf-8")
        keep = args.keep or (verdict is not None and not verdict.ok)
        if keep:
            print(f"state directories and agent logs: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    counts = chaos.history.counts()
    print(f"seed {schedule.seed}: history {json.dumps(counts)}")
    if chaos.errors:
        print(f"read errors: {json.dumps(dict(sorted(chaos.errors.items(), key=lambda kv: -kv[1])))}")
    if model_dir is not None:
        print(f"seed {schedule.seed}: generations {json.dumps(chaos.gen_counts())}")
        if chaos.gen_errors:
            print(f"generation errors: {json.dumps(dict(sorted(chaos.gen_errors.items(), key=lambda kv: -kv[1])))}")
    if chaos.skipped:
        print(f"skipped steps: {chaos.skipped}")
    for v in verdict.violations:
        print(f"seed {schedule.seed}: violated {v.invariant}: {v.detail}")
    summary = {
        "seed": schedule.seed,
        "verdict": list(verdict.names),
        "steps": schedule.counts(),
        "history": counts,
        **({} if model_dir is None else {"generations": chaos.gen_counts()}),
        "formation_s": None if chaos.formation_s is None else round(chaos.formation_s, 2),
        "converge_s": None if chaos.converge_s is None else round(chaos.converge_s, 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return 1 if verdict.names else 0


if __name__ == "__main__":
    sys.exit(main())
