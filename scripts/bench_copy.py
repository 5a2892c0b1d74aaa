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

import os
import sys
import tempfile
import time
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


async def _tcp_copy(src: Path, dest: Path) -> float:
    async def serve(stream: trio.SocketStream) -> None:
        with open(src, "rb") as f:
            while chunk := await trio.to_thread.run_sync(f.read, CHUNK):
                await stream.send_all(chunk)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        start = time.perf_counter()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pmesh-bench-copy-") as tmp:
        src = Path(tmp) / "src" / NAME
        src.parent.mkdir()
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
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


if __name__ == "__main__":
    sys.exit(main())
