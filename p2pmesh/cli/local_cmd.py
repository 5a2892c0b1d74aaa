"""`p2pmesh local --nodes N`: a cluster of N agents on this one computer, for trying p2pmesh
and for development.

Loopback (the default): agents listen on 127.0.0.2, .3, ... (one each, the same port), know
each other as static peers (no mDNS: nothing leaves the machine), keep their state in a
fresh directory, and serve the HTTP API on 127.0.0.1 at consecutive ports.

`--netns` (root, Linux): each agent runs in its own network namespace, like a Mac of its
own: the namespaces are cabled in a ring by veth pairs marked as Thunderbolt cables and
share one Ethernet switch, and the agents find each other with zeroconf and build their
ring from the cables, as on Macs. Each one's HTTP API is on 127.0.0.1:HTTP-PORT inside its
namespace (`ip netns exec NAME curl ...`); its control socket is reachable from here.

Each agent is printed once it answers (`--json`: one object per agent with state_dir,
socket, pid, http, and netns in that mode), then `{"ready": true}` once they form one
cluster. Ctrl-C or SIGTERM stops them all (and deletes the namespaces).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NODES_MAX = 16
START_TIMEOUT_S = 60.0
POLL_S = 0.2
MODEL_TIMEOUT_S = 3600.0
"""--model: how long the agent may take to accept the model (it may download it first)."""


def add_parser(subparsers: Any) -> None:
    local = subparsers.add_parser("local", help="run N agents on this computer (loopback) until Ctrl-C")
    local.set_defaults(run=run)
    local.add_argument("--nodes", type=int, default=3)
    local.add_argument("--model", default=None, help="serve this model once the cluster formed")
    local.add_argument("--dir", type=Path, default=None, help="state directories go here (default: a new temp dir)")
    local.add_argument("--http-port", type=int, default=7780, help="HTTP API of the first agent; the next ones count up")
    local.add_argument("--memory-limit", type=int, default=None, metavar="BYTES",
                       help="each agent offers at most this much memory for layers (spreads a small model over several)")
    local.add_argument("--netns", action="store_true",
                       help="one network namespace per agent, cabled in a ring (needs root; Linux)")
    local.add_argument("--json", action="store_true")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Node:
    """One agent of the local cluster, as printed."""

    index: int
    state_dir: Path
    http: str
    argv: tuple[str, ...]
    netns: str | None = None

    def row(self, pid: int) -> dict[str, Any]:
        row: dict[str, Any] = {"state_dir": str(self.state_dir), "socket": str(self.state_dir / "agent.sock"),
                               "pid": pid, "http": self.http}
        if self.netns is not None:
            row["netns"] = self.netns
        return row


class LoopbackMissing(OSError):
    """This computer has no 127.0.0.N address beyond 127.0.0.1 (macOS configures only that
    one); the message says how to add them."""


def loopback_nodes(count: int, root: Path, key: Path, http_port: int, extra: list[str]) -> list[Node]:
    """`count` agents on 127.0.0.2, .3, ... that know each other as static peers."""
    hosts = [f"127.0.0.{i + 2}" for i in range(count)]
    for host in hosts:
        try:
            _free_port(host)
        except OSError:
            raise LoopbackMissing(
                f"cannot bind {host}: each local agent needs a loopback address of its own (Linux has all of "
                f"127.0.0.0/8; on macOS add them with `sudo ifconfig lo0 alias {host} up` for 127.0.0.2 to "
                f"127.0.0.{count + 1})") from None
    port = _free_port(hosts[0])
    listens = [f"{host}:{port}" for host in hosts]
    nodes = []
    for i, listen in enumerate(listens):
        state = root / f"agent{i}"
        argv = [sys.executable, "-m", "p2pmesh", "agent", "--state-dir", str(state), "--listen", listen, "--no-mdns",
                "--cluster-key-file", str(key), "--http", f"127.0.0.1:{http_port + i}",
                "--data-port", str(40000 + (port % 1000) * 8), *extra]
        for peer in listens:
            if peer != listen:
                argv += ["--peer", peer]
        nodes.append(Node(i, state, f"http://127.0.0.1:{http_port + i}", tuple(argv)))
    return nodes


def start(node: Node, root: Path) -> subprocess.Popen[bytes]:
    """Start one agent, its output appended to ROOT/agentI.log."""
    node.state_dir.mkdir(exist_ok=True)
    with open(root / f"agent{node.index}.log", "ab") as log:
        return subprocess.Popen(node.argv, stdout=log, stderr=log, start_new_session=True)


def _netns_nodes(args: argparse.Namespace, root: Path, key: Path, common: list[str], bench: Any) -> list[Node]:
    bench.lan()
    bench.plug_ring(thunderbolt=True)
    nodes = []
    for i, host in enumerate(bench.hosts):
        state = root / f"agent{i}"
        argv = [*bench.exec_prefix(i), sys.executable, "-m", "p2pmesh", "agent", "--state-dir", str(state),
                "--listen", ":7741", "--cluster-key-file", str(key), "--http", f"127.0.0.1:{args.http_port}", *common]
        nodes.append(Node(i, state, f"http://127.0.0.1:{args.http_port}", tuple(argv), netns=host))
    return nodes


def formed(statuses: list[dict[str, Any] | None], count: int) -> bool:
    """The agents' statuses (None: not answering) show one cluster of `count` members."""
    answered = [s for s in statuses if s is not None]
    return (len(answered) == len(statuses) == count and len({s["cluster_id"] for s in answered}) == 1
            and all(len(s["members"]) == count for s in answered))


