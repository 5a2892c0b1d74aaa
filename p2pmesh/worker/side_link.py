"""The side channel of a tensor plan (issue 16): plain TCP between the heads of the tensor
groups, and from each head to the other ranks (members) of its group.

Why not MLX: MLX's ring backend refuses Group.split and init() runs once per process, so
each tensor group is its own MLX group, and nothing in MLX joins one group's head to the
next group's. Members also wait here, blocked in the kernel in a socket recv, instead of
busy-polling a core in MLX's ring while another group computes.

Connections (worker/group_plan.py names the roles). Each head listens on its
`--side-listen` addresses; it dials the next group's head (`--side-next`; the last group's
head dials the first's: the sampled tokens go back), and each member dials its own head
(`--side-head`). Dialing is retried until the start-up deadline (the peer may start
later); a head listens before it dials and accepts after, so no start order deadlocks. The
first message on every connection is a HELLO naming the dialer's global rank and the
plan's rank count: one listener serves the previous head and the group's members, and a
stray connection (bad magic, a rank not expected here, twice the same rank, another plan's
size) is refused (closed, and said on stderr).

Messages: an envelope `!IIQ` = [SIDE_MAGIC, kind, length], then `length` bytes, at most
MAX_MESSAGE. Kinds: HELLO (int32 [rank, ranks]), FRAME (a pipeline step, as
pipeline.encode_frame lays it out, without padding: its own header, magic and size are
checked again), ARRAY (the sampled tokens, int32). Anything else, or a closed connection,
is a PipelineError: the epoch is over and the requests resume elsewhere.

`SideLink` has the surface of pipeline.Link (send_frame, recv_frame, send, recv, drain), so
pipeline.Engine and serve_stage run over it unchanged; a head's recv_frame first passes
the step on, as received, to its members (`Fan`), which run it too (pipeline.serve_member).
"""
from __future__ import annotations

import select
import socket
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from p2pmesh.worker.group_plan import Plan, Role, SideAddrs
from p2pmesh.worker.pipeline import HEADER_BYTES, Header, PipelineError, WireRow, decode_body, encode_frame, frame_end

SIDE_MAGIC = 0x504D5331  # "PMS1"
ENVELOPE = struct.Struct("!IIQ")
KIND_HELLO, KIND_FRAME, KIND_ARRAY = 1, 2, 3
HELLO = struct.Struct("!ii")
MAX_MESSAGE = 1 << 28
"""256 MiB: a prefill chunk of 128 tokens of a 65536-wide float32 model fits."""
HELLO_TIMEOUT_S = 5.0
"""A connection that does not say who it is within this time is refused."""
CONNECT_RETRY_S = 0.05


class SideError(PipelineError):
    """The side channel could not be set up, or a peer broke it."""


# Messages.

