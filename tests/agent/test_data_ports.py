"""Macs whose data ports differ (issue 13, item 5), with real agents on loopback: agents
on 127.0.0.2 and 127.0.0.3 started with different --data-port values form one data plane
(each rank listens on its own Mac's port, from the committed member record) and generate
what one mlx-lm process generates; and a worker that cannot form its ring says why, in
`status` and `status --json`, naming the node, address and port, instead of restarting
silently.
"""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from p2pmesh.core.dataplane import RESTARTS_MAX
from p2pmesh.core.mlx_hostfile import EPOCH_PORT_SLOTS, EPOCH_PORT_STRIDE, epoch_base_port
from tests.agent.harness import ROOT, AgentProc, free_port, one_cluster, wait_for
from tests.agent.test_inference_loopback import (  # noqa: F401 - fixtures
    FORM_TIMEOUT_S,
    SERVE_TIMEOUT_S,
    _generate,
    _layer_bytes,
    _serving,
    _set_model,
    reference,
    tiny_model,
)

HELLO_S = 0.2
FAULT_TIMEOUT_S = 90
"""A held port fails a rank at once; the rest is the cluster forming and measuring."""


def _agents(tmp_path: Path, memory: int, data_ports: list[int]) -> list[AgentProc]:
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "key"
    write_key(key, bytes(range(7, 39)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(len(data_ports))]
    out = []
    for i, data in enumerate(data_ports):
        extra = ["--no-mdns", "--memory-limit", str(memory), "--data-port", str(data)]
        a = AgentProc(tmp_path / f"m{i}", listens[i], peers=[x for x in listens if x != listens[i]], key_file=key, extra=extra)
        a.state_dir.mkdir()
        out.append(a)
    return out


def _two_stage_memory(model: Path) -> int:
    per_layer, extras = _layer_bytes(model)
    return extras + per_layer * 4 + per_layer // 2  # 4 of the 6 layers at most: two stages


def _committed_data_ports(a: AgentProc) -> dict[str, int] | None:
    s = a.status()
    return {m["node_id"]: m["data_port"] for m in s["members"]} if s else None


@contextmanager
def _hold_data_ports(host: str, base: int) -> Iterator[list[int]]:
    """Listeners of our own on every port the ranks of `host`'s Mac could use, whatever the
    epoch (another program holding its data ports)."""
    ports = sorted({epoch_base_port(base, e) + r for e in range(EPOCH_PORT_SLOTS) for r in range(2)})
    with ExitStack() as stack:
        for p in ports:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, p))
            s.listen(1)
        yield ports


def _data_port_base() -> int:
    """A random data port for the first agent (the second's is 50 above) whose every epoch's
    ports lie below Linux's ephemeral range (32768 up): outgoing connections of other tests
    take ports from there, and one once held a port this test binds."""
    span = (EPOCH_PORT_SLOTS - 1) * EPOCH_PORT_STRIDE + 2 + 50
    return random.Random().randrange(20000, 32768 - span)


def test_macs_with_different_data_ports_serve_like_one_process(tmp_path: Path, tiny_model: Path, reference: list[int]) -> None:
    data = _data_port_base()
    agents = _agents(tmp_path, _two_stage_memory(tiny_model), [data, data + 50])  # the 47100 / 47150
    try:
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of 2")
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        # Each member's own data port is in the committed record every member reads.
        want = {ids[0]: data, ids[1]: data + 50}
        for a in agents:
            wait_for(lambda: _committed_data_ports(a) == want, FORM_TIMEOUT_S, "both data ports committed")  # noqa: B023
        _set_model(agents[0], tiny_model)
        p = wait_for(lambda: _serving(agents[0], 2), SERVE_TIMEOUT_S, "a serving 2-stage placement")
        assert p["restarts"] == 0 and "fault" not in p  # formed at the first try
        tokens, last = _generate(agents[1], 24)
        assert last["final"] and last["finish"] == "length"
        assert tokens == reference[:24]
    finally:
        for a in agents:
            a.stop()


def _restarted(a: AgentProc, times: int) -> dict[str, Any] | None:
    """The placement once the same stages were restarted `times` times and the last
    restart's workers failed too."""
    s = a.status()
    p = (s or {}).get("placement") or {}
    pending = p.get("pending")
    failed = pending and p.get("fault") and p["fault"]["epoch"] == pending["epoch"]
    return p if p.get("restarts", 0) >= times and failed else None


def _fault(a: AgentProc) -> dict[str, Any] | None:
    s = a.status()
    return (s.get("placement") or {}).get("fault") if s else None


def test_a_rank_whose_data_port_is_taken_is_named_in_status(tmp_path: Path, tiny_model: Path) -> None:
    data = _data_port_base()
    agents = _agents(tmp_path, _two_stage_memory(tiny_model), [data, data + 50])
    try:
        with _hold_data_ports("127.0.0.3", data + 50) as held:
            for a in agents:
                a.start()
            wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of 2")
            blocked = agents[1].status()["node_id"]  # type: ignore[index]
            _set_model(agents[0], tiny_model)
            fault = wait_for(lambda: _fault(agents[0]), FAULT_TIMEOUT_S, "a worker fault in status")
            assert fault["code"] == "ring_port_in_use", fault
            assert fault["node_id"] == blocked and fault["address"] == "127.0.0.3" and fault["port"] in held
            assert "error: 98" in fault["message"]
            # The CLI says it too, in words and as JSON.
            for args in (["status"], ["status", "--json"]):
                r = subprocess.run([sys.executable, "-m", "p2pmesh", *args, "--state-dir", str(agents[0].state_dir)],
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr
                if args[-1] == "--json":
                    assert json.loads(r.stdout)["placement"]["fault"]["node_id"] == blocked
                else:
                    assert f"node {blocked[:8]}'s data port 127.0.0.3:" in r.stdout and "[ring_port_in_use]" in r.stdout
            # Restarts stay bounded: the leader gives up after RESTARTS_MAX, and the fault stays.
            p = wait_for(lambda: _restarted(agents[0], RESTARTS_MAX), FAULT_TIMEOUT_S, "the leader to stop restarting")
            time.sleep(10 * HELLO_S)  # a restart would be proposed within a hello period or two
            again = _restarted(agents[0], RESTARTS_MAX)
            assert again is not None and again["pending"]["epoch"] == p["pending"]["epoch"], (p, again)
            assert not again["serving"] and again["fault"]["code"] == "ring_port_in_use"
    finally:
        for a in agents:
            a.stop()
