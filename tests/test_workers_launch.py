"""How an epoch's worker joins its group (p2pmesh/agent/tasks/workers.py group_launch): MLX's ring
backend with a hostfile over TCP, or JACCL when every hop is RDMA-capable. JACCL itself
cannot run here (no Thunderbolt 5 RDMA on Linux); what it is given is checked. And what
ends a worker: its agent's end (its stdout gone), never the end of the thread that started it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pmesh.core.dataplane import WantedWorker
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Capabilities, Member, RingHop, Stage
from p2pmesh.core.mlx_hostfile import MlxConfigError, epoch_base_port
from p2pmesh.agent.tasks.workers import group_launch

A, B, C = NodeId("a" * 32), NodeId("b" * 32), NodeId("c" * 32)
STAGES = (Stage(A, 0, 3), Stage(B, 3, 6), Stage(C, 6, 8))
MEMBERS = tuple(Member(n, 1, True, True, (f"10.0.0.{i}:7741",), Capabilities(0, "")) for i, n in enumerate((A, B, C), 1))


def _hops(rdma: bool, addresses: bool = True) -> tuple[RingHop, ...]:
    ends = [(A, B, "en2", "en3", 1), (B, C, "en4", "en5", 2), (C, A, "en6", "en7", 3)]
    return tuple(
        RingHop(s, d, "thunderbolt", 80.0, None, si, di, f"169.254.{k}.1" if addresses else None,
                f"169.254.{k}.2" if addresses else None, rdma)
        for s, d, si, di, k in ends
    )


def test_tcp_ring_gets_a_hostfile_with_each_rank_on_its_left_cable() -> None:
    launch = group_launch(WantedWorker(5, "m", STAGES, 1), _hops(False), 47000, MEMBERS)
    assert launch.backend == "ring" and launch.env == {"MLX_RANK": "1"}
    hostfile = json.loads(launch.files["hostfile"])
    assert hostfile == [["169.254.3.2:47080"], ["169.254.1.2:47081"], ["169.254.2.2:47082"]]
    assert launch.file_env == {"hostfile": "MLX_HOSTFILE"}


def test_rdma_on_every_hop_gets_jaccl_devices_and_a_coordinator() -> None:
    launch = group_launch(WantedWorker(5, "m", STAGES, 2), _hops(True), 47000, MEMBERS)
    assert launch.backend == "jaccl" and launch.env["MLX_RANK"] == "2" and launch.env["MLX_JACCL_RING"] == "1"
    assert launch.env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:47080"  # rank 0's address every rank reaches
    devices = json.loads(launch.files["devices"])
    assert len(devices) == 3 and devices[0][0] is None and devices[0][1] == "rdma_en2"
    assert launch.file_env == {"devices": "MLX_IBV_DEVICES"}


def test_a_hop_without_addresses_cannot_start_a_tcp_group() -> None:
    with pytest.raises(MlxConfigError):
        group_launch(WantedWorker(5, "m", STAGES, 0), _hops(False, addresses=False), 47000, MEMBERS)


def test_epochs_get_disjoint_port_ranges() -> None:
    assert epoch_base_port(47000, 1) != epoch_base_port(47000, 2)
    assert epoch_base_port(47000, 2) - epoch_base_port(47000, 1) >= 16


def test_each_rank_listens_on_its_own_members_data_port() -> None:
    """Macs started with different --data-port values: rank i's port is its own member's
    committed port (+ the epoch's offset + i), whatever port the rendering agent has; a
    member that advertised none (an older agent) gets the renderer's own."""
    members = tuple(
        Member(n, 1, True, True, (f"10.0.0.{i}:7741",), Capabilities(0, "", port))
        for i, (n, port) in enumerate(((A, 47100), (B, 47150), (C, 0)), 1)
    )
    for rank, mine in enumerate((47000, 47100, 47150)):  # whoever renders it, A and B ports are theirs
        launch = group_launch(WantedWorker(5, "m", STAGES, rank), _hops(False), mine, members)
        hostfile = json.loads(launch.files["hostfile"])
        assert hostfile == [["169.254.3.2:47180"], ["169.254.1.2:47231"], [f"169.254.2.2:{mine + 80 + 2}"]]
    rdma = group_launch(WantedWorker(5, "m", STAGES, 2), _hops(True), 47000, members)
    assert rdma.env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:47180"  # rank 0 listens on its own port


def test_a_request_event_ends_or_resumes_by_the_workers_code() -> None:
    """Only the request's own fault (request_invalid) and a full batch (busy) end a request;
    any other worker error under it, known or not, resumes it on the next epoch."""
    from p2pmesh.agent.tasks.workers import request_outcome
    from p2pmesh.core.protocol import ErrorCode

    assert request_outcome("token", None) == (False, "")
    assert request_outcome("done", None) == (False, "")
    assert request_outcome("error", "request_invalid") == (False, ErrorCode.PROMPT_REFUSED)
    assert request_outcome("error", "busy") == (False, ErrorCode.BUSY)
    assert request_outcome("error", "pipeline_broken")[0] is True
    assert request_outcome("error", "a code from a newer worker")[0] is True


def test_a_worker_outlives_the_thread_that_started_it() -> None:
    """trio starts processes from its worker-thread cache, whose threads end after 10 s
    idle. A worker started with PR_SET_PDEATHSIG was SIGKILLed by the kernel then (Linux
    sends it when the forking *thread* ends): a healthy new epoch broke under 8 resumed
    requests seconds after it started (tests/agent/test_batch_faults.py)."""
    import subprocess
    import sys
    import threading
    import time

    from p2pmesh.agent.tasks.workers import spawn_options

    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], **spawn_options()))

    starter = threading.Thread(target=start)
    starter.start()
    starter.join(timeout=30)
    try:
        time.sleep(0.5)  # the starting thread is gone: a death signal would have landed
        assert procs[0].poll() is None, f"the worker died with its starting thread: {procs[0].returncode}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def test_a_worker_exits_when_its_agent_is_gone(tmp_path: Path) -> None:
    """What ends a worker instead: its agent holds the only read end of its stdout; once
    that is closed (the agent died), the worker's next heartbeat fails and it exits, even
    with its stdin still open and nothing else to wake it."""
    import os
    import subprocess
    import sys
    import time

    from tests.fixtures.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama", 2, 64)
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    proc = subprocess.Popen([sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(model), "--stages", "[[0, 2]]",
                             "--rank", "0", "--timeout-s", "60"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # heartbeats every 0.5 s: readline never waits long
            line = proc.stdout.readline()
            assert line, "the worker ended before it was ready"
            if json.loads(line)["event"] == "ready":
                break
        else:
            raise AssertionError("the worker was not ready within 60 s")
        proc.stdout.close()
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdin.close()
