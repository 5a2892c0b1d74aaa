"""What a model costs, from its Hugging Face config.json alone (`p2pmesh plan model`, issue 17).

Owns the parameter count of every decoder layer as mlx-lm builds it (attention, dense MLP or
router + every routed expert + shared experts), the embeddings and head, and from them, for a
quantization: the memory of all weights (every expert), the bytes one decoded token reads
(attention, shared experts, ``num_experts_per_tok`` routed experts, dense layers, the head),
and the KV cache per token as the family's real cache holds it (MLA's compressed latent,
sliding windows capped at the window). Nothing is downloaded: the numbers come before the
weights do, so a cluster can be planned first (docs/placement.md, "Plan before you download").

Families: llama, mistral, qwen2/3, qwen2_moe/qwen3_moe, mixtral, deepseek_v2/v3, kimi_k2,
glm4_moe, gpt_oss, gemma3, phi3, minimax and any config with the same keys; the keys each
reads are named where they are read. Checked against published counts (Mixtral 8x7B, Qwen3-
235B-A22B, DeepSeek-V3, gpt-oss-120b, Llama-3-70B: tests/test_plan_model.py).

Quantization is MLX's affine scheme: ``bits`` 16 is bf16 (2 bytes a weight); 2-8 bits store
bits/8 bytes a weight plus a scale and a bias (bf16) per group of GROUP_SIZE weights. Every
matrix is quantized (linear layers, experts, embeddings, head); vectors (norms, biases,
sinks) and a MoEGate's bare weight array stay in the compute dtype. MLPs are gated (SwiGLU:
gate, up and down projections), as in every family above.

Pure: no I/O; only p2pmesh.core imports.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pmesh.core.config_shape import (ModelSizeError, cache_elements, config_int, kv_bytes, kv_per_token_per_layer,
                                       kv_quantizable, routed_experts, windows)
from p2pmesh.core.model_spec import CONFIG_DTYPE_BYTES, DEFAULT_ACTIVATION_BYTES, is_tied, split_shape, text_config

BITS = (2, 3, 4, 5, 6, 8, 16)
GROUP_SIZE = 64
"""MLX's default quantization group (mlx_lm.convert --q-group-size)."""
QK_NORM_FAMILIES = ("qwen3", "gemma3")
"""Families whose attention always normalises queries and keys (others say use_qk_norm)."""
FOUR_NORM_FAMILIES = ("gemma2", "gemma3")
"""Families with a norm before and after both the attention and the MLP (four a layer)."""
ROUTER_BIAS_FAMILIES = frozenset({"gpt_oss", "glm4_moe", "deepseek_v3", "deepseek_v32", "kimi_k2"})
"""Routers with a bias per expert (gpt-oss's linear bias; e_score_correction_bias)."""
GATE_ARRAY_FAMILIES = frozenset({"deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe",
                                 "glm4_moe_lite"})
"""Families whose router (MoEGate) holds its weight as a bare array (mlx-lm's models)."""