def run(args: argparse.Namespace) -> int:
    from p2pmesh.cli import netns

    if not 1 <= args.nodes <= NODES_MAX:
        print(f"p2pmesh: --nodes must be between 1 and {NODES_MAX}", file=sys.stderr)
        return 2
    if args.netns and (why := netns.usable()) is not None:
        print(f"p2pmesh: --netns: {why}; without --netns the agents share this computer's loopback", file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="p2pmesh-local-"))
    root.mkdir(parents=True, exist_ok=True)
    key = root / "cluster.key"
    if not key.exists():
        from p2pmesh.drivers.keys import write_key

        write_key(key, os.urandom(32))
    common = ["--memory-limit", str(args.memory_limit)] if args.memory_limit else []
    bench = None
    try:
        if args.netns:
            bench = netns.Bench.create(args.nodes, prefix="p2pl")
            nodes = _netns_nodes(args, root, key, common, bench)
        else:
            nodes = loopback_nodes(args.nodes, root, key, args.http_port, common)
        return _serve(args, root, nodes)
    except netns.NetnsError as exc:
        print(f"p2pmesh: cannot build the namespaces: {exc}", file=sys.stderr)
        return 1
    except LoopbackMissing as exc:
        print(f"p2pmesh: {exc}", file=sys.stderr)
        return 1
    finally:
        if bench is not None:
            bench.close()


def _serve(args: argparse.Namespace, root: Path, nodes: list[Node]) -> int:
    """Start the agents, report them, wait for one cluster, then until asked to stop."""
    from p2pmesh.client import Client, P2PMeshError

    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        procs.extend(start(node, root) for node in nodes)
        deadline = time.monotonic() + START_TIMEOUT_S
        shown: set[int] = set()
        ready = False
        while not stopping and time.monotonic() < deadline and not ready:
            statuses = []
            for node, p in zip(nodes, procs):
                if p.poll() is not None:
                    print(f"p2pmesh: agent {node.index} exited with {p.returncode}; see {root / f'agent{node.index}.log'}", file=sys.stderr)
                    return 1
                try:
                    status = Client(node.state_dir / "agent.sock").status_object(timeout=2.0)
                except P2PMeshError:
                    statuses.append(None)
                    continue
                statuses.append(status)
                if node.index not in shown:
                    shown.add(node.index)
                    row = node.row(p.pid)
                    where = f" (namespace {node.netns})" if node.netns else ""
                    print(json.dumps(row) if args.json else f"agent {node.index}: pid {p.pid}, {row['socket']}, {row['http']}{where}", flush=True)
            ready = formed(statuses, args.nodes)
            if not ready:
                time.sleep(POLL_S)
        if not ready:
            if not stopping:
                print(f"p2pmesh: the agents did not form one cluster within {START_TIMEOUT_S:.0f} s; logs in {root}", file=sys.stderr)
            return 1
        print(json.dumps({"ready": True}) if args.json else f"ready: one cluster of {args.nodes} (Ctrl-C stops it)", flush=True)
        if args.model:
            try:
                model = Client(nodes[0].state_dir / "agent.sock").set_model(args.model, timeout=MODEL_TIMEOUT_S)
            except P2PMeshError as exc:
                print(f"p2pmesh: {exc}", file=sys.stderr)
                return 1
            said = {"model": asdict(model) if model else None}
            print(json.dumps(said) if args.json else f"serving {args.model}", flush=True)
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
