#!/usr/bin/env python3
"""The main job, end to end on one computer: three real agents on loopback form one
cluster, load the model the project trained and ships (scripts/demo_model/), generate
through the embedded client API, then lose a Mac in the middle of a generation and get it
back, with the cluster's events shown live and the text checked against the first run.

    scripts/demo [--model DIR] [--prompt TEXT] [--max-tokens N] [--keep]

Only the first agent has the model on its disk (each agent has a --model-root of its own);
the others copy the files they need from it over the cluster's links, as Macs do over
Thunderbolt. Each agent offers memory for about half the model (`--memory-limit`), so the
layers must be spread over two of the three: when a Mac holding layers is killed, the third takes them
over (a rebalance), and the request in flight resumes on the new placement. Greedy decoding
makes every run's text identical, which is what the demo checks. Everything runs in a fresh
temporary directory, deleted at the end (--keep leaves it, with the agents' logs).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import p2pmesh  # noqa: E402
from p2pmesh.cli import local_cmd, model_cmd, terminal  # noqa: E402
from p2pmesh.drivers.keys import write_key  # noqa: E402
from p2pmesh.agent.models import copy_dir  # noqa: E402
from p2pmesh.client import _diff  # noqa: E402 - watch's own diff, to resume a watch without losing a change

DEFAULT_MODEL = ROOT / "scripts" / "demo_model"
MODEL_NAME = "p2pmesh-demo-model"
"""What the model is called in agent 0's --model-root (a name no agent finds anywhere else)."""
DEFAULT_PROMPT = "The Macs form a ring"
"""A paragraph start of the corpus the model learnt (scripts/demo_model/README.md): readable text."""
AGENTS = 3
CONTEXT_TOKENS = 512
FORM_TIMEOUT_S = 60.0
SERVE_TIMEOUT_S = 180.0
KILL_AFTER_PIECES = 4
WATCH_RESTARTS_MAX = 20
"""Times the event watch starts again after a failed poll (bounded, as every loop)."""
"""The Mac is killed once this many text pieces of the second generation have arrived."""


@dataclass
class Cluster:
    root: Path
    nodes: list[local_cmd.Node]
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, i: int) -> None:
        self.procs[i] = local_cmd.start(self.nodes[i], self.root)

    def socket(self, i: int) -> Path:
        return self.nodes[i].state_dir / "agent.sock"

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def memory_limit(model: Path) -> int:
    """Room for half the layers: two agents hold the model, one cannot."""
    from p2pmesh.agent.models import describe, memory_for_share

    return memory_for_share(describe(str(model), model, CONTEXT_TOKENS), 2)


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out after {timeout_s:.0f} s waiting for {what}")


def formed(cluster: Cluster, count: int) -> bool:
    """The running agents form one cluster of `count` members, each hearing a leader."""
    statuses = []
    for i, proc in cluster.procs.items():
        try:
            statuses.append(_status_json(cluster, i) if proc.poll() is None else None)
        except p2pmesh.P2PMeshError:
            statuses.append(None)
    return local_cmd.formed(statuses, count) and all(s is not None and s["healthy"] for s in statuses)


