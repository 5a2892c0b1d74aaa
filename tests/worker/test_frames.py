"""The pipeline's wire (pipeline.py, PMP3): a step travels as one fixed-size frame, plus one
message with the rest when its payload does not fit; every rank decodes exactly what was
sent. And ring_wake.py: a rank finds its left sockets by their local address and sleeps
until one is readable. In one process: a loop link stands for the ring (no MLX group)."""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from typing import Any

import mlx.core as mx
import pytest

from p2pmesh.worker.pipeline import (
    FRAME_MAX, OP_DECODE, OP_PREFILL, OP_RELEASE, OP_SHUTDOWN, DTYPE_CODES, Header, Link, PipelineError, WireRow,
    frame_bytes,
)
from p2pmesh.worker.ring_wake import left_sockets, wait_readable


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


class LoopLink(Link):
    """Sends go into a queue, recvs take from it and check the shape and dtype asked for:
    what MLX's recv needs the receiver to know in advance."""

    def __init__(self, hidden: int) -> None:
        super().__init__(_Group(), hidden)
        self.wire: deque[mx.array] = deque()
        self.messages = 0

    def send(self, x: mx.array) -> None:
        mx.eval(x)
        self.wire.append(x)
        self.messages += 1

    def recv(self, shape: Any, dtype: Any) -> mx.array:
        x = self.wire.popleft()
        assert tuple(x.shape) == tuple(shape) and x.dtype == dtype, (x.shape, x.dtype, shape, dtype)
        return x


def test_the_frame_fits_a_decode_step_of_eight_rows_and_stays_bounded() -> None:
    for hidden in (64, 192, 1024, 4096):
        size = frame_bytes(hidden)
        assert size % 4096 == 0 and size <= FRAME_MAX
        assert size >= 32 + 8 * (32 + 4 * hidden) or size == FRAME_MAX
    assert frame_bytes(8192) == FRAME_MAX


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_steps_round_trip_in_one_message_or_two(dtype: Any) -> None:
    hidden = 64
    link = LoopLink(hidden)
    rows = [WireRow(3, 17, 2, 0.7, 0.9, 2**64 - 3), WireRow(4, 5), WireRow(9, 0, 3)]
    decode_x = mx.random.normal((3, 1, hidden)).astype(dtype)
    prefill_x = mx.random.normal((1, 100, hidden)).astype(dtype)  # 100 x 64 values: more than a frame
    cases = [
        (Header(OP_DECODE, 3, 1, DTYPE_CODES[dtype], 1), rows, decode_x, 1),
        (Header(OP_PREFILL, 1, 100, DTYPE_CODES[dtype]), rows[:1], prefill_x, 2),
        (Header(OP_RELEASE, 3), rows, None, 1),
        (Header(OP_SHUTDOWN), [], None, 1),
    ]
    for h, rs, x, messages in cases:
        link.messages = 0
        link.send_frame(h, rs, x)
        assert link.messages == messages
        got_h, got_rows, got_x = link.recv_frame(hidden)
        assert not link.wire
        assert (got_h.op, got_h.rows, got_h.length, got_h.group) == (h.op, h.rows, h.length, h.group)
        assert [(r.no, r.position, r.flags, r.key_seed) for r in got_rows] == [(r.no, r.position, r.flags, r.key_seed) for r in rs]
        assert [r.temperature for r in got_rows] == [pytest.approx(r.temperature) for r in rs]
        if x is None:
            assert got_x is None
        else:
            assert got_x is not None and got_x.dtype == dtype and got_x.shape == x.shape
            assert mx.array_equal(got_x, x).item()


def test_a_frame_whose_payload_does_not_match_its_header_is_refused() -> None:
    link = LoopLink(64)
    link.send_frame(Header(OP_DECODE, 1, 1, DTYPE_CODES[mx.float32]), [WireRow(1, 0)], mx.zeros((1, 1, 64)))
    with pytest.raises(PipelineError, match="carries"):
        link.recv_frame(32)  # the receiver expects another hidden size: out of sync


def test_a_rank_finds_its_left_sockets_and_sleeps_until_one_is_readable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as dialled:  # what the left neighbour dials
            accepted, _ = listener.accept()
            with accepted:
                # The accepted socket only: the listener has no peer, the dialled one another local port.
                assert left_sockets([f"127.0.0.1:{port}"]) == (accepted.fileno(),)
                assert left_sockets([f"localhost:{port}"]) == (accepted.fileno(),)  # a name: the port alone
                assert left_sockets(["127.0.0.1:1"]) == ()
                assert left_sockets(["nonsense"]) == ()
                wait_readable(())  # nothing to wait on: returns at once

                woke = threading.Event()
                waiter = threading.Thread(target=lambda: (wait_readable((accepted.fileno(),)), woke.set()), daemon=True)
                waiter.start()
                time.sleep(0.2)
                assert not woke.is_set()  # no bytes yet: still asleep
                dialled.sendall(b"x")
                assert woke.wait(10)
                assert accepted.recv(1) == b"x"  # select only looked: the bytes are still there for MLX
