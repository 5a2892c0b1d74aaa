"""Quantized KV caches for `load --kv-bits 4|8`: which of a shard's caches switch to
mlx-lm's QuantizedKVCache, and when.

As mlx-lm's generate does with kv_bits set (maybe_quantize_kv_cache, its default
quantized_kv_start): a request's cache is converted whole (KVCache.to_quantized) after the
step that brings it to QUANTIZED_KV_START tokens (core/kv_quant.py, which the planner
counts), so short requests run at full precision and long contexts take about bits/16 of
the memory. The pipeline stage (worker/pipeline.py) calls `quantized` after every prefill
chunk and decode step.

Left as they are, at full precision (the worker says so once on stderr, `setup`):
- every cache that is not a plain KVCache: rotating (sliding-window) caches, whose
  to_quantized mlx-lm does not implement, arrays (linear attention, SSM state), chunked
  caches and cache lists;
- every cache of a model whose attention cannot read a quantized cache: MLA (config.json's
  kv_lora_rank: the cache holds the compressed latent, read by plain matmuls) and attention
  sinks (mlx-lm's quantized attention refuses them);
- a cache whose head size is not a multiple of the group size (mx.quantize needs one).
A quantized cache has no batched form in mlx-lm (BatchKVCache has no to_quantized, and
QuantizedKVCache no merge, extend or filter; mlx-lm's own server serves kv_bits requests
unbatched): with kv_bits a head worker serves one request at a time (worker/serve.py,
core/validate.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from p2pmesh.core.config_shape import kv_quant_problem
from p2pmesh.core.kv_quant import KV_GROUP_SIZE, QUANTIZED_KV_START


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How a worker quantizes its caches: `bits` (4 or 8), per group of `group_size` values,
    once a cache holds `start` tokens."""

    bits: int
    group_size: int = KV_GROUP_SIZE
    start: int = QUANTIZED_KV_START


def _ready(cache: Any, quant: KVQuant) -> bool:
    return (type(cache) is KVCache and cache.keys is not None and cache.offset >= quant.start
            and cache.keys.shape[-1] % quant.group_size == 0 and cache.values.shape[-1] % quant.group_size == 0)


def quantized(caches: list[Any], quant: KVQuant | None) -> list[Any]:
    """`caches` with every plain KVCache that holds `quant.start` tokens or more converted
    to a QuantizedKVCache (as mlx-lm's maybe_quantize_kv_cache); the others as they are.
    The same list when nothing changes (quant None: full precision)."""
    if quant is None or not any(_ready(c, quant) for c in caches):
        return caches
    return [c.to_quantized(group_size=quant.group_size, bits=quant.bits) if _ready(c, quant) else c for c in caches]


def batchable(caches: Sequence[Any]) -> bool:
    """Whether these caches can be merged into a batched decode group (no quantized one)."""
    return not any(isinstance(c, QuantizedKVCache) for c in caches)


def setup(bits: int | None, caches: Sequence[Any], config: Mapping[str, Any]) -> tuple[KVQuant | None, str | None]:
    """A worker's quantization for `bits` (None or 0: full precision) given the caches its
    shard makes and the model's config.json, and a line for its stderr saying what is
    quantized and what stays at full precision (None without bits)."""
    if not bits:
        return None, None
    problem = kv_quant_problem(config)
    if problem is not None:
        return None, f"kv_bits {bits}: every KV cache stays at full precision: {problem}"
    quant = KVQuant(bits)
    note = f"kv_bits {bits}: KV caches quantized once a request holds {quant.start} tokens"
    kept = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if kept:
        note += f"; these stay at full precision (mlx-lm cannot quantize them): {', '.join(kept)}"
    return quant, note
