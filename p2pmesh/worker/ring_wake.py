"""Sleep, instead of spinning, until the left neighbour's next message arrives (ring backend).

MLX's ring backend runs one thread per socket that busy-polls a non-blocking recv for as
long as a recv is pending (mlx/distributed/ring/ring.cpp, SocketThread::worker): a rank
waiting for its next step keeps a core at 100% (docs/inference.md, "Known cost"). With
two ranks on two cores, or a Mac that also runs other work, the waiting ranks' pollers
take the cores the computing ranks need. So before each recv a rank waits in the kernel
(select) until one of its left sockets is readable, and only then asks MLX to receive:
the bytes are already there and MLX's poller finishes in a pass or two.

Which sockets: MLX rank r accepts its left neighbour's connections on its own hostfile
addresses, so its left sockets are the process's connected TCP sockets whose local
address is one of hostfile[r]'s (the right ones were dialled out from an ephemeral port).
Found once after the group formed, by file descriptor; select only looks at them (MLX
alone reads). Where they cannot be found (JACCL, a hostfile with names, another
platform) `left_sockets` returns () and the rank falls back to MLX's own wait.
"""
from __future__ import annotations

import ipaddress
import os
import select
import socket
import stat
from collections.abc import Sequence

MAX_FD_SCAN = 4096
"""File descriptors looked at when searching (a worker holds a few dozen)."""


def _address(entry: str) -> tuple[str | None, int] | None:
    """("ip", port) of a hostfile entry "ip:port" ("[v6]:port" too); ip None when it is
    not a literal address (then only the port is compared); None when unparseable."""
    host, _, port = entry.rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        return None, int(port)


def _local_connected(fd: int) -> tuple[str, int] | None:
    """The local (ip, port) of a connected TCP socket fd; None for anything else."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        s.getpeername()  # raises for the listening socket or one not connected
        local = s.getsockname()
        return str(ipaddress.ip_address(local[0].split("%")[0])), int(local[1])
    except (OSError, ValueError):
        return None
    finally:
        s.close()  # closes the duplicate only


def left_sockets(own: Sequence[str], fds: Sequence[int] | None = None) -> tuple[int, ...]:
    """The fds of this rank's left sockets: connected TCP sockets whose local address is one
    of ``own`` (this rank's hostfile entries). ``fds``: where to look (default: 0..MAX_FD_SCAN)."""
    wanted = [a for a in (_address(e) for e in own) if a is not None]
    if not wanted:
        return ()
    found = []
    for fd in fds if fds is not None else range(MAX_FD_SCAN):
        local = _local_connected(fd)
        if local is not None and any(port == local[1] and ip in (None, local[0]) for ip, port in wanted):
            found.append(fd)
    return tuple(found)


def wait_readable(fds: Sequence[int]) -> None:
    """Block (no CPU) until one of ``fds`` has bytes or EOF; at once when ``fds`` is empty.
    A peer that died makes the socket readable (EOF): MLX's recv then reports the loss."""
    if not fds:
        return
    if hasattr(select, "poll"):  # no FD_SETSIZE limit
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll()
    else:
        select.select(list(fds), [], [])