def watch_events(socket: Path, con, stop: threading.Event, seen: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Print the cluster's events as they happen, from the demo's own client. A poll that
    fails on a loaded machine (the agent slow to answer) does not end the watch: it starts
    again, first reporting what changed since the last status it saw. ``seen`` collects the
    events' kinds for the summary."""
    last: p2pmesh.Status | None = None

    def show(event: p2pmesh.Event) -> None:
        seen.append(event.kind.value)
        style = "red" if event.kind == p2pmesh.EventKind.MEMBER_DOWN else "cyan"
        con.print(f"    [event] {event.detail}", style=style)

    for _ in range(WATCH_RESTARTS_MAX):
        try:
            with p2pmesh.connect(socket) as c:
                if last is not None:
                    for event in _diff(last, c.status()):
                        show(event)
                for event in c.watch(interval=0.2):
                    if stop.is_set():
                        return
                    last = event.status
                    show(event)
        except p2pmesh.AgentNotRunning:
            return  # the watched agent went away: the demo says what happened itself
        except p2pmesh.P2PMeshError:
            if stop.is_set():
                return
            time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (agents' logs)")
    a = ap.parse_args()
    con = terminal.console()
    model = a.model.resolve()
    if not (model / "config.json").is_file():
        print(f"demo: {model} is not a model directory (config.json missing)", file=sys.stderr)
        return 2

    root = Path(tempfile.mkdtemp(prefix="p2pmesh-demo-"))
    key = root / "cluster.key"
    write_key(key, os.urandom(32))
    limit = memory_limit(model)
    # --no-http: the demo talks to the agents through the client API only (docs/http.md shows the HTTP API).
    nodes = local_cmd.loopback_nodes(AGENTS, root, key, 7780, ["--memory-limit", str(limit), "--no-http"])
    # Only agent 0's model root holds the model; the others must copy it from the cluster.
    for i in range(AGENTS):
        (root / f"mac{i}").mkdir()
    (root / "mac0" / MODEL_NAME).symlink_to(model)
    nodes = [replace(n, argv=(*n.argv, "--model-root", str(root / f"mac{n.index}"))) for n in nodes]
    cluster = Cluster(root, nodes)
    stop_watch = threading.Event()
    seen: list[str] = []
    try:
        con.rule("1. Three agents on this computer")
        con.print(f"Each agent is a Mac of its own (loopback addresses 127.0.0.2-4), offering {limit / 1e6:.1f} MB for layers.")
        for i in range(AGENTS):
            cluster.start(i)
        wait_until(lambda: formed(cluster, AGENTS), FORM_TIMEOUT_S, "three agents to form one cluster")
        client = p2pmesh.connect(cluster.socket(0))
        con.print(terminal.status_view(_status_json(cluster, 0)))

        con.rule("2. Load the model the project trained (scripts/demo_model), on agent 0's disk only")
        with model_cmd.ProgressReport(con, "loading") as bar:
            loaded = client.load(MODEL_NAME, context_tokens=CONTEXT_TOKENS, timeout=SERVE_TIMEOUT_S,
                                 on_progress=lambda p: bar.update(p.detail, p.ready, p.stages))
        con.print(terminal.placement_text(_status_json(cluster, 0)["placement"]))
        for i in range(1, AGENTS):
            copied = [f for f in copy_dir(cluster.nodes[i].state_dir, MODEL_NAME).glob("*") if f.is_file()]
            con.print(f"agent {i} copied {len(copied)} files ({sum(f.stat().st_size for f in copied) / 1e6:.1f} MB) "
                      "of the model from the others")

        con.rule("3. Generate through the client API")
        con.print(f"prompt: {a.prompt!r}", style="bold")
        t0 = time.monotonic()
        first = _generate(con, client, a.prompt, a.max_tokens)
        con.print(f"({len(first.tokens)} tokens in {time.monotonic() - t0:.1f} s)", style="dim")

        con.rule("4. A Mac holding layers dies in the middle of a generation")
        status = client.status()
        victim = next(i for i in range(1, AGENTS)
                      if any(s.node_id == _node_id(cluster, i) for s in status.placement.stages))  # type: ignore[union-attr]
        watcher = threading.Thread(target=watch_events, args=(cluster.socket(0), con, stop_watch, seen), daemon=True)
        watcher.start()
        time.sleep(0.5)
        con.print(f"generating again; agent {victim} ({_node_id(cluster, victim)[:8]}) will be killed (SIGKILL) "
                  f"after {KILL_AFTER_PIECES} pieces", style="bold")
        second = _generate(con, client, a.prompt, a.max_tokens, kill=lambda: cluster.procs[victim].kill())
        _verdict(con, first, second, "the generation that lost a Mac")

        con.rule("5. The Mac comes back")
        cluster.start(victim)
        wait_until(lambda: formed(cluster, AGENTS), FORM_TIMEOUT_S, "the restarted agent to rejoin")
        wait_until(lambda: bool(client.placement().serving), SERVE_TIMEOUT_S, "the cluster to serve")
        time.sleep(1.0)  # let the watcher print the rejoin
        stop_watch.set()
        con.print(terminal.status_view(_status_json(cluster, 0)))
        third = _generate(con, client, a.prompt, a.max_tokens)
        _verdict(con, first, third, "the generation after the rejoin")
        resumed = client.status().requests_resumed
        con.print("events seen while the Mac was away and back: " + ", ".join(
            f"{kind} x{seen.count(kind)}" for kind in dict.fromkeys(seen)))
        con.rule("done")
        con.print(f"{loaded.name}: served by {AGENTS} agents, one killed and restarted; {resumed} request(s) resumed "
                  "on a new placement; every generation identical.", style="green")
        return 0 if first.text == second.text == third.text else 1
    finally:
        stop_watch.set()
        cluster.stop_all()
        if a.keep:
            con.print(f"kept {root} (agents' logs: agentN.log)")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _generate(con, client: p2pmesh.Client, prompt: str, max_tokens: int, kill=None) -> p2pmesh.GenerationResult:  # type: ignore[no-untyped-def]
    gen = client.generate(prompt, max_tokens=max_tokens)
    con.print(prompt, end="", style="bold")
    for n, piece in enumerate(gen, 1):
        con.print(piece, end="", highlight=False)
        if kill is not None and n == KILL_AFTER_PIECES:
            kill()
            con.print(" [killed] ", end="", style="bold red")
    con.print()
    assert gen.result is not None
    return gen.result


def _verdict(con, reference: p2pmesh.GenerationResult, other: p2pmesh.GenerationResult, what: str) -> None:  # type: ignore[no-untyped-def]
    if other.tokens == reference.tokens:
        con.print(f"{what}: identical to the first ({len(other.tokens)} tokens)", style="green")
    else:
        con.print(f"{what}: DIFFERENT from the first", style="bold red")


def _status_json(cluster: Cluster, i: int) -> dict:  # type: ignore[type-arg]
    return p2pmesh.Client(cluster.socket(i)).status_object(timeout=10.0)


def _node_id(cluster: Cluster, i: int) -> str:
    return str(_status_json(cluster, i)["node_id"]) if cluster.procs[i].poll() is None else ""


if __name__ == "__main__":
    raise SystemExit(main())
