"""Pipeline-parallel generation along the MLX ring: one stage (a layer range) per rank.

Owns what travels between ranks over mx.distributed and the loop each rank runs.

Roles. Rank r holds stage r; rank 0 holds the first layers (and the embeddings), rank n-1
the last (final norm, head, sampling). Activations go to the right neighbour (r -> r+1);
the last rank sends the sampled token to its right neighbour, rank 0. So every rank only
sends right and receives from the left, the ring's two natural directions.

Messages (all on the CPU stream, each evaluated on its own: evaluating a send and a recv
together may run the recv first on every rank and hang the ring):
  1. a header, int32[HEADER_WORDS]:
       [MAGIC, op, length L, flags, position, dtype code, temperature bits (float32),
        top_p bits (float32), key seed low 32 bits, key seed high 32 bits]
     op FORWARD (a prefill chunk, not sampled), SAMPLE (a chunk or one decoded token whose
     last position is sampled) or SHUTDOWN; flags FIRST = first chunk of a request (every
     stage resets its KV cache); position = tokens already in the caches (each stage
     checks it: a mismatch means the pipeline lost sync and the worker exits);
  2. for FORWARD/SAMPLE the activation [1, L, hidden] in the dtype the header names;
  3. after a SAMPLE, the last rank sends int32[1] = the token to rank 0.
SHUTDOWN goes once around the ring (0 -> 1 -> ... -> n-1 -> 0), so when rank 0 gets it
back every rank has left its loop; then all drain (synchronize, barrier all_sum) and exit.

Prefill is cut into chunks of at most `prefill_chunk` tokens (PREFILL_CHUNK): no hop ever
carries more than chunk x hidden values, and earlier chunks flow while rank 0 embeds the
next. Only the last chunk is sampled. One request at a time; rank 0 is the only driver.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from p2pmesh.worker.model import Shard
from p2pmesh.worker.sampling import SamplingParams, sample, step_key_seed

PREFILL_CHUNK = 128
HEADER_WORDS = 10
MAGIC = 0x504D5031  # "PMP1"
OP_FORWARD, OP_SAMPLE, OP_SHUTDOWN = 1, 2, 3
FLAG_FIRST = 1
DTYPES: dict[int, Any] = {1: mx.float32, 2: mx.float16, 3: mx.bfloat16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class PipelineError(Exception):
    """The ranks disagree (bad magic, unexpected op, cache position mismatch): the
    pipeline is out of sync and this epoch's workers must be restarted."""


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    length: int = 0
    flags: int = 0
    position: int = 0
    dtype: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    key_seed: int = 0

    def encode(self) -> mx.array:
        t = struct.unpack("<i", struct.pack("<f", self.temperature))[0]
        p = struct.unpack("<i", struct.pack("<f", self.top_p))[0]
        lo, hi = struct.unpack("<ii", struct.pack("<Q", self.key_seed & ((1 << 64) - 1)))
        words = [_signed(MAGIC), self.op, self.length, self.flags, self.position, self.dtype, t, p, lo, hi]
        return mx.array(words, dtype=mx.int32)

    @classmethod
    def decode(cls, arr: mx.array) -> Header:
        w = [int(x) for x in arr.tolist()]
        if len(w) != HEADER_WORDS or w[0] != _signed(MAGIC):
            raise PipelineError(f"bad pipeline header {w}: ranks out of sync")
        temperature = struct.unpack("<f", struct.pack("<i", w[6]))[0]
        top_p = struct.unpack("<f", struct.pack("<i", w[7]))[0]
        key_seed = struct.unpack("<Q", struct.pack("<ii", w[8], w[9]))[0]
        h = cls(w[1], w[2], w[3], w[4], w[5], temperature, top_p, key_seed)
        if h.op not in (OP_FORWARD, OP_SAMPLE, OP_SHUTDOWN) or (h.op != OP_SHUTDOWN and (h.length < 1 or h.dtype not in DTYPES)):
            raise PipelineError(f"bad pipeline header {h}")
        return h


