"""Fuzz target: frames. The transport's length-prefix reader (drivers/transport.py) and the
wire codec's decoder (core/wire.py), fed bytes no correct peer sends.

- The reader splits a TCP byte stream into frames: whatever the chunking, it delivers
  exactly the complete frames in order, drops a frame cut by the end of the stream, and
  refuses a length prefix over FRAME_BYTES_MAX as soon as the prefix arrives (it never
  reads, let alone buffers, the announced body).
- The decoder turns a body into a registered value or raises RemoteProtocolError, nothing
  else, within a bounded time, for arbitrary bytes, real frames mutated byte by byte,
  msgpack containers announcing huge sizes, and deep nesting.

Structure-level mutations (a wrong type in each field) are in tests/core/test_wire.py and
tests/fuzz/test_messages.py.
"""
from __future__ import annotations

import math
import random
import struct
import time
from typing import Any

import trio
from hypothesis import example, given
from hypothesis import strategies as st

from p2pmesh.core import wire
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import FrameReceived, Input
from p2pmesh.drivers.transport import Transport
from tests.core.test_wire import ALL_EXAMPLES
from tests.fuzz import fuzz_settings, tally

PEER = NodeId("ab" * 16)
DECODE_S_MAX = 2.0
"""A generous bound on one decode (it takes microseconds); a hang or a quadratic blow-up
would exceed it. The machine running this may be busy, hence the slack."""
_LEN = struct.Struct(">I")


# --------------------------------------------------------------------------------------
# The length-prefix reader


