#!/usr/bin/env python3
"""Model-file copy between Macs (drivers/files.py) against plain TCP, on this machine.

    .venv/bin/python scripts/bench_copy.py [--mib 256] [--runs 3] [--json [FILE]]

One process, loopback: a server task serves a --mib MiB safetensors file to a client task
with the real driver (the session over mutual TLS 1.3, the bytes over its plain TCP data
connection with sendfile, received in 8 MiB buffers, hashed, fsynced and renamed at the
end), best of --runs copies; beside it the same driver with the bytes inside the TLS
session (--copy-over-tls). The baseline, measured in the same run: the same bytes from the
same file over a plain TCP connection between two trio tasks, read in 1 MiB chunks and
written in 8 MiB batches, with the same fsync; so the ratio is the cost of the protocol,
the hashing and the checks. On Macs the wire is Thunderbolt (40-80 Gb/s) and the disks are
several GB/s, so the copy runs at whatever this ratio of the slower of the two allows;
downloading from the internet instead runs at the line's speed. Also measured in each run:
the disk alone, the same bytes read from the same file and written in the same batches
with the same fsync, no network (the floor of both when the disk is the slower).

With ``--json`` the raw figures end stdout as one JSON line whose first keys are
``copy_mb_s``, ``tcp_mb_s`` and ``disk_mb_s`` (with ``--json FILE``: into FILE instead).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row, table, wall, write_json  # noqa: E402
from p2pmesh.drivers.files import CHUNK, WRITE_BYTES, fetch_file, serve_files  # noqa: E402
from tests.drivers.test_probe import Member  # noqa: E402

NAME = "model-00001-of-00001.safetensors"


async def _copy(src: Path, dest: Path, over_tls: bool = False) -> float:
    server, client = Member(), Member()
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(serve_files, listeners, server.server_ctx, lambda name: src.parent)
        port = listeners[0].socket.getsockname()[1]
        start = time.perf_counter()
        await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "m", NAME, dest.parent, over_tls=over_tls)
        took = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return took


async def tcp_serve(src: Path, stream: trio.SocketStream) -> None:
    """The baseline's sender: the file in CHUNK reads, over plain TCP."""
    with open(src, "rb") as f:
        while chunk := await trio.to_thread.run_sync(f.read, CHUNK):
            await stream.send_all(chunk)
    await stream.aclose()


async def tcp_receive(host: str, port: int, dest: Path) -> None:
    """The baseline's receiver: CHUNK receives written in WRITE_BYTES batches, then fsync."""
    stream = await trio.open_tcp_stream(host, port)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        pending = bytearray()
        while chunk := await stream.receive_some(CHUNK):
            pending += chunk
            if len(pending) >= WRITE_BYTES:
                await trio.to_thread.run_sync(out.write, bytes(pending))
                pending.clear()
        await trio.to_thread.run_sync(out.write, bytes(pending))
        await trio.to_thread.run_sync(out.flush)
        await trio.to_thread.run_sync(os.fsync, out.fileno())


async def _tcp_copy(src: Path, dest: Path) -> float:
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, partial(tcp_serve, src), listeners)
        start = time.perf_counter()
        await tcp_receive("127.0.0.1", port, dest)
        took = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return took


def _disk_write(src: Path, dest: Path) -> float:
    """The disk alone: the same reads, batched writes and fsync as the TCP baseline's
    receiver, with no network between (the copy's and the baseline's floor on this disk)."""
    dest.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        with open(src, "rb") as f, open(dest, "wb") as out:
            pending = bytearray()
            while chunk := f.read(CHUNK):
                pending += chunk
                if len(pending) >= WRITE_BYTES:
                    out.write(bytes(pending))
                    pending.clear()
            out.write(bytes(pending))
            out.flush()
            os.fsync(out.fileno())

    return wall(write)[1]


