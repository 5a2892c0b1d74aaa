"""Reading exactly n bytes from a trio stream: what every small framed protocol of the
agent needs (probes, model files, pairing); the transport has its own buffered reader."""
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
