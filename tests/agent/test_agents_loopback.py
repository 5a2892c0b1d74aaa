"""Real agent processes on loopback: formation, leader SIGKILL, restart from disk, a
wrong cluster key, a corrupt state file, status and key commands."""
from __future__ import annotations

import signal
import time
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.harness import ROOT, AgentProc, free_port, one_cluster, wait_for

FORM_TIMEOUT_S = 30


def _cluster(tmp_path: Path, n: int, key_file: Path) -> list[AgentProc]:
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(n)]
    agents = []
    for i in range(n):
        a = AgentProc(tmp_path / f"a{i}", listens[i], peers=[l for l in listens if l != listens[i]], key_file=key_file)
        a.state_dir.mkdir()
        agents.append(a)
    return agents


def _key_file(tmp_path: Path, name: str = "key") -> Path:
    from p2pmesh.drivers.keys import write_key

    path = tmp_path / f"{name}.txt"
    write_key(path, bytes(range(32)) if name == "key" else bytes(32))
    return path


@pytest.fixture
def three(tmp_path: Path):  # type: ignore[no-untyped-def]
    agents = _cluster(tmp_path, 3, _key_file(tmp_path))
    for a in agents:
        a.start()
    yield agents
    for a in agents:
        a.stop()


def test_three_agents_form_one_cluster_and_survive_a_leader_kill(three: list[AgentProc]) -> None:
    status = wait_for(lambda: one_cluster(three, 3), FORM_TIMEOUT_S, "one cluster of 3")
    for key in ("node_id", "pid", "cluster_id", "role", "term", "leader", "commit_index", "members"):
        assert key in status
    assert {"node_id", "voter", "up", "addresses"} <= set(status["members"][0])
    leader_id = status["leader"]
    victim = next(a for a in three if (a.status() or {}).get("node_id") == leader_id)
    commit_before = status["commit_index"]
    victim.kill()
    rest = [a for a in three if a is not victim]

    def new_leader() -> bool:
        ss = [a.status() for a in rest]
        return all(s and s["leader"] and s["leader"] != leader_id and s["commit_index"] > commit_before for s in ss)

    wait_for(new_leader, FORM_TIMEOUT_S, "a new leader that commits")
    victim.start()
    back = wait_for(lambda: one_cluster(three, 3), FORM_TIMEOUT_S, "the killed agent back in the cluster")
    assert any(m["node_id"] == leader_id for m in back["members"])
    restarted = victim.status()
    assert restarted is not None and restarted["node_id"] == leader_id  # same identity from its own disk


def test_an_agent_with_another_key_is_refused(tmp_path: Path) -> None:
    agents = _cluster(tmp_path, 3, _key_file(tmp_path))
    agents[2].key_file = _key_file(tmp_path, "other")
    try:
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents[:2], 2), FORM_TIMEOUT_S, "the two agents with the key")
        outsider = wait_for(agents[2].status, FORM_TIMEOUT_S, "the outsider's status")
        members = {m["node_id"] for m in (agents[0].status() or {})["members"]}
        assert outsider["node_id"] not in members
        assert outsider["cluster_id"] != (agents[0].status() or {})["cluster_id"]
        assert all(m["node_id"] == outsider["node_id"] for m in outsider["members"])  # learned nobody
    finally:
        for a in agents:
            a.stop()


def test_sigterm_stops_cleanly_and_status_says_not_running(tmp_path: Path) -> None:
    a = AgentProc(tmp_path / "solo", f"127.0.0.2:{free_port()}", key_file=_key_file(tmp_path))
    a.state_dir.mkdir()
    a.start()
    try:
        s = wait_for(lambda: (a.status() or {}).get("role") == "standalone" and a.status(), FORM_TIMEOUT_S, "a standalone agent")
        assert s["members"][0]["voter"]
        a.signal(signal.SIGTERM)
        assert a.proc is not None and a.proc.wait(timeout=15) == 0
        r = subprocess.run([sys.executable, "-m", "p2pmesh", "status", "--json", "--state-dir", str(a.state_dir)], cwd=ROOT, capture_output=True, text=True, timeout=20)
        assert r.returncode == 1 and "p2pmesh agent" in r.stderr
    finally:
        a.stop()


def test_key_show_and_set_round_trip(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "p2pmesh", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)

    from p2pmesh.drivers.keys import format_key

    key_text = format_key(bytes(range(32)))
    assert run("key", "show", "--state-dir", str(tmp_path)).returncode == 1
    assert run("key", "set", key_text, "--state-dir", str(tmp_path)).returncode == 0
    shown = run("key", "show", "--state-dir", str(tmp_path))
    assert shown.returncode == 0 and shown.stdout.strip() == key_text
    typo = key_text[:-1] + ("A" if key_text[-1] != "A" else "B")
    bad = run("key", "set", typo, "--state-dir", str(tmp_path))
    assert bad.returncode == 2 and "typo" in bad.stderr