def main() -> int:
    ap = parser(__doc__, prog="scripts/bench_copy.py")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--netns-cables", type=int, default=0, metavar="N",
                    help="instead: one file striped over N veth cables between two namespaces vs one cable's "
                         "plain TCP (root; scripts/copy_netns.py)")
    ap.add_argument("--cable-mbit", type=int, default=None, metavar="R",
                    help="with --netns-cables: shape each cable to R Mbit/s (tc tbf), as a real cable has a rate")
    args = ap.parse_args()
    if args.netns_cables:
        return _netns(args)
    with tempfile.TemporaryDirectory(prefix="p2pmesh-bench-copy-") as tmp:
        src = _random_file(Path(tmp) / "src" / NAME, args.mib)
        size = src.stat().st_size
        copy, tls, tcp, disk = [], [], [], []
        for i in range(args.runs):
            copy.append(trio.run(_copy, src, Path(tmp) / f"copy{i}" / NAME))
            tcp.append(trio.run(_tcp_copy, src, Path(tmp) / f"tcp{i}" / NAME))
            assert (Path(tmp) / f"copy{i}" / NAME).read_bytes() == src.read_bytes()
            tls.append(trio.run(_copy, src, Path(tmp) / f"tls{i}" / NAME, True))
            disk.append(_disk_write(src, Path(tmp) / f"disk{i}" / NAME))
            for d in ("copy", "tcp", "tls", "disk"):  # measured: give the space back
                (Path(tmp) / f"{d}{i}" / NAME).unlink()
    copy_mbs, tls_mbs = size / min(copy) / 1e6, size / min(tls) / 1e6
    tcp_mbs, disk_mbs = size / min(tcp) / 1e6, size / min(disk) / 1e6
    figures = {"copy_mb_s": round(copy_mbs, 1), "tcp_mb_s": round(tcp_mbs, 1), "disk_mb_s": round(disk_mbs, 1),
               "tls_mb_s": round(tls_mbs, 1), "bytes": size, "ratio": round(copy_mbs / tcp_mbs, 3),
               "tls_ratio": round(tls_mbs / tcp_mbs, 3), "runs": args.runs, "load": [round(x, 2) for x in os.getloadavg()]}
    table(f"{args.mib} MiB, best of {args.runs}", "MB/s", "ratio to plain TCP")
    row("model-file copy between agents (TLS session, TCP data, sendfile, fsync)", f"{copy_mbs:.0f}",
        f"{copy_mbs / tcp_mbs:.2f}x")
    row("the same with --copy-over-tls (bytes inside TLS 1.3)", f"{tls_mbs:.0f}", f"{tls_mbs / tcp_mbs:.2f}x")
    row("plain TCP, same chunks and fsync (baseline)", f"{tcp_mbs:.0f}", "1.00x")
    row("the disk alone, same writes and fsync", f"{disk_mbs:.0f}", f"{disk_mbs / tcp_mbs:.2f}x")
    print(f"\nmodel-file copy: {copy_mbs:.0f} MB/s (over TLS {tls_mbs:.0f}); plain TCP, same chunks and fsync: "
          f"{tcp_mbs:.0f} MB/s; ratio {copy_mbs / tcp_mbs:.2f}x ({args.mib} MiB, best of {args.runs}); "
          f"the disk alone {disk_mbs:.0f} MB/s")
    write_json(args.json, figures)
    return 0


def _netns(args: argparse.Namespace) -> int:
    from copy_netns import measure

    from p2pmesh.cli.netns import usable

    why = usable()
    if why is not None:
        print(f"skipped: {why}")
        write_json(args.json, {"skipped": why})
        return 0
    if args.netns_cables < 2:
        raise SystemExit("--netns-cables takes 2 or more")
    with tempfile.TemporaryDirectory(prefix="p2pmesh-bench-copy-") as tmp:
        src = _random_file(Path(tmp) / "src" / NAME, args.mib)
        figures = measure(src, args.netns_cables, args.runs, args.cable_mbit)
    n = args.netns_cables
    shaped = f", each shaped to {args.cable_mbit} Mbit/s" if args.cable_mbit else ", unshaped"
    table(f"{args.mib} MiB between two namespaces, {n} veth cables{shaped}, best of {args.runs}", "MB/s",
          "ratio to 1 cable's TCP")
    tcp = figures["tcp_1_cable_mb_s"]
    row("plain TCP over 1 cable, same chunks and fsync (baseline)", f"{tcp:.0f}", "1.00x")
    row("model-file copy over 1 cable", f"{figures['copy_1_cable_mb_s']:.0f}", f"{figures['copy_1_cable_mb_s'] / tcp:.2f}x")
    many = figures[f"copy_{n}_cables_mb_s"]
    row(f"model-file copy striped over {n} cables", f"{many:.0f}", f"{many / tcp:.2f}x")
    print(f"\none file striped over {n} cables: {many:.0f} MB/s, {many / tcp:.2f}x one cable's plain TCP ({tcp:.0f} MB/s)")
    write_json(args.json, figures)
    return 0


def _random_file(path: Path, mib: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    return path


if __name__ == "__main__":
    sys.exit(main())