def read_exact(s: socket.socket, n: int, who: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:  # bounded: n bytes, or the peer closes
        try:
            k = s.recv_into(view[got:])
        except OSError as e:
            raise SideError(f"side channel to {who}: {e}") from None
        if not k:
            raise SideError(f"side channel: {who} closed the connection")
        got += k
    return bytes(buf)


def recv_message(s: socket.socket, kind: int, who: str) -> tuple[bytes, bytes]:
    """(envelope, payload) of the next message, which must be of `kind`."""
    env = read_exact(s, ENVELOPE.size, who)
    magic, got, length = ENVELOPE.unpack(env)
    if magic != SIDE_MAGIC:
        raise SideError(f"side channel: {who} sent magic {magic:#x}, not {SIDE_MAGIC:#x}: not a p2pmesh side message")
    if got != kind:
        raise SideError(f"side channel: {who} sent a message of kind {got}, expected {kind}: ranks out of sync")
    if length > MAX_MESSAGE:
        raise SideError(f"side channel: {who} announces {length} bytes, more than {MAX_MESSAGE}")
    return env, read_exact(s, length, who)


def send_bytes(socks: Iterable[socket.socket], data: bytes | Sequence[bytes], who: str) -> None:
    parts = [data] if isinstance(data, bytes) else list(data)
    for s in socks:
        try:
            s.sendall(b"".join(parts) if len(parts) > 1 else parts[0])
        except OSError as e:
            raise SideError(f"side channel to {who}: {e}") from None


def message(kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_MESSAGE:
        raise SideError(f"a side message of {len(payload)} bytes exceeds {MAX_MESSAGE}")
    return ENVELOPE.pack(SIDE_MAGIC, kind, len(payload)) + payload


def _array_bytes(x: mx.array) -> bytes:
    mx.eval(x)
    return bytes(memoryview(x))


def _as_array(payload: bytes) -> mx.array:
    return mx.array(np.frombuffer(payload, dtype=np.uint8))


class Fan:
    """A head's connections to the other ranks of its group: every step goes to each, in
    order. `group`: the tensor group's MLX group, for the final barrier."""

    def __init__(self, socks: Sequence[socket.socket], group: Any) -> None:
        self.socks, self.group = tuple(socks), group

    def send_frame(self, h: Header, rows: Sequence[WireRow] = (), x: mx.array | None = None) -> None:
        self.forward(message(KIND_FRAME, _array_bytes(encode_frame(h, rows, x))))

    def forward(self, data: bytes) -> None:
        send_bytes(self.socks, data, "a member of this tensor group")

    def drain(self) -> None:
        drain(self.group, self.socks)


def drain(group: Any, socks: Iterable[socket.socket | None]) -> None:
    """Finish pending work and barrier over the tensor group (no rank leaves while another
    is still in a collective), then close the side connections."""
    mx.synchronize()
    if group is not None:
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group, stream=mx.cpu))
    for s in socks:
        if s is not None:
            s.close()


class SideLink:
    """pipeline.Link's surface over the side channel: `down` to the next group's head, `up`
    from the previous one (a member: up from its own head, no down). `forward`: a head's
    Fan, to which every frame received is passed on before it is decoded. `left`: the
    global rank `up` comes from (for messages)."""

    def __init__(self, up: socket.socket, down: socket.socket | None, left: int, group: Any = None,
                 forward: Fan | None = None) -> None:
        self.up, self.down, self.left, self.group, self.fan = up, down, left, group, forward

    def _send(self, kind: int, payload: bytes) -> None:
        assert self.down is not None
        send_bytes([self.down], message(kind, payload), "the next group's head")

    def send_frame(self, h: Header, rows: Sequence[WireRow] = (), x: mx.array | None = None) -> None:
        self._send(KIND_FRAME, _array_bytes(encode_frame(h, rows, x)))

    def recv_frame(self, hidden: int) -> tuple[Header, list[WireRow], mx.array | None]:
        env, payload = recv_message(self.up, KIND_FRAME, f"rank {self.left}")
        if self.fan is not None:
            self.fan.forward(env + payload)
        if len(payload) < HEADER_BYTES:
            raise PipelineError(f"a side frame of {len(payload)} bytes from rank {self.left} has no header")
        buf = _as_array(payload)
        h = Header.decode(buf[:HEADER_BYTES].view(mx.int32))
        if frame_end(h, hidden) != len(payload):
            raise PipelineError(f"a side frame of {len(payload)} bytes from rank {self.left} says {frame_end(h, hidden)}")
        return decode_body(h, buf, hidden)

    def send(self, x: mx.array) -> None:
        self._send(KIND_ARRAY, _array_bytes(x))

    def recv(self, shape: Sequence[int], dtype: Any) -> mx.array:
        _, payload = recv_message(self.up, KIND_ARRAY, f"rank {self.left}")
        n = dtype.size
        for d in shape:
            n *= d
        if len(payload) != n:
            raise PipelineError(f"rank {self.left} sent {len(payload)} bytes, expected {tuple(shape)} {dtype}")
        return _as_array(payload).view(dtype).reshape(tuple(shape))

    def drain(self) -> None:
        drain(self.group, [self.up, self.down, *(self.fan.socks if self.fan is not None else ())])


# Setting up.

def _server(addr: tuple[str, int]) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    try:
        return socket.create_server(addr, family=family)
    except OSError as e:
        raise SideError(f"cannot listen for the side channel on {addr[0]}:{addr[1]}: {e}") from None


