"""Small helpers for trio socket streams: reading exactly n bytes (what every small framed
protocol of the agent needs: probes, model files, pairing; the transport has its own
buffered reader) and naming the peer of a connection for logs and per-address limits."""
from __future__ import annotations

import trio

from p2pmesh.core.errors import RemoteProtocolError


async def recv_exactly(stream: trio.abc.ReceiveStream, n: int, *, idle_s: float | None = None) -> bytes:
    """Exactly n bytes; an end of stream before that is the peer's protocol violation. With
    ``idle_s``, each wait for more bytes is bounded (trio.TooSlowError)."""
    buf = bytearray()
    while len(buf) < n:
        with trio.fail_after(idle_s) if idle_s is not None else trio.CancelScope():
            chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise RemoteProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def remote_name(stream: trio.SocketStream) -> str:
    """The peer as "host:port" ("[host]:port" for IPv6, so the host is always what precedes
    the last colon); "?" when the socket has no peer any more."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
