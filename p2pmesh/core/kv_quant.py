"""The memory a quantized KV cache takes (`load --kv-bits 4|8`), as the planner counts it.

mlx-lm's QuantizedKVCache keeps keys and values as `bits`-bit integers packed in uint32, plus
one scale and one bias per group of KV_GROUP_SIZE values in the cache's own dtype. Workers
(worker/kv_cache.py) switch a request's caches to it once they hold QUANTIZED_KV_START
tokens, as mlx-lm's generate does with kv_bits set (its default quantized_kv_start): a
shorter context stays at full precision, so the planner counts that too.

Pure arithmetic; the choices of bits are a protocol limit (core/protocol.KV_BITS_CHOICES).
"""
from __future__ import annotations

KV_GROUP_SIZE = 64
"""Values sharing one scale and bias (mlx-lm's kv_group_size default)."""
QUANTIZED_KV_START = 5000
"""Tokens a request's cache holds before it is quantized (mlx-lm's DEFAULT_QUANTIZED_KV_START)."""
KV_DTYPE_BYTES = 2
"""The full-precision cache's bytes per value: models serve in bfloat16 or float16."""


def quantized_bytes(full: int, bits: int) -> int:
    """One token's KV bytes in one layer at `bits`, from its full-precision bytes: the
    values at bits/16 of their size, plus a 16-bit scale and bias per group."""
    values = full // KV_DTYPE_BYTES
    groups = -(-values // KV_GROUP_SIZE)
    return -(-values * bits // 8) + groups * 2 * KV_DTYPE_BYTES


def kv_bytes_per_token(full: int, bits: int, context_tokens: int) -> int:
    """KV bytes per token per layer the planner reserves for a `context_tokens` context:
    `full` with no quantization (bits 0); else the larger of the full-precision cache just
    before it is quantized (QUANTIZED_KV_START tokens, fewer for a shorter context) and the
    quantized cache of the whole context, spread over its tokens."""
    if not bits or context_tokens < 1:
        return full
    peak = max(full * min(context_tokens, QUANTIZED_KV_START), quantized_bytes(full, bits) * context_tokens)
    return -(-peak // context_tokens)
