"""Health check of one ring epoch: `python -m p2pmesh.worker.ring_check [--timeout-s S]`.

The caller sets MLX_RANK and MLX_HOSTFILE (core/mlx_hostfile.py renders the file) and starts
one process per rank. Each rank joins the MLX ring group, all-sums an array filled with
rank+1 (expect n(n+1)/2), sends its rank to its right neighbour and receives its left
neighbour's, prints one JSON line, then drains and barriers so no peer sees its sockets
close mid-operation. Exit 0 when both checks hold, 1 on a failed check, an MLX error or
the watchdog, 2 on a bad environment. MLX has no timeouts (a silent peer hangs a rank
forever), so a watchdog dumps the stack and exits after --timeout-s; the caller should
still bound its wait and kill what is left.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from typing import Any

import mlx.core as mx

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 60.0


class EnvError(Exception):
    """MLX_RANK / MLX_HOSTFILE are missing or malformed: the caller's fault."""


def read_env() -> tuple[int, int]:
    """(rank, size) from the environment, checked before MLX sees it: MLX's own errors
    for a bad rank or file are obscure, and a 1-entry hostfile makes it dial itself."""
    rank_s, path = os.environ.get("MLX_RANK"), os.environ.get("MLX_HOSTFILE")
    if rank_s is None or path is None:
        raise EnvError(f"set both MLX_RANK and MLX_HOSTFILE (got MLX_RANK={rank_s!r}, MLX_HOSTFILE={path!r})")
    try:
        with open(path, encoding="utf-8") as f:
            hosts = json.load(f)
    except (OSError, ValueError) as e:
        raise EnvError(f"cannot read hostfile {path}: {e}") from None
    if not isinstance(hosts, list) or not all(isinstance(h, list) and h for h in hosts):
        raise EnvError(f"hostfile {path} is not a list of [\"ip:port\", ...] lists, one per rank")
    if len(hosts) < 2:
        raise EnvError(f"hostfile {path} has {len(hosts)} rank(s); a ring check needs at least 2")
    if not rank_s.isdigit() or not int(rank_s) < len(hosts):
        raise EnvError(f"MLX_RANK={rank_s!r} is not a rank of the {len(hosts)} in {path}")
    return int(rank_s), len(hosts)


RING_FAULTS = {
    "ring_peer_unreachable": "nothing accepts at the right-hand neighbour's address and port (its worker is not "
                             "listening there: another data port, a firewall, or it never started)",
    "ring_port_in_use": "this rank's own listen port is taken by another program",
    "ring_address_unavailable": "this rank's listen address is not on this Mac",
    "ring_bind_failed": "this rank cannot listen on its address and port",
}
"""Machine-readable reasons a rank cannot form its ring group (the `code` of a fault)."""
_CONNECT = "Couldn't connect"
_BIND = "Couldn't bind"
_BIND_CODES = {98: "ring_port_in_use", 48: "ring_port_in_use", 99: "ring_address_unavailable", 49: "ring_address_unavailable"}
"""EADDRINUSE and EADDRNOTAVAIL on Linux (98, 99) and macOS (48, 49)."""


def ring_fault(message: str, rank: int, hosts: list[list[str]]) -> dict[str, Any] | None:
    """What MLX's ring said when init failed, as a fault naming the rank at fault and its
    address and port, or None when it is not about reaching the ring. MLX's own message
    says neither ("[ring] Couldn't connect (error: 111)"): each rank dials its right-hand
    neighbour and listens on its own entry, so the hostfile tells which it was."""
    if _CONNECT in message:
        code, at = "ring_peer_unreachable", (rank + 1) % len(hosts)
    elif _BIND in message:
        errno = message.rsplit("error:", 1)[-1].strip(" )")
        code, at = _BIND_CODES.get(int(errno) if errno.isdigit() else -1, "ring_bind_failed"), rank
    else:
        return None
    address, _, port = hosts[at][0].rpartition(":")
    return {"code": code, "rank": at, "address": address, "port": int(port) if port.isdigit() else 0}


def read_hosts(path: str) -> list[list[str]]:
    """The hostfile's entries (read_env checked the file already)."""
    with open(path, encoding="utf-8") as f:
        hosts = json.load(f)
    return hosts if isinstance(hosts, list) else []


def check(group: mx.distributed.Group, expected_size: int) -> dict[str, Any]:
    rank, size = group.rank(), group.size()
    if size != expected_size:
        raise RuntimeError(f"MLX formed a group of {size}, the hostfile lists {expected_size}")
    # Collectives run on the CPU stream (no GPU implementation; keeps clear of Metal's watchdog).
    total = mx.distributed.all_sum(mx.full((size,), rank + 1, dtype=mx.int32), stream=mx.cpu)
    mx.eval(total)
    right, left = (rank + 1) % size, (rank - 1) % size
    # With two ranks left and right are the same peer: MLX's send tries the right socket
    # first and recv the left one first, so this pairs one connection per direction.
    sent = mx.distributed.send(mx.array([rank], dtype=mx.int32), right, stream=mx.cpu)
    got = mx.distributed.recv((1,), mx.int32, left, stream=mx.cpu)
    # Evaluated one at a time: mx.eval(sent, got) may run the recv first on every rank,
    # and a ring of ranks all waiting to receive hangs (seen with 3 ranks). Rank 0 receives
    # first and the others send first, so the ring unwinds even if a send had to wait.
    for step in (got, sent) if rank == 0 else (sent, got):
        mx.eval(step)
    sums = total.tolist()
    expected_sum = size * (size + 1) // 2
    received = int(got.item())
    return {
        "rank": rank,
        "size": size,
        "all_sum": sums[0],
        "expected_sum": expected_sum,
        "received": received,
        "left": left,
        "ok": all(s == expected_sum for s in sums) and received == left,
    }


def drain(group: mx.distributed.Group) -> None:
    """Finish every pending operation, then a barrier: a rank that exits with work in
    flight closes its sockets under its neighbours ("connection to a peer was lost")."""
    mx.synchronize()
    mx.synchronize(mx.cpu)
    mx.eval(mx.distributed.all_sum(mx.ones((group.size(),)), stream=mx.cpu))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pmesh.worker.ring_check", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="kill this rank after S seconds")
    args = parser.parse_args(argv)
    # A C-level watchdog: it fires even while MLX blocks in native code, and stays armed
    # through interpreter shutdown (MLX closes its sockets at exit).
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    rank_s = os.environ.get("MLX_RANK", "?")
    try:
        _, size = read_env()
    except EnvError as e:
        print(f"ring_check rank {rank_s}: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        # init() once per process: MLX caches the group; a second call returns the same one.
        group = mx.distributed.init(backend="ring", strict=True)
        result = check(group, size)
        print(json.dumps(result, sort_keys=True), flush=True)
        drain(group)
    except Exception as e:  # noqa: BLE001 - a health check reports any failure, whatever MLX raised
        print(f"ring_check rank {rank_s}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if not result["ok"]:
        print(f"ring_check rank {rank_s}: wrong results {result}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
