"""Real MLX ring groups from rendered hostfiles: one `p2pmesh.worker.ring_check` process per
rank, over loopback and over network namespaces joined by veth "cables" (tests/agent/netns.py).

No mocks: MLX binds, connects, all-sums and passes each rank to its right neighbour. A silent
peer hangs a rank forever, so every run has a hard deadline and every process is killed in a
`finally`. Traffic goes only to 127.0.0.1 or to namespaces the test created.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import RingHop
from p2pmesh.core.mlx_hostfile import loopback_hostfile, ring_hostfile
from tests.agent.netns import Bench, Cable, require_root

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 45.0
"""The worker's own watchdog fires first, so a hang shows MLX's stack in its stderr."""
KILL_WAIT_S = 5.0
PORT_LOW, PORT_HIGH = 20000, 32000
"""Below Linux's ephemeral range, so an outgoing MLX connection never holds a listen port."""
PORT_TRIES = 50
NETNS_BASE_PORT = 5000
"""Fresh namespaces have no listeners: any port is free there."""


def node(i: int) -> NodeId:
    return NodeId(f"{i:032x}")


def free_port_run(count: int) -> int:
    """A base port with base..base+count-1 all free on 127.0.0.1 right now."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(PORT_TRIES):
        base = rng.randrange(PORT_LOW, PORT_HIGH - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no run of {count} free ports in {PORT_TRIES} tries")


def run_ranks(hostfile: list[list[str]], tmp_path: Path, prefixes: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """Start one ring_check per rank (inside prefixes[rank], e.g. `ip netns exec NAME`), wait
    for all under one deadline, and return each rank's JSON line in rank order."""
    n = len(hostfile)
    path = tmp_path / "hostfile.json"
    path.write_text(json.dumps(hostfile), encoding="utf-8")
    procs: list[subprocess.Popen[bytes]] = []
    errs = [tmp_path / f"rank{rank}.err" for rank in range(n)]
    try:
        for rank in range(n):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(path)}
            cmd = [sys.executable, "-m", "p2pmesh.worker.ring_check", "--timeout-s", str(WORKER_TIMEOUT_S)]
            with errs[rank].open("wb") as err:
                procs.append(
                    subprocess.Popen(
                        [*(prefixes[rank] if prefixes else []), *cmd], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err
                    )
                )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        outs: list[bytes] = []
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running after {RUN_TIMEOUT_S} s\n{_stderrs(errs)}")
            outs.append(out)
        codes = [p.returncode for p in procs]
        assert codes == [0] * n, f"exit codes {codes}\n{_stderrs(errs)}"
        return [json.loads(out.decode().strip().splitlines()[-1]) for out in outs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(timeout=KILL_WAIT_S)


def _stderrs(errs: list[Path]) -> str:
    return "\n".join(f"--- rank {i} stderr:\n{p.read_text(errors='replace')[-3000:]}" for i, p in enumerate(errs))


def assert_ring_works(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["size"] == n
        assert r["all_sum"] == n * (n + 1) // 2
        assert r["received"] == (rank - 1) % n  # the left neighbour's rank
        assert r["ok"] is True


def loopback_hop(src: NodeId, dst: NodeId) -> RingHop:
    return RingHop(src, dst, "network", 1.0, None, "lo", "lo", "127.0.0.1", "127.0.0.1", False)


@pytest.mark.parametrize("n", [2, 3])
def test_loopback_ring_from_ring_hops(n: int, tmp_path: Path) -> None:
    order = [node(i) for i in range(n)]
    hops = [loopback_hop(order[i], order[(i + 1) % n]) for i in range(n)]
    base = free_port_run(n)
    hostfile = ring_hostfile(order, hops, base)
    assert hostfile == loopback_hostfile(n, base)
    assert_ring_works(run_ranks(hostfile, tmp_path))


@pytest.mark.parametrize(
    ("hostfile", "message"),
    [(None, b"set both MLX_RANK and MLX_HOSTFILE"), ([["127.0.0.1:20001"]], b"needs at least 2")],
)
def test_a_bad_environment_fails_fast(hostfile: list[list[str]] | None, message: bytes, tmp_path: Path) -> None:
    # A one-rank hostfile would make MLX dial itself for ~31 s: the worker refuses it first.
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    if hostfile is not None:
        path = tmp_path / "h.json"
        path.write_text(json.dumps(hostfile), encoding="utf-8")
        env |= {"MLX_RANK": "0", "MLX_HOSTFILE": str(path)}
    r = subprocess.run(
        [sys.executable, "-m", "p2pmesh.worker.ring_check"],
        check=False,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


def cable_between(bench: Bench, i: int, j: int) -> Cable:
    a, b = bench.hosts[i], bench.hosts[j]
    return next(c for c in bench.cables if {c.a, c.b} == {a, b})


def end_of(cable: Cable, host: str) -> tuple[str, str]:
    """(interface, IPv4) of `host` on `cable`."""
    return (cable.dev_a, cable.addr_a) if cable.a == host else (cable.dev_b, cable.addr_b)


def cable_hops(bench: Bench, ring: list[int]) -> tuple[list[NodeId], list[RingHop]]:
    """The committed ring over bench hosts `ring` (host indices in rank order), each hop over
    the cable between consecutive hosts, with each end's interface and address on it."""
    n = len(ring)
    hops = []
    for rank in range(n):
        src, dst = ring[rank], ring[(rank + 1) % n]
        cable = cable_between(bench, src, dst)
        (src_dev, src_ip), (dst_dev, dst_ip) = end_of(cable, bench.hosts[src]), end_of(cable, bench.hosts[dst])
        hops.append(RingHop(node(src), node(dst), "thunderbolt", 40.0, None, src_dev, dst_dev, src_ip, dst_ip, False))
    return [node(h) for h in ring], hops


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hosts", "plugs", "ring"),
    [
        # A triangle, ranked against the plugging order so both cable ends get used.
        (3, [(0, 1), (1, 2), (2, 0)], [1, 0, 2]),
        # A square with a diagonal the ring must not use, walked backwards.
        (4, [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)], [0, 3, 2, 1]),
    ],
    ids=["triangle", "square"],
)
def test_ring_over_namespace_cables(hosts: int, plugs: list[tuple[int, int]], ring: list[int], tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(hosts)
    try:
        for i, j in plugs:
            bench.plug(i, j, ipv4=True)
        order, hops = cable_hops(bench, ring)
        hostfile = ring_hostfile(order, hops, NETNS_BASE_PORT)
        n = len(ring)
        for rank in range(n):
            # Rank r listens on its own address on the cable from its left neighbour: the
            # only address the left neighbour can reach (each cable is its own /30).
            left_cable = cable_between(bench, ring[(rank - 1) % n], ring[rank])
            _, ip = end_of(left_cable, bench.hosts[ring[rank]])
            assert hostfile[rank] == [f"{ip}:{NETNS_BASE_PORT + rank}"]
        prefixes = [bench.exec_prefix(host) for host in ring]
        assert_ring_works(run_ranks(hostfile, tmp_path, prefixes))
    finally:
        bench.close()
