"""Pipeline-parallel, batched generation along the MLX ring: one stage (a layer range) per rank.

Owns what travels between ranks over mx.distributed, the KV caches every stage keeps per
request, rank 0's `Engine` (runs the scheduler's steps, worker/scheduler.py) and the loop
the other ranks run (`serve_stage`).

Roles. Rank r holds stage r; rank 0 holds the first layers (and the embeddings), rank n-1
the last (final norm, head, sampling). Activations go to the right neighbour (r -> r+1);
the last rank sends the sampled tokens to its right neighbour, rank 0. So every rank only
sends right and receives from the left, the ring's two natural directions.

Messages (all on the CPU stream, each evaluated on its own: evaluating a send and a recv
together may run the recv first on every rank and hang the ring). A step travels as one
frame: `Link.frame` bytes (frame_bytes(hidden), the same on every rank), then, only when
its payload does not fit, one more message with the rest. A decode step of up to
FRAME_ROWS rows fits, so it costs one message per hop (PMP2 sent three: header, rows,
activation; each a wake-up, a thread hand-off and an eval on both sides). A frame holds:
  1. a header, int32[HEADER_WORDS] = [MAGIC, op, rows R, length L, dtype code, group,
     payload bytes, 0]
     op PREFILL (a chunk of one request's prompt, R = 1), DECODE (one token for each of
     the R requests of decode group `group`, L = 1), RELEASE (forget R requests) or SHUTDOWN;
  2. the payload: for PREFILL/DECODE/RELEASE the rows, int32[R * ROW_WORDS], one per request:
       [request number, position, flags, temperature bits (float32), top_p bits (float32),
        key seed low 32, key seed high 32, 0]
     flags FIRST (PREFILL: the request's caches start empty) and SAMPLE (sample the row's
     last position); position = tokens already in the request's caches (each stage checks:
     a mismatch means the pipeline lost sync and the worker exits); then for PREFILL/DECODE
     the activation [R, L, hidden] in the dtype the header names (its bytes as they are);
  3. zero padding up to the frame size.
When any row samples, the last rank sends int32[number of sampled rows] to rank 0.
SHUTDOWN goes once around the ring (0 -> 1 -> ... -> n-1 -> 0), so when rank 0 gets it
back every rank has left its loop; then all drain (synchronize, barrier all_sum) and exit.

Tensor plans (worker/side_link.py). The stages are then tensor groups; a `SideLink` (TCP)
takes the place of `Link` between the groups' first ranks (heads), with the same frames.
Every step a head runs goes first, as a frame, to the other ranks of its group (rank 0
sends its token ids, dtype code DTYPE_IDS, [R, L]; another head passes on the frame it
received), which run it in the same order on their share (`serve_member`): the sharded
layers all-sum over the group. Only the head passes the result on.

Caches. Every stage keeps, per request, its own KV caches while it prefills (`solo`), and
one batched cache per decode group (mlx-lm's BatchKVCache: left-padded rows; a group that
has only ever had one request keeps that request's plain caches). A DECODE
step lists the group's requests in order: the ones the stage already has first, then the
newcomers, whose prefill caches are merged into the group (BatchKVCache.merge / extend);
RELEASE filters rows out. So all stages hold the same groups as rank 0 decides them, and
several groups (micro-batches) can be in flight along the ring at once, FIFO at every hop.
With --kv-bits a request's caches become quantized ones as they grow (worker/kv_cache.py);
those have no batched form, so rank 0 then serves one request at a time.
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from p2pmesh.worker.kv_cache import KVQuant, batchable, quantized
from p2pmesh.worker.model import Shard
from p2pmesh.worker.ring_wake import wait_readable
from p2pmesh.worker.sampling import sample, step_key_seed
from p2pmesh.core.batching import PrefillStep, ReleaseStep, Row, Step

PREFILL_CHUNK = 128
HEADER_WORDS = 8
ROW_WORDS = 8
HEADER_BYTES, ROW_BYTES = 4 * HEADER_WORDS, 4 * ROW_WORDS
MAGIC = 0x504D5033  # "PMP3": one frame per step (PMP2 sent header, rows, activation apart)
FRAME_ROWS = 8
"""A decode step of this many rows (float32 activations) fits in one frame."""
FRAME_ALIGN = 4096
FRAME_MAX = 256 << 10
"""Every frame is sent whole, so a large model's frame stays bounded: its decode steps
then take two messages, as a prefill chunk does."""
OP_PREFILL, OP_DECODE, OP_SHUTDOWN, OP_RELEASE = 1, 2, 3, 4
FLAG_FIRST, FLAG_SAMPLE = 1, 2
DTYPE_IDS = 4
"""The payload is token ids [R, L] (no hidden axis): what rank 0 fans out to the other
ranks of its tensor group (worker/side_link.py); never on the MLX ring."""
DTYPES: dict[int, Any] = {1: mx.float32, 2: mx.float16, 3: mx.bfloat16, DTYPE_IDS: mx.int32}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class PipelineError(Exception):
    """The ranks disagree (bad magic, unexpected op, cache position mismatch, unknown
    request): the pipeline is out of sync and this epoch's workers must be restarted."""


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    rows: int = 0
    length: int = 0
    dtype: int = 1
    group: int = 0
    payload: int = 0
    """Bytes after the header: the rows, then the activation."""

    def encode(self) -> mx.array:
        return mx.array([_signed(MAGIC), self.op, self.rows, self.length, self.dtype, self.group, self.payload, 0],
                        dtype=mx.int32)

    @classmethod
    def decode(cls, arr: mx.array) -> Header:
        w = [int(x) for x in arr.tolist()]
        if len(w) != HEADER_WORDS or w[0] != _signed(MAGIC):
            raise PipelineError(f"bad pipeline header {w}: ranks out of sync")
        h = cls(w[1], w[2], w[3], w[4], w[5], w[6])
        ok = h.payload >= 0 and (h.op == OP_SHUTDOWN or (h.op == OP_RELEASE and h.rows >= 1) or (
            h.op in (OP_PREFILL, OP_DECODE) and h.rows >= 1 and h.length >= 1 and h.dtype in DTYPES
            and (h.op == OP_DECODE or h.rows == 1)))
        if not ok:
            raise PipelineError(f"bad pipeline header {h}")
        return h


