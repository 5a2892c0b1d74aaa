"""Real agent processes for tests: start, ask for status, signal, stop. Everything binds
to loopback addresses (127.0.0.0/8) that the test picks."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
WAIT_STEP_S = 0.1


def make_model(out: Path, **options: Any) -> Path:
    """A tiny random-weight model (tests/fixtures/tiny_model.py; its options)."""
    from tests.fixtures.tiny_model import make_tiny_model

    return make_tiny_model(out, **options)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class AgentProc:
    state_dir: Path
    listen: str
    peers: list[str] = field(default_factory=list)
    key_file: Path | None = None
    extra: list[str] = field(default_factory=lambda: ["--no-mdns"])
    proc: subprocess.Popen[bytes] | None = None
    prefix: list[str] = field(default_factory=list)
    """A command prefix such as ["ip", "netns", "exec", NAME] to run inside a namespace."""
    listens: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the agent process beside the test's own (HF_ENDPOINT...)."""

    def start(self) -> None:
        cmd = [*self.prefix, sys.executable, "-m", "p2pmesh", "agent", "--state-dir", str(self.state_dir), *self.extra]
        if "--http" not in self.extra:
            cmd.append("--no-http")  # several agents on one host would all want the default port
        for address in [self.listen, *self.listens] if self.listen else self.listens:
            cmd += ["--listen", address]
        for p in self.peers:
            cmd += ["--peer", p]
        if self.key_file is not None:
            cmd += ["--cluster-key-file", str(self.key_file)]
        log = open(self.state_dir.with_suffix(".log"), "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})

    def status(self) -> dict[str, Any] | None:
        r = subprocess.run(
            [sys.executable, "-m", "p2pmesh", "status", "--json", "--state-dir", str(self.state_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=20,
        )
        if r.returncode != 0:
            return None
        return json.loads(r.stdout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log_text(self) -> str:
        path = self.state_dir.with_suffix(".log")
        return path.read_text(errors="replace") if path.exists() else ""


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, step_s: float = WAIT_STEP_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def timed_wait(predicate: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.01) -> float:
    """Seconds until ``predicate`` holds (benchmarks poll finely; see wait_for)."""
    start = time.monotonic()
    wait_for(predicate, timeout_s, what, step_s)
    return time.monotonic() - start


def control_status(agent: AgentProc) -> dict[str, Any] | None:
    """The agent's status straight from its control socket (no CLI process: fast enough to
    poll every few milliseconds), None while it does not answer."""
    from p2pmesh.client import Client, P2PMeshError

    try:
        return Client(agent.state_dir / "agent.sock").status_object(timeout=2.0)
    except P2PMeshError:
        return None


@contextmanager
def formed_cluster(agents: list[AgentProc], timeout_s: float) -> Iterator[list[AgentProc]]:
    """Start the agents, wait until they form one cluster of them all as voters, and stop
    them all at the end."""
    for a in agents:
        a.start()
    try:
        wait_for(lambda: one_cluster(agents, len(agents)), timeout_s, f"one cluster of {len(agents)}")
        yield agents
    finally:
        for a in agents:
            a.stop()


def one_cluster(agents: list[AgentProc], voters: int) -> dict[str, Any] | None:
    """All agents report the same cluster, the same leader, and `voters` up voters."""
    statuses = [a.status() for a in agents]
    if any(s is None for s in statuses):
        return None
    clusters = {s["cluster_id"] for s in statuses}  # type: ignore[index]
    leaders = {s["leader"] for s in statuses}  # type: ignore[index]
    if len(clusters) != 1 or None in clusters or len(leaders) != 1 or None in leaders:
        return None
    first = statuses[0]
    assert first is not None
    members = first["members"]
    if sum(1 for m in members if m["voter"] and m["up"]) != voters or len(members) != voters:
        return None
    return first


def loopback_agents(root: Path, n: int, key_seed: int, extra: Callable[[int, str], list[str]] = lambda i, host: []
                    ) -> list[AgentProc]:
    """``n`` agents (not started) on 127.0.0.2, .3, ... sharing one peer port, one cluster
    key (bytes from ``key_seed``) and one data port base, each told every other as a static
    peer, without mDNS; ``extra(i, host)`` gives agent i's other flags."""
    import random

    from p2pmesh.drivers.keys import write_key

    key = root / "key"
    write_key(key, bytes(range(key_seed, key_seed + 32)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(n)]
    data = random.Random().randrange(20000, 40000)
    agents = []
    for i, listen in enumerate(listens):
        flags = ["--no-mdns", "--data-port", str(data), *extra(i, listen.rsplit(":", 1)[0])]
        a = AgentProc(root / f"m{i}", listen, peers=[x for x in listens if x != listen], key_file=key, extra=flags)
        a.state_dir.mkdir()
        agents.append(a)
    return agents
