"""What this Mac offers for a model: `python -m p2pmesh.worker.measure --model PATH`.

Prints one JSON object for the planner:
  layer_ms                       median time of one decoder layer's decode step (one token,
                                 CONTEXT tokens already cached), measured on this machine
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
from pathlib import Path
from typing import Any

CONTEXT = 256
"""Tokens in the KV cache while timing: a modest context, where a decode step is
dominated by the layer's weights rather than by attention over the cache."""
WARMUP, STEPS = 3, 20


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


def layer_decode_ms(path: Path, layers: int, context: int = CONTEXT) -> float:
    """Median wall time of one decoder layer processing one token with `context` cached."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from p2pmesh.drivers.model_files import measured_layer
    from p2pmesh.worker.model import load_shard

    index = measured_layer(layers)
    shard = load_shard(path, index, index + 1)
    layer = shard.model.model.layers[0]
    dtype = next(v.dtype for _, v in tree_flatten(layer.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    cache = shard.make_cache()

    def step_input(length: int, seed: int) -> mx.array:
        # Through Shard.forward, so the layer gets its family's own mask (MLA layers take no
        # "causal" string); a first stage (models of 1 or 2 layers) takes token ids.
        if shard.first:
            return mx.random.randint(0, shard.vocab_size, (1, length), key=mx.random.key(seed))
        return mx.random.normal((1, length, shard.hidden_size), key=mx.random.key(seed)).astype(dtype)

    mx.eval(shard.forward(step_input(context, 0), cache, last_only=True), [c.state for c in cache])
    times = []
    for i in range(WARMUP + STEPS):
        h = step_input(1, i + 1)
        mx.eval(h)
        t0 = time.perf_counter()
        mx.eval(shard.forward(h, cache, last_only=True))
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


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
        result = {"layer_ms": round(layer_decode_ms(path, sizes["layers"], args.context), 4),
                  "memory_bytes": usable_memory_bytes(), **sizes}
    except (ModelError, CheckpointError, ModelFilesError, ValueError) as e:
        print(f"measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
