"""bench_copy.py --netns-cables N: one file striped over N veth "cables" between two network
namespaces, against one cable's plain TCP (needs root; iproute2 and tc).

Two hosts (p2pmesh/cli/netns.Bench) joined by N veth pairs, each its own /30. In host 0 one
process serves the file with the real driver (drivers/files.serve_files, every address) and
over plain TCP (the same chunks); in host 1 a process times one receive:

- ``tcp``: plain TCP over cable 0, written in the same batches and fsynced (the baseline);
- ``copy1``: the model-file copy over cable 0 only;
- ``copyN``: the same copy with cable 1..N-1's addresses of the same holder as extra sources
  (``also``): its ranges striped over every cable, one data connection each.

A veth pair is a memory copy in the kernel with no speed of its own: unshaped, N cables
share the same CPUs as one, so on this 2-core machine they measure the CPU, not cables.
With ``--cable-mbit R`` each cable's sending end is shaped to R Mbit/s (tc tbf), which is
what a cable is: a link with a rate of its own; then striping can show the aggregate.
The destination is on tmpfs (/dev/shm where there is one): the cables are measured, not
the disk (bench_copy.py without this option measures the disk).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pmesh.cli.netns import Bench, Cable, ip  # noqa: E402

PORT = 47911
TCP_PORT = PORT + 1
CHILD_TIMEOUT_S = 300

SERVER = """
import sys, trio
from pathlib import Path
from p2pmesh.drivers.files import serve_files
from tests.drivers.test_probe import Member
sys.path.insert(0, sys.argv[3])
from bench_copy import tcp_serve
src = Path(sys.argv[1]); port = int(sys.argv[2]); hosts = sys.argv[4].split(",")
member = Member()
async def main():
    async with trio.open_nursery() as nursery:
        # Bound to this namespace's cable addresses only, never a wildcard.
        listeners = [l for h in hosts for l in await trio.open_tcp_listeners(port, host=h)]
        plain = [l for h in hosts for l in await trio.open_tcp_listeners(port + 1, host=h)]
        await nursery.start(serve_files, listeners, member.server_ctx, lambda name: src.parent)
        nursery.start_soon(trio.serve_listeners, lambda stream: tcp_serve(src, stream), plain)
        print(member.node_id, flush=True)
trio.run(main)
"""

CLIENT = """
import sys, time, trio
from pathlib import Path
from p2pmesh.drivers.files import Source, fetch_file
from tests.drivers.test_probe import Member
sys.path.insert(0, sys.argv[6])
from bench_copy import tcp_receive
mode, node, name, dest = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
hosts = sys.argv[5].split(",")
port = int(sys.argv[7])
async def main():
    start = time.perf_counter()
    if mode == "tcp":
        await tcp_receive(hosts[0], port + 1, dest / name)
    else:
        also = [Source(h, port, node) for h in hosts[1:]] if mode == "copyN" else []
        await fetch_file(hosts[0], port, Member().client_ctx, node, "m", name, dest, also=also)
    print(time.perf_counter() - start, flush=True)
trio.run(main)
"""


def _shape(cable: Cable, mbit: int) -> None:
    """Limit a cable's sending end (host 0: the server's side) to ``mbit`` Mbit/s."""
    ip("netns", "exec", cable.a, "tc", "qdisc", "add", "dev", cable.dev_a, "root", "tbf",
       "rate", f"{mbit}mbit", "burst", "1mbit", "latency", "50ms")


def measure(src: Path, cables: int, runs: int, cable_mbit: int | None) -> dict[str, object]:
    """The figures of one netns measurement (raises NetnsError when namespaces fail)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    scripts = str(Path(__file__).resolve().parent)
    bench = Bench.create(2, prefix="p2pc")
    server: subprocess.Popen[str] | None = None
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    try:
        plugged = [bench.plug(0, 1) for _ in range(cables)]
        if cable_mbit:
            for cable in plugged:
                _shape(cable, cable_mbit)
        hosts = ",".join(c.addr_a for c in plugged)
        server = subprocess.Popen([*bench.exec_prefix(0), sys.executable, "-c", SERVER, str(src), str(PORT), scripts, hosts],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        node = server.stdout.readline().strip()
        if not node:
            raise RuntimeError("the file server in the namespace did not start")
        best: dict[str, float] = {}
        for i in range(runs):
            for mode in ("tcp", "copy1", "copyN"):
                with tempfile.TemporaryDirectory(prefix="p2pmesh-bench-netns-", dir=shm) as dest:
                    r = subprocess.run([*bench.exec_prefix(1), sys.executable, "-c", CLIENT, mode, node, src.name, dest,
                                        hosts, scripts, str(PORT)], cwd=ROOT, env=env, capture_output=True, text=True,
                                       timeout=CHILD_TIMEOUT_S)
                    if r.returncode != 0:
                        raise RuntimeError(f"{mode} failed: {r.stderr.strip()[-2000:]}")
                    if mode != "tcp":
                        assert (Path(dest) / src.name).read_bytes() == src.read_bytes()
                    took = float(r.stdout.strip().splitlines()[-1])
                    best[mode] = min(best.get(mode, took), took)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=10)
        bench.close()
    size = src.stat().st_size
    tcp, one, many = (size / best[m] / 1e6 for m in ("tcp", "copy1", "copyN"))
    return {"cables": cables, "cable_mbit": cable_mbit, "bytes": size, "runs": runs,
            "tcp_1_cable_mb_s": round(tcp, 1), "copy_1_cable_mb_s": round(one, 1),
            f"copy_{cables}_cables_mb_s": round(many, 1), "ratio_to_1_cable_tcp": round(many / tcp, 3),
            "cpus": os.cpu_count(), "load": [round(x, 2) for x in os.getloadavg()],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
