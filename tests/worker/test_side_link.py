"""The side channel (worker/side_link.py) over real loopback sockets, in one process: a head
accepts its members and the previous head by their hello and refuses a stray connection;
a step's frame (activation or token ids) goes head -> next head and is passed on, as
received, to the next head's members; tokens go back; a bad magic, an oversized length or a
closed peer is a PipelineError. And the plan options (worker/group_plan.py)."""
from __future__ import annotations

import struct
import threading
import time

import mlx.core as mx
import pytest

from p2pmesh.worker.group_plan import parse_plan, side_addrs
from p2pmesh.worker.pipeline import DTYPE_IDS, OP_DECODE, OP_PREFILL, Header, PipelineError, WireRow
from p2pmesh.worker.side_link import ENVELOPE, MAX_MESSAGE, SIDE_MAGIC, Side, SideError, connect_retry, open_side
from tests.worker.test_mlx_ring import free_port_run

HIDDEN = 16


def open_all(sizes: list[int], stray: bool = False) -> list[Side]:
    """Every rank's side channel of a plan of `sizes` (each group's layers [g, g+1)),
    opened in threads as separate processes would."""
    stages = [(g, g + 1) for g, n in enumerate(sizes) for _ in range(n)]
    plan = parse_plan(stages, str(sizes), None)
    base = free_port_run(len(sizes))
    addr = [f"127.0.0.1:{base + g}" for g in range(len(sizes))]
    out: list[Side | BaseException | None] = [None] * len(stages)
    deadline = time.monotonic() + 20

    def run(rank: int) -> None:
        role = plan.role(rank)
        try:
            opts = side_addrs(plan, role, f'["{addr[role.group]}"]', addr[(role.group + 1) % len(sizes)], addr[role.group])
            out[rank] = open_side(plan, role, opts, None, deadline)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stages))]
    for r, t in enumerate(threads):
        if not (stray and r == 1):
            t.start()
    if stray:  # dials group 0's head while it still waits for rank 1, and says nothing useful
        s = connect_retry(("127.0.0.1", base), time.monotonic() + 10, "group 0's head")
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        s.settimeout(10)
        try:
            assert s.recv(1) == b""  # refused: closed
        except ConnectionResetError:  # closed with our bytes unread
            pass
        s.close()
        threads[1].start()
    for t in threads:
        t.join(30)
    assert all(isinstance(s, Side) for s in out), out
    return out  # type: ignore[return-value]


def test_a_hybrid_step_goes_down_the_heads_and_to_every_member() -> None:
    sides = open_all([2, 2], stray=True)
    rank0, rank1, head1, rank3 = sides
    assert rank0.link is not None and rank0.fan is not None and rank1.link is not None
    assert head1.link is not None and head1.fan is None and rank3.link is not None
    rows = [WireRow(7, 3, 2, 0.5, 0.75, 1 << 40)]  # float32-exact values
    ids = mx.array([[5, 6, 7]], dtype=mx.int32)
    rank0.fan.send_frame(Header(OP_PREFILL, 1, 3, DTYPE_IDS), rows, ids)  # group 0's members get the ids
    h, got_rows, x = rank1.link.recv_frame(HIDDEN)
    assert (h.op, got_rows, x.tolist()) == (OP_PREFILL, rows, [[5, 6, 7]])
    act = mx.arange(3 * HIDDEN, dtype=mx.float32).reshape(1, 3, HIDDEN).astype(mx.bfloat16)
    rank0.link.send_frame(Header(OP_PREFILL, 1, 3, 3), rows, act)
    for link in (head1.link, rank3.link):  # the next head, and its member through it
        h, got_rows, x = link.recv_frame(HIDDEN)
        assert h.op == OP_PREFILL and got_rows == rows and x.dtype == mx.bfloat16 and mx.array_equal(x, act).item()
    head1.link.send(mx.array([42], dtype=mx.int32))
    assert rank0.link.recv((1,), mx.int32).tolist() == [42]
    with pytest.raises(PipelineError):  # the payload is not what the header says
        head1.link.send(mx.array([1, 2], dtype=mx.int32))
        rank0.link.recv((1,), mx.int32)


def test_bad_messages_and_a_closed_peer_are_pipeline_errors() -> None:
    for bad, words in [(ENVELOPE.pack(SIDE_MAGIC ^ 1, 2, 0), "magic"),
                       (ENVELOPE.pack(SIDE_MAGIC, 2, MAX_MESSAGE + 1), "more than"),
                       (ENVELOPE.pack(SIDE_MAGIC, 3, 0), "kind"),
                       (ENVELOPE.pack(SIDE_MAGIC, 2, 32) + struct.pack("!8i", *range(8)), "header")]:
        rank0, rank1 = open_all([2])
        assert rank0.fan is not None and rank1.link is not None
        rank0.fan.socks[0].sendall(bad)
        with pytest.raises(PipelineError, match=words):
            rank1.link.recv_frame(HIDDEN)
    rank0.fan.socks[0].close()  # the head is gone: its member hears it at once
    with pytest.raises(SideError, match="closed"):
        rank1.link.recv_frame(HIDDEN)
    rank0, rank1 = open_all([2])
    assert rank0.fan is not None and rank1.link is not None
    rank1.link.up.close()  # the member is gone: the head's sends fail within a few
    with pytest.raises(SideError):
        for _ in range(50):
            rank0.fan.send_frame(Header(OP_DECODE, 1, 1, 1), [WireRow(1, 0)], mx.zeros((1, 1, HIDDEN)))
            time.sleep(0.01)


def test_nobody_there_fails_by_the_deadline() -> None:
    plan = parse_plan([(0, 1), (0, 1)], "[2]", None)
    role = plan.role(1)
    port = free_port_run(1)
    t0 = time.monotonic()
    with pytest.raises(SideError, match="cannot reach"):
        open_side(plan, role, side_addrs(plan, role, None, None, f"127.0.0.1:{port}"), None, time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 5
