"""What this Mac offers for a model: `python -m p2pmesh.worker.measure --model PATH`.

Prints one JSON object for the planner:
  layer_ms                       median time of one decoder layer's decode step (one token,
                                 CONTEXT tokens already cached), measured on this machine
  layer_fixed_ms                 the part of layer_ms that splitting the layer over a tensor
                                 group does not divide (operation dispatch), from the same
                                 layer cut to 1/split_ranks of its heads and columns, timed
                                 at split_layer_ms (0 when the layer cannot be cut)
  memory_bytes                   usable memory: MLX's max recommended working set on macOS
                                 (Metal), MemAvailable from /proc/meminfo on Linux
  layers, layer_bytes, embed_bytes, head_bytes, kv_bytes_per_token_per_layer,
  activation_bytes, total_bytes  from config.json and the safetensors headers
                                 (core/model_spec.py, the same arithmetic the planner runs)
Only one layer is loaded for the timing (a middle one when there are three or more, so
no embeddings or head are read), and for a Hugging Face id only the file(s) holding it are
downloaded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTEXT = 256
"""Tokens in the KV cache while timing: a modest context, where a decode step is
dominated by the layer's weights rather than by attention over the cache."""
WARMUP, STEPS, ROUNDS = 3, 40, 4
SPLIT_RANKS = (4, 2)
"""The share a measurement times besides the whole layer: a quarter, else a half (the
first that divides the model's KV heads and MLP columns)."""


def model_sizes(name: str, path: Path) -> dict[str, Any]:
    """The model_spec numbers from config.json and the safetensors headers (no weights read;
    the hub's headers for the files this Mac has not fetched)."""
    from p2pmesh.core.model_spec import model_spec
    from p2pmesh.drivers.model_files import tensor_bytes
    from p2pmesh.worker.checkpoint import read_config

    spec = model_spec(read_config(path), tensor_bytes(name, path))
    return {
        "layers": spec.layers,
        "layer_bytes": spec.layer_bytes,
        "embed_bytes": spec.embed_bytes,
        "head_bytes": spec.head_bytes,
        "kv_bytes_per_token_per_layer": spec.kv_bytes_per_token_per_layer,
        "activation_bytes": spec.activation_bytes,
        "total_bytes": spec.total_bytes,
    }


def usable_memory_bytes() -> int:
    """Metal's recommended working set on a Mac; MemAvailable on Linux; 0 if unknown."""
    import mlx.core as mx

    if sys.platform == "darwin":
        info = mx.device_info()
        return int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """One decoder layer's decode step on this machine, whole and cut as a tensor rank's share."""
    layer_ms: float  # the whole layer
    fixed_ms: float  # the part a split does not divide (0.0 when the layer cannot be cut)
    split_ranks: int  # the share timed: 1 / split_ranks of the layer (0: not timed)
    split_ms: float  # that share's time (0.0 when not timed)


def layer_decode_ms(path: Path, layers: int, context: int = CONTEXT) -> float:
    """Median wall time of one decoder layer processing one token with `context` cached."""
    return layer_times(path, layers, context, split=False).layer_ms