@dataclass(frozen=True, slots=True)
class Params:
    """A parameter count split as quantization treats it: matrix weights and vectors."""

    matrix: int = 0
    vector: int = 0

    def __add__(self, other: Params) -> Params:
        return Params(self.matrix + other.matrix, self.vector + other.vector)

    def times(self, n: int) -> Params:
        return Params(self.matrix * n, self.vector * n)

    @property
    def count(self) -> int:
        return self.matrix + self.vector

    def nbytes(self, bits: int, dtype_bytes: int = DEFAULT_ACTIVATION_BYTES) -> int:
        """Bytes at ``bits`` per matrix weight (module comment), vectors in the compute dtype."""
        if bits == 16:
            weights = self.matrix * 2
        else:  # bits/8 a weight + a bf16 scale and a bf16 bias per group of GROUP_SIZE weights
            weights = -(-self.matrix * bits // 8) + -(-self.matrix // GROUP_SIZE) * 2 * 2
        return weights + self.vector * dtype_bytes


@dataclass(frozen=True, slots=True)
class LayerSize:
    """One decoder layer: what every token reads (attention, norms, a dense MLP or the router and
    shared experts) and its routed experts, of which a token reads experts_per_token."""

    attention: Params
    always: Params  # norms, dense MLP, or router + shared experts
    expert: Params  # one routed expert (zero in a dense layer)
    experts: int
    experts_per_token: int
    kv_elements: int  # cache elements one token adds (keys and values, all heads)
    window: int  # cached tokens at most (sliding window); 0 = the whole context

    @property
    def total(self) -> Params:
        return self.attention + self.always + self.expert.times(self.experts)

    @property
    def active(self) -> Params:
        return self.attention + self.always + self.expert.times(min(self.experts_per_token, self.experts))


@dataclass(frozen=True, slots=True)
class ModelSize:
    model_type: str
    layers: tuple[LayerSize, ...]
    embed: Params
    head: Params  # zero when tied to the embeddings
    final_norm: Params
    hidden_size: int
    experts: int
    experts_per_token: int
    dtype_bytes: int  # compute dtype: activations, KV cache, unquantized vectors
    default_bits: int  # config.json's own "quantization" (an MLX checkpoint), else 16

    @property
    def total_params(self) -> int:
        return sum(layer.total.count for layer in self.layers) + self.embed.count + self.head.count + self.final_norm.count

    @property
    def active_params(self) -> int:
        """Parameters one token uses, counted as the bytes it reads: the layers' active part and
        the head (the tied embeddings when there is none), not the embedding table (one row)."""
        return sum(layer.active.count for layer in self.layers) + (self.head.count or self.embed.count)

    def layer_bytes(self, bits: int) -> int:
        """The largest layer (the planner holds whole layers of one size)."""
        return max(layer.total.nbytes(bits, self.dtype_bytes) for layer in self.layers)

    def active_layer_bytes(self, bits: int) -> int:
        """Weights one token reads in a layer, on average over the layers (rounded up)."""
        total = sum(layer.active.nbytes(bits, self.dtype_bytes) for layer in self.layers)
        return -(-total // len(self.layers))

    def attention_bytes(self, bits: int) -> int:
        """A layer's attention weights (what a tensor group splits by heads), the largest."""
        return max(layer.attention.nbytes(bits, self.dtype_bytes) for layer in self.layers)

    def embed_bytes(self, bits: int) -> int:
        """What the first or the last stage holds besides its layers: the embeddings (a tied
        head is the same table) or the head, and the final norm."""
        return max(self.embed.nbytes(bits, self.dtype_bytes), self.head.nbytes(bits, self.dtype_bytes)) + \
            self.final_norm.nbytes(bits, self.dtype_bytes)

    def total_bytes(self, bits: int) -> int:
        """All weights, every expert included."""
        return (sum(layer.total.nbytes(bits, self.dtype_bytes) for layer in self.layers)
                + self.embed.nbytes(bits, self.dtype_bytes) + self.head.nbytes(bits, self.dtype_bytes)
                + self.final_norm.nbytes(bits, self.dtype_bytes))

    def active_bytes_per_token(self, bits: int) -> int:
        """Weights one decoded token reads: every layer's active part, the head (or the tied
        embeddings) and one embedding row."""
        head = self.head.nbytes(bits, self.dtype_bytes) if self.head.count else self.embed.nbytes(bits, self.dtype_bytes)
        return (sum(layer.active.nbytes(bits, self.dtype_bytes) for layer in self.layers)
                + head + self.hidden_size * self.dtype_bytes + self.final_norm.nbytes(bits, self.dtype_bytes))

    def cache_layout(self) -> tuple[tuple[int, int], ...]:
        """(cache elements per token, window) per layer (core/config_shape.kv_bytes)."""
        return tuple((layer.kv_elements, layer.window) for layer in self.layers)

    def kv_bytes(self, context_tokens: int) -> int:
        """The full-precision KV cache of one sequence of ``context_tokens`` over all layers (a
        sliding layer holds its window at most; config_shape.kv_bytes)."""
        return kv_bytes(self.cache_layout(), context_tokens, self.dtype_bytes)

    def kv_bytes_per_token_per_layer(self, context_tokens: int) -> int:
        """kv_bytes / (context_tokens x layers), rounded up: what the planner multiplies by
        layers and context again (never less than the real cache)."""
        return kv_per_token_per_layer(self.cache_layout(), context_tokens, self.dtype_bytes)


def kv_bytes_per_token_per_layer(config: Mapping[str, Any], context_tokens: int) -> int:
    """The planner's full-precision KV bytes per token per layer for a config.json at a
    context (the family's real cache). With `load --kv-bits`, core/kv_quant.kv_bytes_per_token
    scales it where config_shape.kv_quantizable says mlx-lm can. ModelSizeError on a bad config."""
    return model_size(config).kv_bytes_per_token_per_layer(context_tokens)


# --- reading config.json -------------------------------------------------------------------


def _attention(c: Mapping[str, Any], model_type: str, h: int, heads: int) -> Params:
    """The attention parameters of one layer."""
    if c.get("kv_lora_rank"):  # MLA (deepseek_v2/v3, kimi_k2, glm4_moe_lite ...)
        kv_rank = config_int(c, "kv_lora_rank")
        rope = config_int(c, "qk_rope_head_dim")
        nope = config_int(c, "qk_nope_head_dim", lo=0)
        v_dim = config_int(c, "v_head_dim")
        q_dim = heads * (nope + rope)
        q_rank = config_int(c, "q_lora_rank", default=0, lo=0)
        q = Params(h * q_rank + q_rank * q_dim, q_rank) if q_rank else Params(h * q_dim)
        kv = Params(h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim), kv_rank)
        o = Params(heads * v_dim * h)
        return q + kv + o
    kv_heads = config_int(c, "num_key_value_heads", default=heads)
    head_dim = config_int(c, "head_dim", default=h // heads)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    bias = bool(c.get("attention_bias") or c.get("qkv_bias")) or model_type in ("qwen2", "qwen2_moe")
    vectors = (q_out + 2 * kv_out) if bias else 0
    if c.get("attention_bias") and model_type == "gpt_oss":
        vectors += h + heads  # o_proj bias and the attention sinks
    if model_type.startswith(QK_NORM_FAMILIES) or c.get("use_qk_norm"):
        # RMSNorm of queries and keys: per head, or over all heads (MiniMax's per_layer norm)
        vectors += (q_out + kv_out) if model_type.startswith("minimax") else 2 * head_dim
    return Params(h * q_out + 2 * h * kv_out + q_out * h, vectors)


def _moe_layers(c: Mapping[str, Any], layers: int) -> list[bool]:
    """Which layers are mixtures of experts (the rest dense), by the family's own keys."""
    dense_first = config_int(c, "first_k_dense_replace", default=0, lo=0)
    only_mlp = set(c.get("mlp_only_layers") or ())
    freq = c.get("moe_layer_freq", 1)
    step = config_int(c, "decoder_sparse_step", default=1) if c.get("decoder_sparse_step") else 1
    interleave = config_int(c, "interleave_moe_layer_step", default=1) if c.get("interleave_moe_layer_step") else 1
    out = []
    for i in range(layers):
        if isinstance(freq, list):
            moe = bool(freq[i]) if i < len(freq) else False
        else:
            moe = i % max(1, int(freq or 1)) == 0
        out.append(moe and i >= dense_first and i not in only_mlp and (i + 1) % step == 0 and (i + 1) % interleave == 0)
    return out


def _gated(h: int, inter: int) -> Params:
    return Params(3 * h * inter)


def model_size(config: Mapping[str, Any]) -> ModelSize:
    """Sizes of the model a config.json describes (module comment); ModelSizeError names the
    field that is missing or bad."""
    if not isinstance(config, Mapping):
        raise ModelSizeError("config", "config.json must be a JSON object")
    c = text_config(config)
    model_type = str(c.get("model_type") or config.get("model_type") or "")
    layers = config_int(c, "num_hidden_layers")
    h = config_int(c, "hidden_size")
    heads = config_int(c, "num_attention_heads")
    vocab = config_int(c, "vocab_size")
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "")
    dtype_bytes = CONFIG_DTYPE_BYTES.get(dtype, DEFAULT_ACTIVATION_BYTES)
    attention = _attention(c, model_type, h, heads)
    cached = cache_elements(c, model_type)
    window = windows(c, model_type, layers)
    experts, top_k = routed_experts(c)
    dense_inter = config_int(c, "intermediate_size_mlp", default=0, lo=0) or config_int(c, "intermediate_size", default=0, lo=0)
    moe = _moe_layers(c, layers) if experts else [False] * layers
    if experts:
        expert_inter = config_int(c, "moe_intermediate_size", default=0, lo=0) or config_int(c, "intermediate_size")
        expert = _gated(h, expert_inter)
        if model_type == "gpt_oss":
            expert = expert + Params(0, 2 * expert_inter + h)  # gate_up and down biases
        routing_bias = (model_type in ROUTER_BIAS_FAMILIES or c.get("topk_method") == "noaux_tc"
                        or bool(c.get("use_routing_bias")))
        bias = experts if routing_bias else 0
        # A MoEGate's weight is a bare array, not a Linear: mlx-lm leaves it unquantized.
        router = Params(0, h * experts + bias) if model_type in GATE_ARRAY_FAMILIES else Params(h * experts, bias)
        shared = Params()
        n_shared = config_int(c, "n_shared_experts", default=0, lo=0) or config_int(c, "num_shared_experts", default=0, lo=0)
        if n_shared:
            shared = _gated(h, expert_inter * n_shared)
        elif c.get("shared_expert_intermediate_size"):
            shared = _gated(h, config_int(c, "shared_expert_intermediate_size")) + Params(h)  # with its sigmoid gate
        elif c.get("shared_intermediate_size"):
            shared = _gated(h, config_int(c, "shared_intermediate_size"))
    if any(not m for m in moe) and not dense_inter:
        raise ModelSizeError("intermediate_size", "config.json lacks 'intermediate_size' for its dense layers")
    norms = Params(0, (4 if model_type.startswith(FOUR_NORM_FAMILIES) else 2) * h)
    sizes = []
    for i in range(layers):
        if moe[i]:
            sizes.append(LayerSize(attention, norms + router + shared, expert, experts, top_k, cached, window[i]))
        else:
            sizes.append(LayerSize(attention, norms + _gated(h, dense_inter), Params(), 0, 0, cached, window[i]))
    quant = c.get("quantization") or config.get("quantization")
    default_bits = 16
    if isinstance(quant, Mapping) and quant.get("bits") in BITS:
        default_bits = int(quant["bits"])
    return ModelSize(
        model_type=model_type,
        layers=tuple(sizes),
        embed=Params(vocab * h),
        head=Params() if is_tied(config) else Params(vocab * h),
        final_norm=Params(0, h),
        hidden_size=h,
        experts=experts,
        experts_per_token=top_k,
        dtype_bytes=dtype_bytes,
        default_bits=default_bits,
    )


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ModelSizeError("bits", f"bits must be one of {', '.join(map(str, BITS))}, not {bits}")
    return bits


def planner_model(config: Mapping[str, Any], bits: int | None = None, context_tokens: int = 4096) -> dict[str, Any]:
    """The model block of a `plan solve` scenario (core/placement.parse_scenario reads it) for a
    config.json at ``bits`` (default: the checkpoint's own quantization, else 16) and a context,
    with the sizes a person checks beside it (total and active bytes and parameters, experts)."""
    size = model_size(config)
    bits = check_bits(size.default_bits if bits is None else bits)
    if not 0 <= context_tokens <= 1 << 30:
        raise ModelSizeError("context_tokens", f"context_tokens must be in [0, 2^30], not {context_tokens}")
    block: dict[str, Any] = {
        "model_type": size.model_type,
        "bits": bits,
        "layers": len(size.layers),
        "layer_bytes": size.layer_bytes(bits),
        "active_layer_bytes": size.active_layer_bytes(bits),
        "attention_bytes": size.attention_bytes(bits),
        "total_bytes": size.total_bytes(bits),
        "active_bytes_per_token": size.active_bytes_per_token(bits),
        "total_params": size.total_params,
        "active_params": size.active_params,
        "experts": size.experts,
        "experts_per_token": size.experts_per_token,
        "kv_bytes_per_token_per_layer": size.kv_bytes_per_token_per_layer(context_tokens),
        "kv_quantizable": kv_quantizable(text_config(config), size.model_type),
        "context_tokens": context_tokens,
        "activation_bytes": size.hidden_size * size.dtype_bytes,
        "embed_bytes": size.embed_bytes(bits),
    }
    # The shape a tensor group splits, as the cluster reads it (all four, or none).
    split = split_shape(text_config(config))
    if split.known:
        block.update(num_attention_heads=split.num_attention_heads, num_key_value_heads=split.num_key_value_heads,
                     intermediate_size=split.intermediate_size, hidden_size=split.hidden_size,
                     even_split=split.even_split)
    return block


def billions(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


__all__ = [
    "BITS", "GROUP_SIZE", "LayerSize", "ModelSize", "ModelSizeError", "Params", "billions", "check_bits", "gigabytes",
    "kv_bytes_per_token_per_layer", "kv_quantizable", "model_size", "planner_model",
]