@dataclass(frozen=True, slots=True)
class WireRow:
    """A row as every stage sees it: no token ids (only rank 0 has those)."""

    no: int
    position: int
    flags: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    key_seed: int = 0

    @property
    def sample(self) -> bool:
        return bool(self.flags & FLAG_SAMPLE)

    @classmethod
    def of(cls, row: Row, first: bool = False) -> WireRow:
        s = row.sampling
        flags = (FLAG_FIRST if first else 0) | (FLAG_SAMPLE if row.sample else 0)
        return cls(row.no, row.position, flags, s.temperature, s.top_p, step_key_seed(s.seed, row.position + len(row.tokens)))


def encode_rows(rows: Sequence[WireRow]) -> mx.array:
    words: list[int] = []
    for r in rows:
        t = struct.unpack("<i", struct.pack("<f", r.temperature))[0]
        p = struct.unpack("<i", struct.pack("<f", r.top_p))[0]
        lo, hi = struct.unpack("<ii", struct.pack("<Q", r.key_seed & ((1 << 64) - 1)))
        words += [r.no, r.position, r.flags, t, p, lo, hi, 0]
    return mx.array(words, dtype=mx.int32)


def decode_rows(arr: mx.array) -> list[WireRow]:
    w = [int(x) for x in arr.tolist()]
    rows = []
    for i in range(0, len(w), ROW_WORDS):
        no, position, flags, t, p, lo, hi, _ = w[i : i + ROW_WORDS]
        temperature = struct.unpack("<f", struct.pack("<i", t))[0]
        top_p = struct.unpack("<f", struct.pack("<i", p))[0]
        rows.append(WireRow(no, position, flags, temperature, top_p, struct.unpack("<Q", struct.pack("<ii", lo, hi))[0]))
    return rows


