"""Pairing over a cable (`p2pmesh pair`, p2pmesh/agent/tasks/pairing.py) with real agents in two network
namespaces joined by a Thunderbolt-marked veth: each Mac starts with its own cluster key;
a refused code changes nothing; confirmed codes give the new Mac the key, and it restarts
into the other Mac's cluster."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.agent.harness import ROOT, AgentProc, one_cluster, wait_for
from tests.agent.netns import Bench, require_root

FORM_TIMEOUT_S = 40
PAIR_TIMEOUT_S = 60
"""Each pair command's window: zeroconf must first show each Mac the other."""


def _pair(state_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "p2pmesh", "pair", "--json", "--state-dir", str(state_dir), "--timeout", str(PAIR_TIMEOUT_S), *extra],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
    )


def _until_code(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """Read the command's events until the code question (bounded in time: the line
    reader runs in a thread, so a command that says nothing cannot hang the test)."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout

    def read() -> None:
        while True:
            line = stdout.readline()
            lines.put(line)
            if not line or '"code"' in line:
                return

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if not line:
            raise AssertionError(f"pair ended before a code: {proc.stderr.read() if proc.stderr else ''}")
        event = json.loads(line)
        if event.get("event") == "code":
            return event
    raise AssertionError("no pairing code within the time bound")


def _say(proc: subprocess.Popen[str], yes: bool) -> None:
    assert proc.stdin is not None
    proc.stdin.write("y\n" if yes else "n\n")
    proc.stdin.flush()


def _finish(proc: subprocess.Popen[str]) -> tuple[int, list[dict[str, Any]]]:
    out, err = proc.communicate(timeout=PAIR_TIMEOUT_S + 90)
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert events, err
    return proc.returncode, events


def _port_open(bench: Bench, host: int, address: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return subprocess.run([*bench.exec_prefix(host), sys.executable, "-c", probe], capture_output=True, timeout=20).returncode == 0


def _key(state_dir: Path) -> str:
    return (state_dir / "cluster.key").read_text().strip()


def test_a_new_mac_pairs_over_a_cable_after_both_users_confirm_the_code(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(2)
    agents: list[AgentProc] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        bench.plug(0, 1, thunderbolt=True)
        for i in range(2):
            state = tmp_path / f"p{i}"
            state.mkdir()
            agents.append(AgentProc(state, "", extra=[], prefix=bench.exec_prefix(i), listens=[":7741"]))
        for a in agents:
            a.start()
        host_status = wait_for(lambda: one_cluster(agents[:1], 1), FORM_TIMEOUT_S, "the first Mac alone in its cluster")
        wait_for(lambda: one_cluster(agents[1:], 1), FORM_TIMEOUT_S, "the new Mac alone in its own cluster")
        host_key, guest_key = _key(agents[0].state_dir), _key(agents[1].state_dir)
        assert host_key != guest_key  # two clusters: they cannot talk to each other

        # First the new Mac's user says the codes differ: nothing changes anywhere.
        procs = [_pair(agents[0].state_dir), _pair(agents[1].state_dir, "--join")]
        codes = [_until_code(p, PAIR_TIMEOUT_S) for p in procs]
        assert codes[0]["code"] == codes[1]["code"] and len(codes[0]["code"]) == 7
        assert codes[0]["peer"] == agents[1].status()["node_id"]  # type: ignore[index]
        _say(procs[1], False)
        guest_rc, guest_events = _finish(procs[1])
        _say(procs[0], True)
        host_rc, host_events = _finish(procs[0])
        host_final = host_events[-1]
        assert guest_rc == 1 and guest_events[-1]["paired"] is False
        assert host_rc == 1 and host_final["paired"] is False and "differ" in host_final["error"]
        assert _key(agents[1].state_dir) == guest_key
        assert one_cluster(agents[1:], 1)["cluster_id"] != host_status["cluster_id"]  # type: ignore[index]

        # Then both confirm: the new Mac gets the key and joins the first Mac's cluster.
        procs = [_pair(agents[0].state_dir), _pair(agents[1].state_dir, "--join")]
        codes = [_until_code(p, PAIR_TIMEOUT_S) for p in procs]
        assert codes[0]["code"] == codes[1]["code"]
        _say(procs[0], True)  # the host's user first: its agent then waits for the new Mac's
        _say(procs[1], True)
        guest_rc, guest_events = _finish(procs[1])
        host_rc, host_events = _finish(procs[0])
        assert guest_rc == 0, guest_events
        assert guest_events[-2]["paired"] is True and guest_events[-1] == {**guest_events[-1], "event": "joined", "members": 2}
        assert host_rc == 0 and host_events[-1]["paired"] is True and host_events[-1]["role"] == "host"
        assert _key(agents[1].state_dir) == host_key
        status = wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of both Macs")
        assert status["cluster_id"] == host_status["cluster_id"]  # the new Mac joined; the cluster kept its id
        assert agents[1].proc is not None and agents[1].proc.poll() is None  # restarted in-process, still running
        # The host's pairing port is open only while its command runs.
        waiting = _pair(agents[0].state_dir)
        procs.append(waiting)
        assert waiting.stdout is not None and json.loads(waiting.stdout.readline())["event"] == "waiting"
        assert _port_open(bench, 1, "10.77.0.1", 7744)
        waiting.kill()
        waiting.wait(timeout=10)
        wait_for(lambda: not _port_open(bench, 1, "10.77.0.1", 7744), 10, "the pairing port to close")
        # A Mac in a cluster of several is not offered as a new Mac.
        again = subprocess.run([sys.executable, "-m", "p2pmesh", "pair", "--join", "--state-dir", str(agents[1].state_dir)],
                               cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert again.returncode == 1 and "cluster of 2 Macs" in again.stderr, again.stderr
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for a in agents:
            a.stop()
        bench.close()
