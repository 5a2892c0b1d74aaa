"""`p2pmesh local --nodes N`: a cluster of N agents on this one computer, for trying p2pmesh
and for development.

Agents listen on loopback addresses 127.0.0.2, .3, ... (one each, the same port), know each
other as static peers (no mDNS: nothing leaves the machine), keep their state in a fresh
directory, and serve the HTTP API on 127.0.0.1 at consecutive ports. Each agent is printed
once it answers (`--json`: one object per agent with state_dir, socket, pid, http), then
`{"ready": true}` once they form one cluster. Ctrl-C or SIGTERM stops them all.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NODES_MAX = 16
START_TIMEOUT_S = 60.0
POLL_S = 0.2


def add_parser(subparsers: Any) -> None:
    local = subparsers.add_parser("local", help="run N agents on this computer (loopback) until Ctrl-C")
    local.add_argument("--nodes", type=int, default=3)
    local.add_argument("--model", default=None, help="serve this model once the cluster formed")
    local.add_argument("--dir", type=Path, default=None, help="state directories go here (default: a new temp dir)")
    local.add_argument("--http-port", type=int, default=7780, help="HTTP API of the first agent; the next ones count up")
    local.add_argument("--json", action="store_true")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    from p2pmesh.drivers.control import ControlError, request

    if not 1 <= args.nodes <= NODES_MAX:
        print(f"p2pmesh: --nodes must be between 1 and {NODES_MAX}", file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="p2pmesh-local-"))
    root.mkdir(parents=True, exist_ok=True)
    key = root / "cluster.key"
    if not key.exists():
        from p2pmesh.drivers.keys import write_key

        write_key(key, os.urandom(32))
    port = _free_port("127.0.0.2")
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(args.nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for i, listen in enumerate(listens):
            state = root / f"agent{i}"
            state.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "p2pmesh", "agent", "--state-dir", str(state), "--listen", listen, "--no-mdns",
                   "--cluster-key-file", str(key), "--http", f"127.0.0.1:{args.http_port + i}",
                   "--data-port", str(40000 + (port % 1000) * 8)]
            for peer in listens:
                if peer != listen:
                    cmd += ["--peer", peer]
            log = open(root / f"agent{i}.log", "ab")  # noqa: SIM115 - owned by the child
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True))
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        shown: set[int] = set()
        ready = False
        while not stopping and time.monotonic() < deadline and not ready:
            statuses = []
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    print(f"p2pmesh: agent {i} exited with {p.returncode}; see {root / f'agent{i}.log'}", file=sys.stderr)
                    return 1
                try:
                    status = request(root / f"agent{i}" / "agent.sock", "status", timeout_s=2.0)["status"]
                except ControlError:
                    statuses.append(None)
                    continue
                statuses.append(status)
                if i not in shown:
                    shown.add(i)
                    row = {"state_dir": str(root / f"agent{i}"), "socket": str(root / f"agent{i}" / "agent.sock"),
                           "pid": p.pid, "http": f"http://127.0.0.1:{args.http_port + i}"}
                    print(json.dumps(row) if args.json else f"agent {i}: pid {p.pid}, {row['socket']}, {row['http']}", flush=True)
            ready = all(s is not None for s in statuses) and len({s["cluster_id"] for s in statuses}) == 1 and all(  # type: ignore[index]
                len(s["members"]) == args.nodes for s in statuses  # type: ignore[index]
            )
            if not ready:
                time.sleep(POLL_S)
        if not ready:
            if not stopping:
                print(f"p2pmesh: the agents did not form one cluster within {START_TIMEOUT_S:.0f} s; logs in {root}", file=sys.stderr)
            return 1
        print(json.dumps({"ready": True}) if args.json else f"ready: one cluster of {args.nodes} (Ctrl-C stops it)", flush=True)
        if args.model:
            answer = request(root / "agent0" / "agent.sock", "model", timeout_s=3600.0, name=args.model)
            print(json.dumps({"model": answer.get("model")}) if args.json else f"serving {args.model}", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