def _signed(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


class Link:
    """This rank's two ring neighbours over an mx.distributed group. Every operation is
    evaluated before it returns (one at a time, on the CPU stream, where MLX's collectives
    live and clear of the Metal command-buffer watchdog)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def send(self, x: mx.array) -> None:
        mx.eval(mx.distributed.send(x, self.right, group=self.group, stream=mx.cpu))

    def recv(self, shape: Sequence[int], dtype: Any) -> mx.array:
        got = mx.distributed.recv(tuple(shape), dtype, self.left, group=self.group, stream=mx.cpu)
        mx.eval(got)
        return got

    def send_header(self, h: Header) -> None:
        self.send(h.encode())

    def recv_header(self) -> Header:
        return Header.decode(self.recv((HEADER_WORDS,), mx.int32))

    def drain(self) -> None:
        """Finish pending work, then a barrier, so no rank closes its sockets while a
        neighbour still has an operation in flight."""
        mx.synchronize()
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=self.group, stream=mx.cpu))


class Stage:
    """A shard and its KV cache, reset at the first chunk of every request."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.cache: list[Any] | None = None

    @property
    def position(self) -> int:
        return int(self.cache[0].offset) if self.cache else 0

    def run(self, x: mx.array, h: Header) -> mx.array:
        if h.flags & FLAG_FIRST:
            self.cache = self.shard.make_cache()
        if self.cache is None or h.position != self.position:
            raise PipelineError(f"stage {self.shard.start}-{self.shard.end} holds {self.position} tokens, header says {h.position}")
        out = self.shard.forward(x, self.cache, last_only=True)
        # Compute before any communication: a send never waits on a long compute graph.
        mx.eval(out, [c.state for c in self.cache])
        return out


def _sample_token(logits: mx.array, h: Header) -> int:
    return int(sample(logits[0, -1], h.temperature, h.top_p, h.key_seed).item())


class Driver:
    """Rank 0: runs the first stage, pushes each step down the pipeline and gets the
    token back from the last rank (or samples itself when it is the only rank)."""

    def __init__(self, stage: Stage, link: Link | None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if (link is None) != stage.shard.last:
            raise ValueError("rank 0 without a group must hold the whole model, and with one must not")
        self.stage, self.link, self.prefill_chunk = stage, link, prefill_chunk

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams) -> Iterator[int]:
        """Tokens one by one, at most max_tokens; the consumer stops early (EOS) by no
        longer iterating: nothing is in flight between two tokens."""
        if not prompt or max_tokens < 1:
            return
        position = 0
        chunks = [list(prompt[i : i + self.prefill_chunk]) for i in range(0, len(prompt), self.prefill_chunk)]
        token = -1
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            token = self._step(chunk, position, OP_SAMPLE if last else OP_FORWARD, FLAG_FIRST if i == 0 else 0, params)
            position += len(chunk)
        yield token
        for _ in range(max_tokens - 1):
            token = self._step([token], position, OP_SAMPLE, 0, params)
            position += 1
            yield token

    def _step(self, ids: list[int], position: int, op: int, flags: int, params: SamplingParams) -> int:
        key_seed = step_key_seed(params.seed, position + len(ids))
        h = Header(op, len(ids), flags, position, 1, params.temperature, params.top_p, key_seed)
        out = self.stage.run(mx.array([ids], dtype=mx.int32), h)
        if self.link is None:
            return _sample_token(out, h) if op == OP_SAMPLE else -1
        self.link.send_header(Header(op, len(ids), flags, position, DTYPE_CODES[out.dtype], params.temperature, params.top_p, key_seed))
        self.link.send(out)
        if op != OP_SAMPLE:
            return -1
        return int(self.link.recv((1,), mx.int32).item())

    def shutdown(self) -> None:
        """Send SHUTDOWN around the ring and wait for it to come back, then drain."""
        if self.link is None:
            return
        self.link.send_header(Header(OP_SHUTDOWN))
        back = self.link.recv_header()
        if back.op != OP_SHUTDOWN:
            raise PipelineError(f"expected SHUTDOWN back from rank {self.link.left}, got {back}")
        self.link.drain()


def serve_stage(stage: Stage, link: Link) -> None:
    """Ranks 1..n-1: run every step rank 0 sends until SHUTDOWN, then pass SHUTDOWN on
    (the last rank passes it to rank 0) and drain. Waits in MLX's recv while idle: the
    agent, which supervises the workers, kills a rank whose peer went silent."""
    last = stage.shard.last
    while True:
        h = link.recv_header()
        if h.op == OP_SHUTDOWN:
            link.send_header(h)
            link.drain()
            return
        x = link.recv((1, h.length, stage.shard.hidden_size), DTYPES[h.dtype])
        out = stage.run(x, h)
        if not last:
            link.send_header(Header(h.op, h.length, h.flags, h.position, DTYPE_CODES[out.dtype], h.temperature, h.top_p, h.key_seed))
            link.send(out)
        elif h.op == OP_SAMPLE:
            link.send(mx.array([_sample_token(out, h)], dtype=mx.int32))
