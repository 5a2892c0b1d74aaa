"""A rank that cannot form its ring names the rank at fault and its address and port
(worker/ring_check.py ring_fault): MLX's messages say only "Couldn't connect (error: 111)"
or "Couldn't bind socket (error: 98)", and each rank dials its right-hand neighbour and
listens on its own hostfile entry. The messages are MLX's own (seen with mlx 0.32)."""
from __future__ import annotations

import pytest

from p2pmesh.worker.ring_check import RING_FAULTS, ring_fault

HOSTS = [["127.0.0.2:47100"], ["127.0.0.3:47151"], ["127.0.0.4:47002"]]


@pytest.mark.parametrize(("rank", "peer"), [(0, 1), (1, 2), (2, 0)])
def test_a_failed_connect_names_the_right_hand_neighbour(rank: int, peer: int) -> None:
    fault = ring_fault("[ring] Couldn't connect (error: 111)", rank, HOSTS)
    address, port = HOSTS[peer][0].split(":")
    assert fault == {"code": "ring_peer_unreachable", "rank": peer, "address": address, "port": int(port)}


@pytest.mark.parametrize(("message", "code"), [
    ("[ring] Couldn't bind socket (error: 98)", "ring_port_in_use"),  # Linux EADDRINUSE
    ("[ring] Couldn't bind socket (error: 48)", "ring_port_in_use"),  # macOS
    ("[ring] Couldn't bind socket (error: 99)", "ring_address_unavailable"),
    ("[ring] Couldn't bind socket (error: 13)", "ring_bind_failed"),
    ("[ring] Couldn't bind socket", "ring_bind_failed"),
])
def test_a_failed_bind_names_the_rank_itself(message: str, code: str) -> None:
    assert ring_fault(message, 1, HOSTS) == {"code": code, "rank": 1, "address": "127.0.0.3", "port": 47151}
    assert code in RING_FAULTS


def test_other_failures_are_not_ring_faults() -> None:
    assert ring_fault("[ring] connection to a peer was lost", 0, HOSTS) is None
    assert ring_fault("out of memory", 0, HOSTS) is None


def test_a_real_worker_whose_left_peer_never_listens_names_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The issue's case with real MLX: rank 1 dials rank 0 at an address and port nobody
    listens on (a Mac whose data port differs). MLX gives up after about 30 s; the worker's
    error event then names rank 0 and where it dialled, and the worker exits 1."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.agent.harness import ROOT, free_port, make_model

    model = make_model(tmp_path / "tiny", family="llama", layers=2, hidden=64)
    nobody, mine = free_port("127.0.0.2"), free_port("127.0.0.3")
    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.2:{nobody}"], [f"127.0.0.3:{mine}"]]))
    env = {**os.environ, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    cmd = [sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(model), "--stages", "[[0, 1], [1, 2]]",
           "--rank", "1", "--timeout-s", "90"]
    start = time.monotonic()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e["event"] == "error"]
    assert r.returncode == 1 and errors, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert errors[-1]["fault"] == {"code": "ring_peer_unreachable", "rank": 0, "address": "127.0.0.2", "port": nobody}
    assert "Couldn't connect" in errors[-1]["message"]
    assert time.monotonic() - start < 90  # MLX's own connect deadline, not our watchdog
