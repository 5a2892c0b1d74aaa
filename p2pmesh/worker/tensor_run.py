"""Greedy generation by tensor groups chained as a pipeline (issue 16): one process per rank,
`python -m p2pmesh.worker.tensor_run`.

A plan is groups of ranks, each group running a layer range tensor-parallel
(worker/tensor.py). One group is a tensor plan; groups of one rank are a pipeline; groups
of several in a row are a hybrid. MLX's ring backend has no Group.split and init() runs once
per process, so every group is its own MLX group (its own hostfile: MLX_RANK and
MLX_HOSTFILE, as for pipeline workers; a group of one has none) and the pipeline hop
between groups goes over a plain TCP socket between the groups' rank 0s (`Hop`):

    group g rank 0 --activation [1, L, hidden]--> group g+1 rank 0   (g+1 < G)
    last group rank 0 --token id-->               first group rank 0
    group rank 0 --the same message-->            each other rank of its group ("fan")

Within a group every rank computes the same hidden states and logits (the all-sums), so
every rank of the last group samples the same token and a tensor plan of one group needs no
hop at all. The receiving rank 0 passes what it got on to its group over TCP rather than by
an all-sum with zeros elsewhere (MLX has no broadcast): the other ranks then wait blocked in
recv instead of busy-polling a core in MLX's ring while another group computes (which, with
more ranks than cores, starves the group that works), and on a real ring it costs s - 1
sends of the activation where the all-sum costs 2 (s - 1) steps. core/tensor_cost.py still
charges the all-sum (entry_act, entry_token): an upper bound.

Output: one JSON line per rank at the end, {"event": "done", "rank", "group", "how",
"tokens", "runs": [{"tokens", "prefill_s", "decode_s", "phases_ms"}, ...]} (one per --repeat
run; PHASES says what phases_ms holds), or exit 3 from the
watchdog (a silent peer hangs MLX forever: faulthandler dumps the stacks and exits).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADER = struct.Struct("!I")
"""Every hop message: a 4-byte length, a JSON header of that length, then the payload.
The serving worker's side channel (worker/side_link.py) is the checked, bounded kind of
this hop; the connection helpers are its own."""


class HopError(Exception):
    """The neighbour group's rank 0 went away or sent something else than expected."""


@dataclass(frozen=True, slots=True)
class Hop:
    """This rank's TCP links in a chain of groups. Rank 0: `down` to the next group's rank 0
    (the first group's when this is the last: the token goes back), `up` from the previous
    group's, `fan` to the other ranks of its own group. Another rank: `up` from its rank 0."""
    down: socket.socket | None
    up: socket.socket
    fan: tuple[socket.socket, ...] = ()

    @classmethod
    def open_head(cls, host: str, listen_port: int, next_addr: tuple[str, int], fan_port: int, members: int,
                  deadline: float) -> Hop:
        """Listen first (on ``host``, this rank's own address: --hop-fan's, never a wildcard),
        then connect (retried until the deadline: the next group may start later), then
        accept: a connect completes on the backlog, so no order deadlocks."""
        server, fan_server = socket.create_server((host, listen_port)), socket.create_server((host, fan_port))
        try:
            down = _connect(next_addr, deadline)
            up = _accept(server, deadline)
            fan = tuple(_accept(fan_server, deadline) for _ in range(members - 1))
        finally:
            server.close()
            fan_server.close()
        return cls(down, up, fan)

    @classmethod
    def open_member(cls, fan_addr: tuple[str, int], deadline: float) -> Hop:
        return cls(None, _nodelay(_connect(fan_addr, deadline)))

    def send(self, header: dict[str, Any], payload: bytes) -> None:
        assert self.down is not None
        _send(self.down, header, payload)

    def recv(self) -> tuple[dict[str, Any], bytes]:
        """The next message from upstream; rank 0 passes it on to its group (a copy each)."""
        (n,) = HEADER.unpack(_read(self.up, HEADER.size))
        head = _read(self.up, n)
        header = json.loads(head)
        payload = _read(self.up, int(header["nbytes"]))
        for s in self.fan:
            s.sendall(HEADER.pack(n) + head + payload)
        return header, payload

    def close(self) -> None:
        for s in (self.down, self.up, *self.fan):
            if s is not None:
                s.close()


def _send(s: socket.socket, header: dict[str, Any], payload: bytes) -> None:
    head = json.dumps(header).encode()
    s.sendall(HEADER.pack(len(head)) + head + payload)