def test_graceful_leave_shrinks_the_cluster_and_exits(three: list[AgentProc]) -> None:
    wait_for(lambda: one_cluster(three, 3), FORM_TIMEOUT_S, "one cluster of 3")
    leaver = three[0]
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "leave", "--state-dir", str(leaver.state_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "left the cluster" in r.stdout, r.stdout + r.stderr
    assert leaver.proc is not None and leaver.proc.wait(timeout=20) == 0
    wait_for(lambda: one_cluster(three[1:], 2), FORM_TIMEOUT_S, "the remaining two as a cluster of 2")


def test_a_corrupt_state_file_stops_the_agent_with_a_clear_error(tmp_path: Path) -> None:
    a = AgentProc(tmp_path / "solo", f"127.0.0.2:{free_port()}", key_file=_key_file(tmp_path))
    a.state_dir.mkdir()
    a.start()
    wait_for(lambda: (a.status() or {}).get("role") == "standalone", FORM_TIMEOUT_S, "a standalone agent")
    assert a.stop() == 0
    wal = a.state_dir / "wal"
    data = bytearray(wal.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wal.write_bytes(bytes(data))
    r = subprocess.run(
        [sys.executable, "-m", "p2pmesh", "agent", "--state-dir", str(a.state_dir), "--listen", a.listen, "--no-mdns",
         "--cluster-key-file", str(a.key_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert "wal" in r.stderr and "move the state directory aside" in r.stderr, r.stderr


def test_five_agents_started_at_once_form_exactly_one_cluster(tmp_path: Path) -> None:
    agents = _cluster(tmp_path, 5, _key_file(tmp_path))
    try:
        for a in agents:
            a.start()
        status = wait_for(lambda: one_cluster(agents, 5), FORM_TIMEOUT_S * 2, "one cluster of 5")
        assert len({m["node_id"] for m in status["members"]}) == 5
    finally:
        for a in agents:
            a.stop()


def test_repeated_sigkill_and_restart_never_loses_committed_state(tmp_path: Path) -> None:
    """Kill a random agent with SIGKILL at a random moment, restart it from its disk, ten
    times: the cluster's commit index never goes backwards, every restarted agent keeps
    its identity and cluster, and the three end up as one cluster again each time."""
    import random

    rng = random.Random(8)
    agents = _cluster(tmp_path, 3, _key_file(tmp_path))
    try:
        for a in agents:
            a.start()
        status = wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
        cluster_id, high = status["cluster_id"], status["commit_index"]
        ids = {a.state_dir: (a.status() or {})["node_id"] for a in agents}
        for _ in range(10):
            victim = rng.choice(agents)
            time.sleep(rng.uniform(0.0, 0.5))
            victim.kill()
            victim.start()
            back = wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster again after a SIGKILL")
            assert back["cluster_id"] == cluster_id
            assert back["commit_index"] >= high
            high = back["commit_index"]
            restarted = victim.status()
            assert restarted is not None and restarted["node_id"] == ids[victim.state_dir]
    finally:
        for a in agents:
            a.stop()


def test_a_malformed_frame_closes_the_connection(tmp_path: Path) -> None:
    """A peer that holds the key but sends garbage is disconnected; the agent carries on."""
    import os
    import struct

    import trio

    from p2pmesh.core.identity import Identity
    from p2pmesh.drivers.keys import read_key
    from p2pmesh.drivers.tls import Credentials

    key_file = _key_file(tmp_path)
    a = AgentProc(tmp_path / "solo", f"127.0.0.2:{free_port()}", key_file=key_file)
    a.state_dir.mkdir()
    a.start()
    try:
        wait_for(lambda: (a.status() or {}).get("role") == "standalone", FORM_TIMEOUT_S, "a standalone agent")
        _, client_ctx = Credentials.issue(Identity.from_seed(os.urandom(32)), read_key(key_file)).contexts()
        host, port = a.listen.split(":")

        async def poke() -> bool:
            tls = trio.SSLStream(await trio.open_tcp_stream(host, int(port)), client_ctx, server_hostname="p2pmesh")
            await tls.do_handshake()
            await tls.send_all(struct.pack(">I", 5) + b"\xc1junk")
            with trio.fail_after(10):
                try:
                    while await tls.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass
            return True

        assert trio.run(poke)
        assert "sent a malformed frame" in a.log_text()
        assert (a.status() or {}).get("role") == "standalone"
    finally:
        a.stop()