def frame_bytes(hidden: int) -> int:
    """The frame size for a model of this hidden size (see the module comment)."""
    need = HEADER_BYTES + FRAME_ROWS * (ROW_BYTES + 4 * hidden)
    return min(FRAME_MAX, -(-need // FRAME_ALIGN) * FRAME_ALIGN)


def _signed(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def encode_frame(h: Header, rows: Sequence[WireRow] = (), x: mx.array | None = None, pad_to: int = 0) -> mx.array:
    """A step as bytes (uint8): the header, with its payload size, then the rows and the
    activation (or token ids), zero-padded up to `pad_to` bytes if it is shorter."""
    parts = [encode_rows(rows).view(mx.uint8)] if rows else []
    if x is not None:
        parts.append(x.reshape(-1).view(mx.uint8))
    payload = sum(p.size for p in parts)
    head = Header(h.op, h.rows, h.length, h.dtype, h.group, payload).encode().view(mx.uint8)
    pad = pad_to - HEADER_BYTES - payload
    if pad > 0:
        parts.append(mx.zeros((pad,), mx.uint8))
    return mx.concatenate([head, *parts]) if parts else head


def _payload_shape(h: Header, hidden: int) -> tuple[int, ...] | None:
    if h.op not in (OP_PREFILL, OP_DECODE):
        return None
    return (h.rows, h.length) if h.dtype == DTYPE_IDS else (h.rows, h.length, hidden)


def frame_end(h: Header, hidden: int) -> int:
    """Bytes of the frame's header and payload; PipelineError when the header's payload size
    is not what its rows and activation take (the ranks are out of sync)."""
    shape = _payload_shape(h, hidden)
    width = 0 if shape is None else DTYPES[h.dtype].size * _product(shape)
    if h.payload != h.rows * ROW_BYTES + width:
        raise PipelineError(f"frame {h} carries {h.payload} bytes, its rows and activation take {h.rows * ROW_BYTES + width}")
    return HEADER_BYTES + h.payload


def decode_body(h: Header, buf: mx.array, hidden: int) -> tuple[Header, list[WireRow], mx.array | None]:
    """The rows and the activation (or token ids) of a frame whose header is `h` (checked by
    frame_end): buf holds at least frame_end(h) bytes."""
    end = frame_end(h, hidden)
    shape = _payload_shape(h, hidden)
    rows = decode_rows(buf[HEADER_BYTES : HEADER_BYTES + h.rows * ROW_BYTES].view(mx.int32)) if h.rows else []
    x = None
    if shape is not None:
        x = buf[HEADER_BYTES + h.rows * ROW_BYTES : end].view(DTYPES[h.dtype]).reshape(shape)
    return h, rows, x


def _product(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Link:
    """This rank's two ring neighbours over an mx.distributed group. Every operation is
    evaluated before it returns (one at a time, on the CPU stream, where MLX's collectives
    live and clear of the Metal command-buffer watchdog). `wake`: the left sockets'
    fds (worker/ring_wake.py): a recv first sleeps until they are readable, instead of
    letting MLX's socket thread spin a core for the whole wait."""

    def __init__(self, group: Any, hidden: int, wake: Sequence[int] = ()) -> None:
        self.group = group
        self.frame = frame_bytes(hidden)
        self.wake = tuple(wake)
        self.rank, self.size = group.rank(), group.size()
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def send(self, x: mx.array) -> None:
        mx.eval(mx.distributed.send(x, self.right, group=self.group, stream=mx.cpu))

    def recv(self, shape: Sequence[int], dtype: Any) -> mx.array:
        wait_readable(self.wake)
        got = mx.distributed.recv(tuple(shape), dtype, self.left, group=self.group, stream=mx.cpu)
        mx.eval(got)
        return got

    def send_frame(self, h: Header, rows: Sequence[WireRow] = (), x: mx.array | None = None) -> None:
        """One step to the right neighbour: a frame, and the rest of its payload if any."""
        body = encode_frame(h, rows, x, self.frame)
        if body.size == self.frame:
            self.send(body)
        else:
            self.send(body[: self.frame])
            self.send(body[self.frame :])

    def recv_frame(self, hidden: int) -> tuple[Header, list[WireRow], mx.array | None]:
        """The left neighbour's next step: its header, rows and activation [R, L, hidden]
        (None for RELEASE and SHUTDOWN)."""
        buf = self.recv((self.frame,), mx.uint8)
        h = Header.decode(buf[:HEADER_BYTES].view(mx.int32))
        end = frame_end(h, hidden)
        if end > self.frame:
            buf = mx.concatenate([buf, self.recv((end - self.frame,), mx.uint8)])
        return decode_body(h, buf, hidden)

    def drain(self) -> None:
        """Finish pending work, then a barrier, so no rank closes its sockets while a
        neighbour still has an operation in flight."""
        mx.synchronize()
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=self.group, stream=mx.cpu))


@dataclass
class _Solo:
    cache: list[Any]
    position: int = 0


@dataclass
class _Group:
    nos: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    cache: list[Any] | None = None


class Stage:
    """A shard and its KV caches: one per request while it prefills, one batched cache per
    decode group afterwards (see the module comment)."""

    def __init__(self, shard: Shard, quant: KVQuant | None = None) -> None:
        self.shard = shard
        self.quant = quant
        """load --kv-bits: caches switch to quantized ones as they grow (worker/kv_cache.py)."""
        self.solo: dict[int, _Solo] = {}
        self.groups: dict[int, _Group] = {}

    def _where(self) -> str:
        return f"stage {self.shard.start}-{self.shard.end}"

    def prefill(self, row: WireRow, x: mx.array) -> mx.array:
        if row.flags & FLAG_FIRST:
            if row.no in self.solo or any(row.no in g.nos for g in self.groups.values()):
                raise PipelineError(f"{self._where()}: request {row.no} starts again")
            self.solo[row.no] = _Solo(self.shard.make_cache())
        s = self.solo.get(row.no)
        if s is None or s.position != row.position:
            held = None if s is None else s.position
            raise PipelineError(f"{self._where()}: request {row.no} holds {held} tokens, header says {row.position}")
        out = self.shard.forward(x, s.cache, last_only=True)
        s.cache = quantized(s.cache, self.quant)
        # Compute before any communication: a send never waits on a long compute graph.
        mx.eval(out, [c.state for c in s.cache])
        s.position += x.shape[1]
        return out

    def decode(self, group: int, rows: Sequence[WireRow], x: mx.array) -> mx.array:
        g = self.groups.setdefault(group, _Group())
        k = len(g.nos)
        if [r.no for r in rows[:k]] != g.nos:
            raise PipelineError(f"{self._where()}: group {group} holds {g.nos}, the step lists {[r.no for r in rows]}")
        newcomers = list(rows[k:])
        if newcomers:
            self._join(g, newcomers)
        if [r.position for r in rows] != g.positions:
            raise PipelineError(f"{self._where()}: group {group} positions {g.positions}, the step says {[r.position for r in rows]}")
        assert g.cache is not None
        out = self.shard.forward(x, g.cache, last_only=True)
        g.cache = quantized(g.cache, self.quant)
        mx.eval(out, [c.state for c in g.cache])
        g.positions = [p + 1 for p in g.positions]
        return out

    def _join(self, g: _Group, rows: Sequence[WireRow]) -> None:
        solos = []
        for r in rows:
            s = self.solo.pop(r.no, None)
            if s is None:
                raise PipelineError(f"{self._where()}: request {r.no} joins a group without a prefill")
            solos.append(s)
        held = [g.cache] if g.cache is not None else []
        if len(held) + len(solos) > 1 and not all(batchable(c) for c in (*held, *(s.cache for s in solos))):
            raise PipelineError(f"{self._where()}: quantized KV caches (kv_bits) cannot be batched: one request at a time")
        if g.cache is None and len(solos) == 1:
            # A group of one keeps the request's own caches: single-stream decoding runs
            # exactly as unbatched (no padding mask, scalar RoPE offsets), at full speed.
            g.cache = solos[0].cache
        elif g.cache is not None and not hasattr(g.cache[0], "extend"):
            g.cache = [type(layer[0]).merge(list(layer)) for layer in zip(g.cache, *(s.cache for s in solos))]
        else:
            merged = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in solos))]
            if g.cache is None:
                g.cache = merged
            else:
                for mine, theirs in zip(g.cache, merged):
                    mine.extend(theirs)
        g.nos += [r.no for r in rows]
        g.positions += [s.position for s in solos]

    def release(self, nos: Sequence[int]) -> None:
        gone = set(nos)
        for no in gone:
            self.solo.pop(no, None)
        for gid, g in list(self.groups.items()):
            keep = [i for i, no in enumerate(g.nos) if no not in gone]
            if len(keep) == len(g.nos):
                continue
            if not keep:
                del self.groups[gid]
                continue
            assert g.cache is not None
            for c in g.cache:
                c.filter(keep)
            g.nos = [g.nos[i] for i in keep]
            g.positions = [g.positions[i] for i in keep]

    @property
    def requests(self) -> int:
        return len(self.solo) + sum(len(g.nos) for g in self.groups.values())


