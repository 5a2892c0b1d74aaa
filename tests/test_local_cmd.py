"""`p2pmesh local --nodes N --json`: N real agents on loopback form one cluster, each is
listed with its state directory, socket, pid and HTTP address, and SIGTERM stops them all."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.agent.harness import ROOT, free_port

TIMEOUT_S = 90


def test_local_starts_a_cluster_and_stops_it(tmp_path: Path) -> None:
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pmesh", "local", "--nodes", "3", "--json", "--dir", str(tmp_path), "--http-port", str(http)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    rows: list[dict] = []  # type: ignore[type-arg]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            row = json.loads(line)
            rows.append(row)
            if row.get("ready"):
                break
        assert rows and rows[-1] == {"ready": True}, (rows, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        agents = rows[:-1]
        assert len(agents) == 3 and all(set(a) == {"state_dir", "socket", "pid", "http"} for a in agents)
        assert all(Path(a["socket"]).exists() for a in agents)
        pids = [a["pid"] for a in agents]
        from p2pmesh.client import Client

        status = Client(Path(agents[1]["socket"])).status_object()
        assert len(status["members"]) == 3
        import urllib.request

        with urllib.request.urlopen(agents[0]["http"] + "/health", timeout=10) as r:  # the HTTP API answers
            assert json.load(r)["ok"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"agent {pid} still running"


def test_local_netns_cables_namespaces_in_a_ring_and_deletes_them(tmp_path: Path) -> None:
    """`--netns`: one namespace per agent, cabled in a ring of (veth) Thunderbolt cables; the
    agents find each other with zeroconf and commit the ring that follows the cables; SIGTERM
    stops them and deletes the namespaces."""
    from tests.agent.netns import require_root

    require_root()
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pmesh", "local", "--nodes", "3", "--netns", "--json", "--dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    rows: list[dict] = []  # type: ignore[type-arg]
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            rows.append(json.loads(line))
            if rows[-1].get("ready"):
                break
        assert rows and rows[-1] == {"ready": True}, (rows, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        agents = rows[:-1]
        assert len(agents) == 3 and all(set(a) == {"state_dir", "socket", "pid", "http", "netns"} for a in agents)
        spaces = {a["netns"] for a in agents}
        assert spaces <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split())
        from p2pmesh.client import Client, P2PMeshError

        def ring() -> dict | None:  # type: ignore[type-arg]
            try:
                r = Client(Path(agents[0]["socket"])).status_object().get("ring")
            except P2PMeshError:
                return None
            return r if r and len(r["order"]) == 3 and all(h["kind"] == "thunderbolt" for h in r["hops"]) else None

        from tests.agent.harness import wait_for

        committed = wait_for(ring, 40, "a ring of three Thunderbolt hops")
        assert {h["from_interface"][:2] for h in committed["hops"]} == {"tb"}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    assert not spaces & set(left), "the namespaces were not deleted"