def layer_times(path: Path, layers: int, context: int = CONTEXT, split: bool = True) -> LayerTimes:
    """The measured layer's decode time, whole and (split) cut to 1 / n of its KV heads and
    MLP columns (n = the first of SPLIT_RANKS that divides them) the way a tensor rank holds
    it, the two timed in alternating rounds so that a drift of the machine's speed hits both.

    A decode step is not all bytes over bandwidth: every operation also costs a dispatch (a
    Metal kernel launch, a CPU op's overhead) that a rank pays whatever its share. With the
    whole layer at F + P and the 1/n share at F + P/n, the fixed part F = (share - whole/n) /
    (1 - 1/n), within [0, whole]: what core/tensor_cost.py adds to every rank's share."""
    import mlx.core as mx

    from p2pmesh.drivers.model_files import measured_layer
    from p2pmesh.worker.model import load_shard
    from p2pmesh.worker.tensor import TensorShardError, even_shares, shard_layer

    index = measured_layer(layers)
    whole = LayerClock(load_shard(path, index, index + 1), context)
    cut, ranks = None, 0
    if split:
        shard = load_shard(path, index, index + 1)
        for n in SPLIT_RANKS:
            try:
                shares = even_shares(shard.config, n)
            except (TensorShardError, KeyError, ValueError):
                continue  # the model does not divide n ways
            if min(shares[0].heads, shares[0].kv_heads, shares[0].columns) == 0:
                continue
            try:
                # A group of one: the cut layer's all-sums return their input, so the time is
                # the share's compute alone (the cost model adds the all-reduces itself).
                shard_layer(shard.model.model.layers[0], shard.config, shares, 0, mx.distributed.init())
                cut, ranks = LayerClock(shard, context), n  # its prefill runs the cut layer once
            except (TensorShardError, ValueError, RuntimeError, TypeError, AttributeError, KeyError):
                # A layer this worker cannot cut (MLA attention; quantized weights, which are
                # not cut by rows here): the whole layer's time still stands, no fixed part.
                cut, ranks = None, 0
            break
    full_ms: list[float] = []
    cut_ms: list[float] = []
    whole.steps(WARMUP)
    if cut is not None:
        cut.steps(WARMUP)
    for _ in range(ROUNDS):  # alternate: a machine that slows down mid-way slows both alike
        full_ms += whole.steps(STEPS // ROUNDS)
        if cut is not None:
            cut_ms += cut.steps(STEPS // ROUNDS)
    full = statistics.median(full_ms)
    if cut is None:
        return LayerTimes(full, 0.0, 0, 0.0)
    part = statistics.median(cut_ms)
    fixed = min(full, max(0.0, (part - full / ranks) / (1 - 1 / ranks)))
    return LayerTimes(full, fixed, ranks, part)


class LayerClock:
    """Times decode steps of a one-layer shard with `context` tokens already cached."""

    def __init__(self, shard: Any, context: int) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        self.shard = shard
        layer = shard.model.model.layers[0]
        self.dtype = next(v.dtype for _, v in tree_flatten(layer.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        self.cache = shard.make_cache()
        self.seed = 0
        mx.eval(shard.forward(self._input(context), self.cache, last_only=True), [c.state for c in self.cache])

    def _input(self, length: int) -> Any:
        # Through Shard.forward, so the layer gets its family's own mask (MLA layers take no
        # "causal" string); a first stage (models of 1 or 2 layers) takes token ids.
        import mlx.core as mx

        self.seed += 1
        key = mx.random.key(self.seed)
        if self.shard.first:
            return mx.random.randint(0, self.shard.vocab_size, (1, length), key=key)
        return mx.random.normal((1, length, self.shard.hidden_size), key=key).astype(self.dtype)

    def steps(self, n: int) -> list[float]:
        """Milliseconds of n decode steps, one token each."""
        import mlx.core as mx

        times = []
        for _ in range(n):
            h = self._input(1)
            mx.eval(h)
            t0 = time.perf_counter()
            mx.eval(self.shard.forward(h, self.cache, last_only=True))
            times.append((time.perf_counter() - t0) * 1000)
        return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pmesh.worker.measure", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory or a Hugging Face id")
    parser.add_argument("--context", type=int, default=CONTEXT)
    args = parser.parse_args(argv)
    from p2pmesh.drivers.model_files import ModelFilesError, measured_layers, num_layers
    from p2pmesh.worker.checkpoint import CheckpointError, read_config
    from p2pmesh.worker.model import ModelError, resolve_model

    try:
        # A hub model: the metadata, then only the weight file(s) of the layer timed.
        path = resolve_model(args.model, layers=measured_layers(read_config(resolve_model(args.model, metadata_only=True))))
        try:
            sizes = model_sizes(args.model, path)
        except ModelFilesError:  # a partial copy of a local model: the agent needs only the timing
            sizes = {"layers": num_layers(read_config(path))}
        times = layer_times(path, sizes["layers"], args.context)
        result = {"layer_ms": round(times.layer_ms, 4), "layer_fixed_ms": round(times.fixed_ms, 4),
                  "split_ranks": times.split_ranks, "split_layer_ms": round(times.split_ms, 4),
                  "memory_bytes": usable_memory_bytes(), **sizes}
    except (ModelError, CheckpointError, ModelFilesError, ValueError) as e:
        print(f"measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