def sample_rows(logits: mx.array, rows: Sequence[WireRow]) -> list[int]:
    """One token per sampling row from logits [R, 1, vocab]: greedy rows in one argmax,
    the others with their own parameters and key (sampling.sample)."""
    picked = [i for i, r in enumerate(rows) if r.sample]
    if not picked:
        return []
    last = logits[:, -1, :]
    greedy = mx.argmax(last, axis=-1) if any(rows[i].temperature == 0 for i in picked) else None
    out = []
    for i in picked:
        r = rows[i]
        out.append(greedy[i] if r.temperature == 0 and greedy is not None else sample(last[i], r.temperature, r.top_p, r.key_seed))
    return [int(t) for t in mx.stack(out).tolist()]


def run_step(stage: Stage, h: Header, rows: Sequence[WireRow], x: mx.array) -> mx.array:
    """This stage's part of a PREFILL or DECODE step."""
    if h.op == OP_PREFILL:
        return stage.prefill(rows[0], x)
    return stage.decode(h.group, rows, x)


class Engine:
    """Rank 0: runs the scheduler's steps on the first stage and pushes them down the
    pipeline; the results (sampled tokens) come back from the last rank in the order the
    steps were sent. With one rank it samples itself. `submit` starts a step, `collect`
    returns the oldest started step and its tokens (waiting for them if needed).

    `link`: to the next stage (an MLX `Link`, or the side channel's `SideLink` between
    tensor groups), None when rank 0 holds the last layers. `fan`: the other ranks of rank
    0's tensor group (side_link.Fan), which get every step, with its token ids, before rank
    0 runs it: they run it too, in the same order (the sharded layers all-sum over them)."""

    def __init__(self, stage: Stage, link: Any | None, fan: Any | None = None) -> None:
        if (link is None) != stage.shard.last:
            raise ValueError("rank 0 without a group must hold the whole model, and with one must not")
        self.stage, self.link, self.fan = stage, link, fan
        self.pending: deque[tuple[Step, int, list[int] | None]] = deque()

    def submit(self, step: Step) -> None:
        if isinstance(step, ReleaseStep):
            if self.fan is not None:
                self.fan.send_frame(Header(OP_RELEASE, len(step.nos)), [WireRow(no, 0) for no in step.nos])
            self.stage.release(step.nos)
            if self.link is not None:
                self.link.send_frame(Header(OP_RELEASE, len(step.nos)), [WireRow(no, 0) for no in step.nos])
            self.pending.append((step, 0, []))
            return
        if isinstance(step, PrefillStep):
            rows, group, op = [WireRow.of(step.row, step.first)], 0, OP_PREFILL
            ids = [list(step.row.tokens)]
        else:
            rows, group, op = [WireRow.of(r) for r in step.rows], step.group, OP_DECODE
            ids = [list(r.tokens) for r in step.rows]
        h = Header(op, len(rows), len(ids[0]), 1, group)
        x = mx.array(ids, dtype=mx.int32)
        if self.fan is not None:
            self.fan.send_frame(Header(op, len(rows), len(ids[0]), DTYPE_IDS, group), rows, x)
        out = run_step(self.stage, h, rows, x)
        if self.link is None:
            self.pending.append((step, 0, sample_rows(out, rows)))
            return
        self.link.send_frame(Header(op, len(rows), len(ids[0]), DTYPE_CODES[out.dtype], group), rows, out)
        sampled = sum(1 for r in rows if r.sample)
        self.pending.append((step, sampled, None if sampled else []))

    def collect(self) -> tuple[Step, list[int]]:
        step, sampled, tokens = self.pending.popleft()
        if tokens is None:
            assert self.link is not None
            tokens = [int(t) for t in self.link.recv((sampled,), mx.int32).tolist()]
        return step, tokens

    def ready(self) -> bool:
        """The oldest pending step's result is known without waiting."""
        return bool(self.pending) and self.pending[0][2] is not None

    def shutdown(self) -> None:
        """Send SHUTDOWN around the ring (and to rank 0's tensor group) and wait for it to
        come back, then drain."""
        if self.fan is not None:
            self.fan.send_frame(Header(OP_SHUTDOWN))
        if self.link is None:
            if self.fan is not None:
                self.fan.drain()
            return
        self.link.send_frame(Header(OP_SHUTDOWN))
        back, _, _ = self.link.recv_frame(self.stage.shard.hidden_size)
        if back.op != OP_SHUTDOWN:
            raise PipelineError(f"expected SHUTDOWN back from rank {self.link.left}, got {back}")
        self.link.drain()


