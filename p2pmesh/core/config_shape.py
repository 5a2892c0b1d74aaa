"""Reading a Hugging Face config.json's shape: its integer fields (a bad one is named), the KV
cache each decoder layer keeps as the family's mlx-lm cache does (per-head keys and values,
MLA's compressed latent, a sliding window's cap), and the routed experts a layer has and a
token uses. core/model_spec.py (sizes from a checkpoint) and core/model_size.py (sizes from
config.json alone, issue 17) both read config.json through here.

Pure: no I/O; no imports from p2pmesh.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

LATENT_CACHE_FAMILIES = frozenset({
    "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "joyai_llm_flash", "glm4_moe_lite", "longcat_flash",
})
"""MLA families whose mlx-lm attention caches the compressed latent (kv_lora_rank) and the
shared rotary key (qk_rope_head_dim) instead of per-head keys and values; deepseek_v2 and
minicpm3 decompress first and cache full heads."""
SLIDING_FAMILIES_BY_PATTERN = ("gemma3",)
"""Families whose mlx-lm model alternates sliding and full layers by sliding_window_pattern
(every pattern-th layer full) when config.json has no layer_types."""
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_top_k")


class ModelSizeError(ValueError):
    """config.json lacks a field the sizing needs, or has a bad value; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def config_int(c: Mapping[str, Any], key: str, *, default: int | None = None, lo: int = 1) -> int:
    """An integer field >= lo; ``default`` when absent (ModelSizeError when there is none)."""
    raw = c.get(key)
    if raw is None:
        if default is None:
            raise ModelSizeError(key, f"config.json lacks {key!r}")
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw != int(raw) or int(raw) < lo:
        raise ModelSizeError(key, f"config.json field {key!r} must be an integer >= {lo}, not {raw!r}")
    return int(raw)


def first_int(c: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, int]:
    """The first of ``keys`` the config has, and its value (families name a field differently);
    (keys[0], 0) when it has none."""
    for key in keys:
        if c.get(key) is not None:
            return key, config_int(c, key, lo=0)
    return keys[0], 0


def routed_experts(c: Mapping[str, Any]) -> tuple[int, int]:
    """(routed experts of an MoE layer, those a token uses); (0, 0) for a dense model."""
    _, experts = first_int(c, EXPERT_KEYS)
    top_key, top_k = first_int(c, TOP_K_KEYS)
    if experts and not top_k:
        raise ModelSizeError(top_key, f"config.json names {experts} experts but not how many a token uses ({top_key})")
    return experts, min(top_k, experts)


def cache_elements(c: Mapping[str, Any], model_type: str) -> int:
    """Values one token adds to a layer's cache (keys and values of every KV head, or MLA's
    latent and rotary key)."""
    hidden, heads = config_int(c, "hidden_size"), config_int(c, "num_attention_heads")
    if c.get("kv_lora_rank"):
        kv_rank, rope = config_int(c, "kv_lora_rank"), config_int(c, "qk_rope_head_dim")
        if model_type in LATENT_CACHE_FAMILIES:
            return kv_rank + rope
        return heads * (config_int(c, "qk_nope_head_dim", lo=0) + rope + config_int(c, "v_head_dim"))
    kv_heads = config_int(c, "num_key_value_heads", default=heads)
    return 2 * kv_heads * config_int(c, "head_dim", default=hidden // heads)


def windows(c: Mapping[str, Any], model_type: str, layers: int) -> list[int]:
    """Per layer, the tokens its cache holds at most (0: all), as mlx-lm's make_cache builds it:
    layer_types' sliding layers (gpt-oss, llama with layer_types ...), gemma3's pattern."""
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) < layers:
            raise ModelSizeError("layer_types", f"config.json's layer_types has {len(types)} entries for {layers} layers")
        if "sliding_attention" in types[:layers] and not window:
            raise ModelSizeError("sliding_window", "config.json has sliding_attention layers but no sliding_window")
        return [config_int(c, "sliding_window") if t == "sliding_attention" else 0 for t in types[:layers]]
    if model_type == "gpt_oss" and window:  # mlx-lm's default: sliding and full alternating
        return [config_int(c, "sliding_window") if i % 2 == 0 else 0 for i in range(layers)]
    if model_type.startswith(SLIDING_FAMILIES_BY_PATTERN) and window:
        pattern = config_int(c, "sliding_window_pattern", default=6)
        return [0 if i % pattern == pattern - 1 else config_int(c, "sliding_window") for i in range(layers)]
    return [0] * layers


def cache_layout(c: Mapping[str, Any], model_type: str, layers: int) -> list[tuple[int, int]]:
    """(cache elements per token, window) of each layer (kv_bytes reads it)."""
    elements = cache_elements(c, model_type)
    return [(elements, w) for w in windows(c, model_type, layers)]


KV_SINK_FAMILIES = frozenset({"gpt_oss", "deepseek_v41", "mimo_v2_flash"})
"""mlx-lm families whose attention has sinks (quantized_scaled_dot_product_attention refuses them)."""


def kv_quant_problem(config: Mapping[str, Any]) -> str | None:
    """Why mlx-lm cannot quantize any of this model's caches (`load --kv-bits`), or None:
    MLA's latent cache (its attention reads the latent itself) or an attention with sinks.
    The agent refuses kv_bits for such a model; the worker says the same if asked anyway."""
    text = config.get("text_config", config)
    family = str(text.get("model_type") or config.get("model_type") or "")
    if text.get("kv_lora_rank") or config.get("kv_lora_rank"):
        return f"{family} caches MLA's compressed latent, which its attention reads with plain matmuls"
    if family in KV_SINK_FAMILIES or config.get("model_type") in KV_SINK_FAMILIES:
        return f"{family}'s attention has sinks, which mlx-lm's quantized attention does not support"
    return None


def kv_quantizable(c: Mapping[str, Any], model_type: str) -> bool:
    """Whether mlx-lm can quantize this family's full-attention caches (kv_quant_problem; a
    sliding layer's rotating cache never is)."""
    return kv_quant_problem({**c, "model_type": model_type}) is None


def kv_bytes(layout: Sequence[tuple[int, int]], context_tokens: int, dtype_bytes: int) -> int:
    """The KV cache of one sequence of ``context_tokens`` over layers given as (elements per
    token, window): a sliding layer holds its window at most (mlx-lm's RotatingKVCache)."""
    return sum((min(context_tokens, window) if window else context_tokens) * elements * dtype_bytes
               for elements, window in layout)


def kv_per_token_per_layer(layout: Sequence[tuple[int, int]], context_tokens: int, dtype_bytes: int) -> int:
    """kv_bytes / (context_tokens x layers), rounded up: what the planner multiplies by layers
    and context again (never less than the real cache)."""
    tokens = max(1, context_tokens)
    return -(-kv_bytes(layout, tokens, dtype_bytes) // (tokens * len(layout)))
