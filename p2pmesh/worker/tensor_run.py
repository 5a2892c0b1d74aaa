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

and the receiving rank 0 shares what it got with its group by an all-sum with zeros on the
other ranks (MLX has no broadcast): exactly the costs core/tensor_cost.py charges (one more
all-reduce of the activation on entering a later group, of the token id on entering the
first). Within a group every rank computes the same hidden states and logits (the
all-sums), so every rank of the last group samples the same token and no hop is needed in a
tensor plan of one group.

Output: one JSON line per rank at the end, {"event": "done", "rank", "group", "how",
"tokens", "prefill_s", "decode_s"} (one per --repeat run under "runs"), or exit 3 from the
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
"""Every hop message: a 4-byte length, a JSON header of that length, then the payload."""
CONNECT_RETRY_S = 0.05


class HopError(Exception):
    """The neighbour group's rank 0 went away or sent something else than expected."""


@dataclass(frozen=True, slots=True)
class Hop:
    """The TCP link of this group's rank 0 to its pipeline neighbours: `down` to the next
    group (the first group when this is the last: the token goes back), `up` from the
    previous one."""
    down: socket.socket
    up: socket.socket

    @classmethod
    def open(cls, listen_port: int, next_addr: tuple[str, int], deadline: float) -> Hop:
        """Listen first, then connect (retried until the deadline: the next group may start
        later), then accept: a connect completes on the backlog, so no order deadlocks."""
        server = socket.create_server(("127.0.0.1" if next_addr[0] == "127.0.0.1" else "0.0.0.0", listen_port))
        try:
            down = _connect(next_addr, deadline)
            server.settimeout(max(0.1, deadline - time.monotonic()))
            up, _ = server.accept()
        finally:
            server.close()
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
        return cls(down, up)

    def send(self, header: dict[str, Any], payload: bytes) -> None:
        head = json.dumps(header).encode()
        self.down.sendall(HEADER.pack(len(head)) + head + payload)

    def recv(self) -> tuple[dict[str, Any], bytes]:
        (n,) = HEADER.unpack(_read(self.up, HEADER.size))
        header = json.loads(_read(self.up, n))
        return header, _read(self.up, int(header["nbytes"]))

    def close(self) -> None:
        for s in (self.down, self.up):
            s.close()


def _connect(addr: tuple[str, int], deadline: float) -> socket.socket:
    while True:  # bounded by the deadline
        try:
            return socket.create_connection(addr, timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() >= deadline:
                raise HopError(f"cannot reach the next group at {addr[0]}:{addr[1]}") from None
            time.sleep(CONNECT_RETRY_S)


def _read(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # bounded: n bytes, or the peer closes
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise HopError("the neighbour group closed the hop")
        buf += chunk
    return bytes(buf)


class GroupRank:
    """This process: one rank of one group, with its shard, its MLX group and (rank 0 of a
    group in a chain of several) its hop."""

    def __init__(self, shard: Any, group: Any, rank: int, index: int, count: int, hop: Hop | None) -> None:
        import mlx.core as mx

        self.mx = mx
        self.shard, self.group, self.rank = shard, group, rank
        self.index, self.count, self.hop = index, count, hop
        self.dtype = next(p.dtype for p in _leaves(shard.model.parameters()) if mx.issubdtype(p.dtype, mx.floating))

    def _share(self, x: Any) -> Any:
        """Rank 0's x on every rank of the group (all-sum with zeros elsewhere)."""
        mx = self.mx
        if self.group is None or self.group.size() == 1:
            return x
        return mx.distributed.all_sum(x if self.rank == 0 else mx.zeros_like(x), group=self.group)

    def _entry(self, tokens: Any, length: int) -> Any:
        """This group's input for a step: the tokens (first group; after the prompt, the id
        the last group sent back) or the previous group's activation."""
        mx = self.mx
        if self.index == 0:
            return tokens
        x = mx.zeros((1, length, self.shard.hidden_size), dtype=self.dtype)
        if self.rank == 0:
            assert self.hop is not None
            header, payload = self.hop.recv()
            if header.get("kind") != "activation" or header["shape"] != [1, length, self.shard.hidden_size]:
                raise HopError(f"expected an activation [1, {length}, hidden], got {header}")
            x = mx.array(_from_bytes(payload, header["shape"])).astype(self.dtype)
        return self._share(x)

    def _next_token(self, token: int | None) -> int:
        """The token every rank of every group goes on with: sampled by the last group, sent
        back to the first (whose rank 0 shares it)."""
        mx = self.mx
        last = self.index == self.count - 1
        if last and self.count > 1 and self.rank == 0:
            assert self.hop is not None and token is not None
            self.hop.send({"kind": "token", "nbytes": 4}, struct.pack("!i", token))
        if self.index == 0 and self.count > 1:
            got = 0
            if self.rank == 0:
                assert self.hop is not None
                header, payload = self.hop.recv()
                if header.get("kind") != "token":
                    raise HopError(f"expected a token, got {header}")
                (got,) = struct.unpack("!i", payload)
            shared = self._share(mx.array([got], dtype=mx.int32))
            return int(shared.item())
        if last:
            assert token is not None
            return token
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
        for step in range(max_tokens):
            h = self.shard.forward(self._entry(tokens, length), cache, last_only=True)
            token: int | None = None
            if last:
                token = int(mx.argmax(h[0, -1]).item())
            else:
                mx.eval(h)
                if self.rank == 0:
                    assert self.hop is not None
                    payload = _to_bytes(h.astype(mx.float32))
                    self.hop.send({"kind": "activation", "shape": list(h.shape), "nbytes": len(payload)}, payload)
            nxt = self._next_token(token)
            if nxt >= 0:
                out.append(nxt)
            tokens = mx.array([[max(nxt, 0)]], dtype=mx.int32)
            length = 1
            if step == 0:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        return {"tokens": out, "prefill_s": t_first - t0, "decode_s": t_end - t_first}


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
    from p2pmesh.worker.tensor import TensorShardError, even_shares

    if text is None:
        return even_shares(config, size) if size > 1 else (Share(int(config["num_attention_heads"]),
                                                                  int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                                                                  int(config["intermediate_size"])),)
    try:
        raw = json.loads(text)
        return tuple(Share(int(s["heads"]), int(s["kv_heads"]), int(s["columns"])) if isinstance(s, dict)
                     else Share(*(int(v) for v in s)) for s in raw)
    except (ValueError, TypeError, KeyError) as e:
        raise TensorShardError("bad_shares", f"--shares is not a list of shares: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One rank of a tensor group (or a pipeline of them): greedy generation.")
    p.add_argument("--model", required=True, help="a local model directory")
    p.add_argument("--layers", type=int, nargs=2, metavar=("START", "END"), required=True)
    p.add_argument("--shares", help="JSON list of [heads, kv_heads, columns] per rank of this group (default: even)")
    p.add_argument("--group", type=int, nargs=2, metavar=("INDEX", "COUNT"), default=(0, 1),
                   help="this group's place in the pipeline of groups")
    p.add_argument("--hop-listen", type=int, help="rank 0 of a chained group: the port the previous group connects to")
    p.add_argument("--hop-next", help="rank 0 of a chained group: HOST:PORT of the next group's rank 0 (the first group's, from the last)")
    p.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="generate this many times (a benchmark's warm-up and runs)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
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
    if count > 1 and rank == 0:
        host, port = args.hop_next.rsplit(":", 1)
        hop = Hop.open(args.hop_listen, (host, int(port)), deadline)
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