def serve_stage(stage: Stage, link: Link) -> None:
    """Ranks 1..n-1: run every step rank 0 sends until SHUTDOWN, then pass SHUTDOWN on
    (the last rank passes it to rank 0) and drain. Waits in MLX's recv while idle: the
    agent, which supervises the workers, kills a rank whose peer went silent."""
    last, hidden = stage.shard.last, stage.shard.hidden_size
    while True:
        h, rows, x = link.recv_frame(hidden)
        if h.op == OP_SHUTDOWN:
            link.send_frame(h)
            link.drain()
            return
        if h.op == OP_RELEASE:
            stage.release([r.no for r in rows])
            if not last:
                link.send_frame(h, rows)
            continue
        assert x is not None
        out = run_step(stage, h, rows, x)
        if not last:
            link.send_frame(Header(h.op, h.rows, h.length, DTYPE_CODES[out.dtype], h.group), rows, out)
        elif any(r.sample for r in rows):
            link.send(mx.array(sample_rows(out, rows), dtype=mx.int32))


def serve_member(stage: Stage, link: Any) -> None:
    """A tensor group's other ranks: run every step the group's head sends (side_link.SideLink,
    from the head), in its order, until SHUTDOWN, then drain. They send nothing: the head
    passes the group's result on (all ranks of a group compute the same hidden states and
    logits). Blocked in a socket recv while idle."""
    hidden = stage.shard.hidden_size
    while True:
        h, rows, x = link.recv_frame(hidden)
        if h.op == OP_SHUTDOWN:
            link.drain()
            return
        if h.op == OP_RELEASE:
            stage.release([r.no for r in rows])
            continue
        assert x is not None
        run_step(stage, h, rows, x)