class _Stream:
    """A received byte stream, in the chunks the test chose; remembers how far it was read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.taken = 0

    async def receive_some(self, max_bytes: int) -> bytes:
        assert max_bytes <= 65536  # the reader's own bound on one read
        if self.taken == len(self.chunks):
            return b""
        self.taken += 1
        return self.chunks[self.taken - 1]


class _Conn:
    def __init__(self, stream: _Stream) -> None:
        self.peer = PEER
        self.stream = stream


def _chunk(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


async def _read(chunks: list[bytes]) -> tuple[list[bytes], BaseException | None, _Stream]:
    send, receive = trio.open_memory_channel[Input](math.inf)
    transport = Transport(me=NodeId("cd" * 16), server_ctx=None, client_ctx=None, inbox=send,  # type: ignore[arg-type]
                          rng=random.Random(0))
    stream = _Stream(chunks)
    error: BaseException | None = None
    with trio.fail_after(5):
        try:
            await transport._reader(_Conn(stream))  # type: ignore[arg-type]
        except RemoteProtocolError as exc:
            error = exc
    send.close()
    frames = []
    async for event in receive:
        assert isinstance(event, FrameReceived) and event.peer == PEER
        frames.append(event.data)
    return frames, error, stream


_bodies = st.lists(st.binary(max_size=300), max_size=8)
_tails = st.one_of(
    st.just(("none", b"")),
    st.tuples(st.just("torn"), st.binary(max_size=40)),  # a prefix promising more than follows
    st.tuples(st.just("oversized"), st.integers(wire.FRAME_BYTES_MAX + 1, 2**32 - 1).map(_LEN.pack)),
    st.tuples(st.just("short-prefix"), st.binary(min_size=1, max_size=3)),  # not even 4 bytes left
)


@fuzz_settings()
@given(bodies=_bodies, tail=_tails, cuts=st.lists(st.integers(0, 10_000), max_size=12))
@example(bodies=[b"x"], tail=("oversized", _LEN.pack(wire.FRAME_BYTES_MAX + 1)), cuts=[])
@example(bodies=[], tail=("oversized", b"\xff\xff\xff\xff"), cuts=[1, 2, 3])
def test_the_reader_delivers_exactly_the_complete_frames(bodies: list[bytes], tail: tuple[str, bytes],
                                                         cuts: list[int]) -> None:
    kind, extra = tail
    stream = b"".join(_LEN.pack(len(b)) + b for b in bodies)
    if kind == "torn":
        extra = _LEN.pack(len(extra) + 1 + len(extra) % 7) + extra
    elif kind == "oversized":
        extra = extra + b"\x00" * 100  # the announced body starts; the reader must not wait for it
    data = stream + extra
    chunks = _chunk(data, cuts)
    frames, error, reader_stream = trio.run(_read, chunks)
    assert frames == bodies  # in order, whole, and nothing made of the tail
    if kind == "oversized":
        assert isinstance(error, RemoteProtocolError) and "frame of" in str(error)
        # Refused on the chunk that completed the prefix: later chunks were never read.
        prefix_end = len(stream) + 4
        consumed = 0
        for i, c in enumerate(chunks):
            consumed += len(c)
            if consumed >= prefix_end:
                assert reader_stream.taken == i + 1
                break
        tally("reader", "refused")
    else:
        assert error is None and reader_stream.taken == len(chunks)
        tally("reader", "accepted")


# --------------------------------------------------------------------------------------
# The decoder

FRAMES = [wire.encode(m) for m in ALL_EXAMPLES]
"""A real frame of every registered type (tests/core/test_wire.py checks the list is complete)."""


@st.composite
def _mutated_frame(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "set", "insert", "delete", "truncate", "splice", "repeat")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from((0x00, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xC2, 0xC3, 0xCF, 0xD3, 0xDC,
                                              0xDD, 0xDE, 0xDF, 0xFF, draw(st.integers(0, 255)))))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "splice":
            other = draw(st.sampled_from(FRAMES))
            data[pos:] = other[draw(st.integers(0, len(other))):]
        elif op == "repeat":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 16))]
    return bytes(data)


# msgpack container headers that announce far more than follows (or than any limit allows).
_HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 2**32-1 items
    b"\xdc\xff\xff",  # array16 of 65535 items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
]


@st.composite
def _huge_announcement(draw: st.DrawFn) -> bytes:
    frame = draw(st.sampled_from(FRAMES))
    pos = draw(st.integers(0, len(frame)))
    return frame[:pos] + draw(st.sampled_from(_HUGE_HEADERS)) + draw(st.binary(max_size=32))


@st.composite
def _deep_nesting(draw: st.DrawFn) -> bytes:
    depth = draw(st.one_of(st.integers(1, 600), st.integers(10_000, 200_000)))
    opener = draw(st.sampled_from((b"\x91", b"\x92\x01", b"\x81\xa1k", b"\x93\x01\x1f")))
    closer = draw(st.sampled_from((b"\x90", b"\x80", b"\xc0", b"")))
    return b"\x93\x01\x12" + opener * depth + closer


_bodies_to_decode = st.one_of(
    st.binary(max_size=2048),
    _mutated_frame(),
    _huge_announcement(),
    _deep_nesting(),
)


def decode_checked(data: bytes) -> Any:
    """Decode ``data``; returns the value, or None when refused with RemoteProtocolError."""
    start = time.monotonic()
    try:
        value = wire.decode(data)
    except RemoteProtocolError as exc:
        assert str(exc)  # a refusal says why
        value = None
    assert time.monotonic() - start < DECODE_S_MAX
    return value


@fuzz_settings(default=400)
@given(_bodies_to_decode)
@example(b"\x91" * 100_000 + b"\x90")
@example(b"\x93\x01\x12" + b"\xdd\xff\xff\xff\xff")
@example(wire.encode(ALL_EXAMPLES[0]) + b"\x00")
def test_the_decoder_returns_a_value_or_refuses(data: bytes) -> None:
    value = decode_checked(data)
    if value is None:
        tally("decoder", "refused")
        return
    # Accepted: a registered value that encodes back to a frame decoding to the same value
    # (compared as bytes: a float field may hold NaN, which equals nothing).
    assert type(value) in wire._tag_of
    again = wire.encode(value)
    assert wire.encode(wire.decode(again)) == again
    tally("decoder", "accepted")
