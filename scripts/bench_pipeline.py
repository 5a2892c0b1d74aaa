#!/usr/bin/env python3
"""Pipeline inference on this machine: decode speed of 2 workers vs 1, and the per-hop latency.

    .venv/bin/python scripts/bench_pipeline.py [--hidden 1024] [--layers 8] [--tokens 64] [--runs 3] [--hops 300] [--json [FILE]]

(a) Decode tokens/s of one worker holding the whole model vs a 2-worker pipeline (uneven
    split is not needed here: layers split in half) on a loopback MLX ring, same model,
    same greedy request. The model is written by scripts/make_tiny_model.py (llama, float32,
    --hidden/--layers; default 1024 x 8 layers, intermediate 2x hidden, ~76 M parameters,
    ~300 MB) so that a decode step is dominated by compute and weight reads, not by the
    hop. Tokens/s = (n - 1) / (arrival of the last token - arrival of the first) as the
    agent would see them on the workers' stdout; best of --runs requests after a warm-up.
(b) Per-hop activation latency: one [1, 1, hidden] activation sent rank 0 -> rank 1 and
    back with the workers' own Link (pipeline.py), median of --hops round trips; per hop
    = round trip / 2. Against a raw TCP round trip of the same bytes between two Python
    processes on 127.0.0.1 (TCP_NODELAY), measured in the same run.

Targets: (a) pipeline >= 0.9x single; (b) per-hop latency <= 2x the TCP round trip.
Note: MLX's ring backend busy-polls its sockets while a send or recv is pending, so each
waiting rank spins a core; on a 2-core machine the two ranks and MLX's compute threads
compete for the same cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row, table, write_json  # noqa: E402

PROMPT = "Once upon a time there was a small model"
DEADLINE_S = 600.0


def decode_rate(cluster: object, tokens: int, runs: int) -> float:
    """Best tokens/s over `runs` greedy requests, after one warm-up request."""
    rates = []
    for i in range(runs + 1):
        events, final = cluster.request({"op": "generate", "id": f"r{i}", "prompt": PROMPT, "max_tokens": tokens}, DEADLINE_S)
        assert final["event"] == "done", final
        if i == 0 or len(events) < 2:
            continue
        rates.append((len(events) - 1) / (events[-1]["_t"] - events[0]["_t"]))
    return max(rates)


def bench_decode(model: Path, layers: int, tokens: int, runs: int, work: Path) -> tuple[float, float]:
    from tests.worker.worker_cluster import Cluster

    rates = []
    for stages in ([[0, layers]], [[0, layers // 2], [layers // 2, layers]]):
        wd = work / f"decode{len(stages)}"
        wd.mkdir()
        cluster = Cluster(model, stages, wd, timestamps=True)
        try:
            cluster.start()
            cluster.wait_ready(DEADLINE_S)
            rates.append(decode_rate(cluster, tokens, runs))
            codes = cluster.shutdown()
            assert codes == [0] * len(stages), (codes, cluster.stderrs())
        finally:
            cluster.close()
    return rates[0], rates[1]


def hop_worker(hidden: int, hops: int) -> None:
    """One rank of the hop benchmark (MLX_RANK / MLX_HOSTFILE set): rank 0 sends and times,
    rank 1 echoes."""
    import mlx.core as mx

    from p2pmesh.worker.pipeline import DTYPE_CODES, OP_DECODE, Header, Link, WireRow
    from p2pmesh.worker.ring_check import read_hosts
    from p2pmesh.worker.ring_wake import left_sockets

    group = mx.distributed.init(backend="ring", strict=True)
    # As the workers do: sleep until the left neighbour's bytes arrive (worker/ring_wake.py).
    link = Link(group, hidden, left_sockets(read_hosts(os.environ["MLX_HOSTFILE"])[group.rank()]))
    x = mx.random.normal((1, 1, hidden))
    token = mx.array([7], dtype=mx.int32)
    header = Header(OP_DECODE, 1, 1, DTYPE_CODES[mx.float32])
    rows = [WireRow(0, 0, 2)]
    mx.eval(x, token)
    times, step_times = [], []
    for _ in range(hops + 20):
        if link.rank == 0:
            t0 = time.perf_counter()
            link.send(x)
            link.recv((1, 1, hidden), mx.float32)
            times.append(time.perf_counter() - t0)
        else:
            link.send(link.recv((1, 1, hidden), mx.float32))
    for _ in range(hops + 20):  # what one decode step moves: its frame (header, rows, activation), token back
        if link.rank == 0:
            t0 = time.perf_counter()
            link.send_frame(header, rows, x)
            link.recv((1,), mx.int32)
            step_times.append(time.perf_counter() - t0)
        else:
            link.recv_frame(hidden)
            link.send(token)
    link.drain()
    if link.rank == 0:
        print(json.dumps({"rtt_us": statistics.median(times[20:]) * 1e6, "step_us": statistics.median(step_times[20:]) * 1e6}))


def bench_hop(hidden: int, hops: int, work: Path) -> dict[str, float]:
    """Median MLX round trips in µs: rtt_us, a [1, 1, hidden] float32 activation rank 0 -> 1
    -> 0; step_us, one decode step's messages (header + activation 0 -> 1, token 1 -> 0)."""
    from p2pmesh.core.mlx_hostfile import loopback_hostfile
    from tests.worker.test_mlx_ring import free_port_run

    hostfile = work / "hop_hostfile.json"
    hostfile.write_text(json.dumps(loopback_hostfile(2, free_port_run(2))), encoding="utf-8")
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            procs.append(subprocess.Popen([sys.executable, __file__, "--hop-worker", "--hidden", str(hidden), "--hops", str(hops)],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE))
        out, _ = procs[0].communicate(timeout=DEADLINE_S)
        procs[1].wait(timeout=60)
        return {k: float(v) for k, v in json.loads(out.decode().strip().splitlines()[-1]).items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def tcp_echo(port: int, nbytes: int, count: int) -> None:
    """The echo side of the TCP baseline: accept one connection, echo `count` messages."""
    with socket.create_server(("127.0.0.1", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                conn.sendall(_recv_exact(conn, nbytes))


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def bench_tcp(nbytes: int, hops: int) -> float:
    """Median raw TCP round trip of `nbytes` between this process and an echo process, in µs."""
    from tests.worker.test_mlx_ring import free_port_run

    port = free_port_run(1)
    count = hops + 20
    echo = subprocess.Popen([sys.executable, __file__, "--tcp-echo", str(port), "--bytes", str(nbytes), "--hops", str(count)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = os.urandom(nbytes)
            times = []
            for _ in range(count):
                t0 = time.perf_counter()
                conn.sendall(payload)
                _recv_exact(conn, nbytes)
                times.append(time.perf_counter() - t0)
        echo.wait(timeout=30)
        return statistics.median(times[20:]) * 1e6
    finally:
        if echo.poll() is None:
            echo.kill()
        echo.wait(timeout=10)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hops", type=int, default=300)
    p.add_argument("--hop-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tcp-echo", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hop_worker:
        hop_worker(a.hidden, a.hops)
        return 0
    if a.tcp_echo:
        tcp_echo(a.tcp_echo, a.bytes, a.hops)
        return 0

    from tests.fixtures.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        model = make_tiny_model(work / "model", "llama", a.layers, a.hidden, heads=a.hidden // 64, seed=1)
        params = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 4
        print(f"model: llama float32, hidden {a.hidden}, {a.layers} layers, {params / 1e6:.1f} M parameters "
              f"(written in {time.monotonic() - t0:.1f} s); {os.cpu_count()} CPUs", file=sys.stderr)
        single, pipe = bench_decode(model, a.layers, a.tokens, a.runs, work)
        hop = bench_hop(a.hidden, a.hops, work)
        hop_rtt = hop["rtt_us"]
        tcp_rtt = bench_tcp(a.hidden * 4, a.hops)
    ratio = pipe / single
    per_hop = hop_rtt / 2
    print(f"\nModel: llama float32, hidden {a.hidden}, {a.layers} layers, {params / 1e6:.1f} M parameters; "
          f"{a.tokens} greedy tokens per request, best of {a.runs}; {os.cpu_count()} CPUs.\n")
    table("measurement", "value", "target", "met")
    row("decode, 1 worker (whole model)", f"{single:.1f} tok/s", "", "")
    row(f"decode, 2-worker pipeline [0,{a.layers // 2}) [{a.layers // 2},{a.layers})", f"{pipe:.1f} tok/s", "", "")
    row("pipeline / single", f"{ratio:.2f}x", ">= 0.9x", "yes" if ratio >= 0.9 else "no")
    row(f"MLX round trip 0->1->0 of [1,1,{a.hidden}] f32 ({a.hidden * 4} B), median of {a.hops}", f"{hop_rtt:.0f} µs", "", "")
    row("per-hop activation latency (round trip / 2)", f"{per_hop:.0f} µs", "", "")
    row("raw TCP round trip, same bytes, same run", f"{tcp_rtt:.0f} µs", "", "")
    row("one decode step's messages: header + activation 0->1, token 1->0", f"{hop['step_us']:.0f} µs", "", "")
    row("per hop / TCP round trip", f"{per_hop / tcp_rtt:.2f}x", "<= 2x", "yes" if per_hop <= 2 * tcp_rtt else "no")
    write_json(a.json, {"hidden": a.hidden, "layers": a.layers, "tokens": a.tokens, "runs": a.runs, "hops": a.hops, "params": params,
                        "single_tok_s": single, "pipeline_tok_s": pipe, "hop_rtt_us": hop_rtt, "step_us": hop["step_us"],
                        "tcp_rtt_us": tcp_rtt})
    return 0


if __name__ == "__main__":
    sys.exit(main())