def connect_retry(addr: tuple[str, int], deadline: float, what: str) -> socket.socket:
    """A connected TCP socket (no delay, blocking), retried until the deadline."""
    while True:  # bounded by the deadline
        try:
            s = socket.create_connection(addr, timeout=max(0.1, min(HELLO_TIMEOUT_S, deadline - time.monotonic())))
        except OSError:
            if time.monotonic() >= deadline:
                raise SideError(f"cannot reach {what} at {addr[0]}:{addr[1]}") from None
            time.sleep(CONNECT_RETRY_S)
            continue
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(None)
        return s


def dial(addr: tuple[str, int], rank: int, ranks: int, deadline: float, what: str) -> socket.socket:
    s = connect_retry(addr, deadline, what)
    send_bytes([s], message(KIND_HELLO, HELLO.pack(rank, ranks)), what)
    return s


def _hello(conn: socket.socket, ranks: int, timeout: float) -> int:
    conn.settimeout(timeout)
    try:
        _, payload = recv_message(conn, KIND_HELLO, "a new connection")
    except (SideError, OSError) as e:
        raise SideError(f"no valid hello: {e}") from None
    if len(payload) != HELLO.size:
        raise SideError(f"a hello of {len(payload)} bytes")
    rank, theirs = HELLO.unpack(payload)
    if theirs != ranks:
        raise SideError(f"rank {rank} belongs to a plan of {theirs} ranks, this one has {ranks}")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(None)
    return rank


def accept(servers: Sequence[socket.socket], expected: set[int], ranks: int, deadline: float) -> dict[int, socket.socket]:
    """The connections of the `expected` global ranks, each known by its hello; any other
    connection is refused (closed, said on stderr)."""
    got: dict[int, socket.socket] = {}
    while len(got) < len(expected):  # bounded by the deadline
        left = deadline - time.monotonic()
        if left <= 0:
            raise SideError(f"ranks {sorted(expected - set(got))} never joined the side channel")
        readable, _, _ = select.select(list(servers), [], [], left)
        for server in readable:
            conn, peer = server.accept()
            try:
                rank = _hello(conn, ranks, min(HELLO_TIMEOUT_S, max(0.1, left)))
                if rank not in expected or rank in got:
                    raise SideError(f"rank {rank} is not expected here (expecting {sorted(expected - set(got))})")
            except SideError as e:
                print(f"serve: side channel: refused a connection from {peer}: {e}", file=sys.stderr, flush=True)
                conn.close()
                continue
            got[rank] = conn
    return got


@dataclass(frozen=True, slots=True)
class Side:
    """This rank's side channel: rank 0 gets `link` (None in a single group) and `fan`
    (None without members); another head `link` (forwarding to its members); a member
    `link` from its head."""

    link: SideLink | None
    fan: Fan | None


def open_side(plan: Plan, role: Role, addrs: SideAddrs, group: Any, deadline: float) -> Side:
    ranks = len(plan.stages)
    if not role.head:
        head = plan.first(role.group)
        up = dial(addrs.head if addrs.head is not None else ("", 0), role.rank, ranks, deadline, f"the head of group {role.group} (rank {head})")
        return Side(SideLink(up, None, head, group), None)
    servers = [_server(a) for a in addrs.listen]
    try:
        prev = plan.first((role.group - 1) % role.groups) if role.groups >= 2 else None
        down = None
        if role.groups >= 2:
            assert addrs.next is not None
            nxt = (role.group + 1) % role.groups
            down = dial(addrs.next, role.rank, ranks, deadline, f"the head of group {nxt} (rank {plan.first(nxt)})")
        members = plan.members(role.group)
        got = accept(servers, set(members) | ({prev} if prev is not None else set()), ranks, deadline)
    finally:
        for s in servers:
            s.close()
    fan = Fan([got[m] for m in members], group) if members else None
    if prev is None:
        return Side(None, fan)
    assert down is not None
    if role.rank == 0:
        return Side(SideLink(got[prev], down, prev, group), fan)
    return Side(SideLink(got[prev], down, prev, group, forward=fan), None)