def _accept(server: socket.socket, deadline: float) -> socket.socket:
    server.settimeout(max(0.1, deadline - time.monotonic()))
    conn, _ = server.accept()
    return _nodelay(conn)


def _nodelay(s: socket.socket) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(None)
    return s


def _connect(addr: tuple[str, int], deadline: float) -> socket.socket:
    from p2pmesh.worker.side_link import connect_retry

    return connect_retry(addr, deadline, "the next group's rank 0")


def _read(s: socket.socket, n: int) -> bytes:
    from p2pmesh.worker.side_link import read_exact

    return read_exact(s, n, "the neighbour group")


class GroupRank:
    """This process: one rank of one group, with its shard, its MLX group and (rank 0 of a
    group in a chain of several) its hop."""

    def __init__(self, shard: Any, group: Any, rank: int, index: int, count: int, hop: Hop | None) -> None:
        import mlx.core as mx

        self.mx = mx
        self.shard, self.group, self.rank = shard, group, rank
        self.index, self.count, self.hop = index, count, hop
        self.dtype = next(p.dtype for p in _leaves(shard.model.parameters()) if mx.issubdtype(p.dtype, mx.floating))

    def _entry(self, tokens: Any, length: int) -> Any:
        """This group's input for a step: the tokens (first group; after the prompt, the id
        the last group sent back) or the previous group's activation, which rank 0 receives
        and passes on to its group."""
        mx = self.mx
        if self.index == 0:
            return tokens
        assert self.hop is not None
        header, payload = self.hop.recv()
        if header.get("kind") != "activation" or header["shape"] != [1, length, self.shard.hidden_size]:
            raise HopError(f"expected an activation [1, {length}, hidden], got {header}")
        return mx.array(_from_bytes(payload, header["shape"])).astype(self.dtype)

    def _next_token(self, token: int | None) -> int:
        """The token every rank of every group goes on with: sampled by every rank of the
        last group, sent back by its rank 0 to the first group's (which passes it on)."""
        last = self.index == self.count - 1
        if last and self.count > 1 and self.rank == 0:
            assert self.hop is not None and token is not None
            self.hop.send({"kind": "token", "nbytes": 4}, struct.pack("!i", token))
        if last:
            assert token is not None
            return token
        if self.index == 0:
            assert self.hop is not None
            header, payload = self.hop.recv()
            if header.get("kind") != "token":
                raise HopError(f"expected a token, got {header}")
            return int(struct.unpack("!i", payload)[0])
        return -1  # a middle group does not need the id: it waits for the next activation

    def generate(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """max_tokens greedy tokens (no stop on EOS: the reference is mlx-lm's generate_step)."""
        mx = self.mx
        cache = self.shard.make_cache()
        last = self.index == self.count - 1
        tokens = mx.array([list(prompt)], dtype=mx.int32)
        length = len(prompt)
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        phases = dict.fromkeys(PHASES, 0.0)  # decode steps only (after the first token)
        for step in range(max_tokens):
            t_in = time.perf_counter()
            x = self._entry(tokens, length)
            t_compute = time.perf_counter()
            h = self.shard.forward(x, cache, last_only=True)
            token: int | None = None
            if last:
                token = int(mx.argmax(h[0, -1]).item())
                t_send = time.perf_counter()
            else:
                mx.eval(h)
                t_send = time.perf_counter()
                if self.rank == 0:
                    assert self.hop is not None
                    payload = _to_bytes(h.astype(mx.float32))
                    self.hop.send({"kind": "activation", "shape": list(h.shape), "nbytes": len(payload)}, payload)
            t_token = time.perf_counter()
            nxt = self._next_token(token)
            if step > 0:
                for name, took in zip(PHASES, (t_compute - t_in, t_send - t_compute, t_token - t_send,
                                               time.perf_counter() - t_token)):
                    phases[name] += took
            if nxt >= 0:
                out.append(nxt)
            tokens = mx.array([[max(nxt, 0)]], dtype=mx.int32)
            length = 1
            if step == 0:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        steps = max(1, max_tokens - 1)
        return {"tokens": out, "prefill_s": t_first - t0, "decode_s": t_end - t_first,
                "phases_ms": {k: round(v * 1000 / steps, 3) for k, v in phases.items()}}


PHASES = ("wait_input", "compute", "send", "wait_token")
"""Where a decode step's time goes on a rank (`phases_ms`, ms per step): waiting for the
previous group's activation (and its head's fan), the layers with their all-sums, sending
the activation on, waiting for the sampled token (the first group: the last group's work)."""


def _leaves(tree: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


def _to_bytes(a: Any) -> bytes:
    import numpy as np

    return np.asarray(a, dtype=np.float32).tobytes()


def _from_bytes(payload: bytes, shape: Sequence[int]) -> Any:
    import numpy as np

    return np.frombuffer(payload, dtype=np.float32).reshape(shape)


def parse_shares(text: str | None, config: dict[str, Any], size: int) -> tuple[Any, ...]:
    """--shares: a JSON list of [heads, kv_heads, columns] or {"heads", "kv_heads",
    "columns"} per rank (plan solve's `shares`); absent: an even split."""
    from p2pmesh.core.placement_cost import Share
    from p2pmesh.worker.group_plan import parse_shares as parse
    from p2pmesh.worker.tensor import TensorShardError, even_shares

    if text is None:
        return even_shares(config, size) if size > 1 else (Share(int(config["num_attention_heads"]),
                                                                  int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                                                                  int(config["intermediate_size"])),)
    try:
        return parse(text)
    except ValueError as e:
        raise TensorShardError("bad_shares", str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One rank of a tensor group (or a pipeline of them): greedy generation.")
    p.add_argument("--model", required=True, help="a local model directory")
    p.add_argument("--layers", type=int, nargs=2, metavar=("START", "END"), required=True)
    p.add_argument("--shares", help="JSON list of [heads, kv_heads, columns] per rank of this group (default: even)")
    p.add_argument("--group", type=int, nargs=2, metavar=("INDEX", "COUNT"), default=(0, 1),
                   help="this group's place in the pipeline of groups")
    p.add_argument("--hop-listen", type=int,
                   help="rank 0 of a chained group: the port the previous group connects to (on --hop-fan's host)")
    p.add_argument("--hop-next", help="rank 0 of a chained group: HOST:PORT of the next group's rank 0 (the first group's, from the last)")
    p.add_argument("--hop-fan", help="a chained group: HOST:PORT where its rank 0 listens for the group's other ranks")
    p.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="generate this many times (a benchmark's warm-up and runs)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--cpu", type=int, help="run on this CPU only (Linux; a benchmark's ranks sharing one host, each on its own core)")
    args = p.parse_args(argv)
    if args.cpu is not None:  # before MLX starts its threads: they inherit the mask
        if not hasattr(os, "sched_setaffinity"):
            p.error("--cpu needs sched_setaffinity (Linux)")
        try:
            os.sched_setaffinity(0, {args.cpu})
        except (OSError, ValueError) as e:
            p.error(f"--cpu {args.cpu}: {e}")
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # exits 1 after dumping every thread's stack
    deadline = time.monotonic() + args.timeout_s

    import mlx.core as mx

    from p2pmesh.worker.checkpoint import read_config
    from p2pmesh.worker.model import ModelError
    from p2pmesh.worker.tensor import load_tensor_shard

    group, rank = None, 0
    if os.environ.get("MLX_HOSTFILE"):
        group = mx.distributed.init(strict=True, backend="ring")
        rank = group.rank()
    index, count = args.group
    try:
        config = read_config(Path(args.model))
        shares = parse_shares(args.shares, config, 1 if group is None else group.size())
        shard, how = load_tensor_shard(args.model, args.layers[0], args.layers[1], shares, rank, group)
    except ModelError as e:
        print(json.dumps({"event": "error", "rank": rank, "code": getattr(e, "code", "model"), "message": str(e)}), flush=True)
        return 2
    hop = None
    if count > 1:
        fan_host, fan_port = args.hop_fan.rsplit(":", 1)
        if rank == 0:
            host, port = args.hop_next.rsplit(":", 1)
            size = 1 if group is None else group.size()
            hop = Hop.open_head(fan_host, args.hop_listen, (host, int(port)), int(fan_port), size, deadline)
        else:
            hop = Hop.open_member((fan_host, int(fan_port)), deadline)
    runner = GroupRank(shard, group, rank, index, count, hop)
    runs = [runner.generate(json.loads(args.prompt_ids), args.max_tokens) for _ in range(args.repeat)]
    if group is not None and group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))  # barrier: nobody exits mid-collective
    if hop is not None:
        hop.close()
    print(json.dumps({"event": "done", "rank": rank, "group": index, "how": how, "tokens": runs[-1]["tokens"],
                      "runs": runs}), flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
