"""core/model_size (sizing from config.json alone, issue 17) against mlx-lm's own model classes,
one tiny config per family: the parameter count of the model mlx-lm builds, its bytes once
quantized by MLX (bf16, then 4 and 8 bits with groups of 64), and the KV cache mlx-lm's own
cache holds after a prompt and a decode step (MLA's latent, sliding windows, full layers)."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

from p2pmesh.core.model_size import model_size

H, VOCAB, WINDOW = 128, 512, 16
BASE: dict[str, Any] = {"hidden_size": H, "vocab_size": VOCAB, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 10000.0}
MOE_ROUTING = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2, "intermediate_size": 256, "tie_word_embeddings": False},
    "qwen2": {"num_hidden_layers": 2, "intermediate_size": 256, "tie_word_embeddings": True},
    "qwen3": {"num_hidden_layers": 2, "intermediate_size": 256, "head_dim": 64, "tie_word_embeddings": True},
    "qwen3_moe": {"num_hidden_layers": 2, "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 64,
                  "tie_word_embeddings": False, "norm_topk_prob": True},
    "mixtral": {"num_hidden_layers": 2, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
    "deepseek_v3": {"num_hidden_layers": 3, "intermediate_size": 256, "moe_intermediate_size": 64,
                    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "moe_layer_freq": 1, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "tie_word_embeddings": False,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", **MOE_ROUTING},
    "gpt_oss": {"num_hidden_layers": 2, "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
                "head_dim": 64, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                "attention_bias": True, "tie_word_embeddings": False},
    "glm4_moe": {"num_hidden_layers": 3, "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 8,
                 "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "head_dim": 64,
                 "tie_word_embeddings": False, "attention_bias": True, "use_qk_norm": True,
                 "partial_rotary_factor": 0.5, "rope_scaling": None, **MOE_ROUTING},
    "gemma3_text": {"num_hidden_layers": 2, "intermediate_size": 256, "num_key_value_heads": 1, "head_dim": 64,
                    "sliding_window": WINDOW, "sliding_window_pattern": 2},
    "phi3": {"num_hidden_layers": 2, "intermediate_size": 256, "tie_word_embeddings": False},
    "minimax": {"num_hidden_layers": 2, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                "head_dim": 64, "rotary_dim": 32, "tie_word_embeddings": False, "use_qk_norm": True,
                "scoring_func": "sigmoid", "use_routing_bias": True, "shared_intermediate_size": 0},
}


def _config(family: str) -> dict[str, Any]:
    return {"model_type": family, **BASE, **FAMILIES[family]}


def _model(config: dict[str, Any], tied: bool) -> nn.Module:
    cls, args = _get_classes(config)
    model = cls(args.from_dict(config))
    if tied and "lm_head" in model:  # gemma3_text drops its head when the checkpoint has none (sanitize)
        model.pop("lm_head")
        model.tie_word_embeddings = True
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameters_and_quantized_bytes_equal_mlx_lms_model(family: str) -> None:
    config = _config(family)
    size = model_size(config)
    tied = size.head.count == 0
    model = _model(config, tied)
    assert size.total_params == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert size.total_bytes(16) == sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for bits in (4, 8):
        model = _model(config, tied)
        nn.quantize(model, group_size=64, bits=bits)
        assert size.total_bytes(bits) == sum(v.nbytes for _, v in tree_flatten(model.parameters())), bits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kv_bytes_equal_mlx_lms_own_cache(family: str) -> None:
    """A prompt longer than the window, then one decode step (a rotating cache trims to its
    window on the next step): the bytes mlx-lm's caches hold for the tokens seen."""
    config = _config(family)
    size = model_size(config)
    model = _model(config, size.head.count == 0)
    cache = make_prompt_cache(model)
    prompt = 3 * WINDOW
    model(mx.array([[i % VOCAB for i in range(prompt)]]), cache=cache)
    model(mx.array([[1]]), cache=cache)
    held = 0
    for c in cache:  # caches grow in steps: count the tokens they hold, at the bytes per token of their arrays
        tokens = min(c.offset, c.max_size) if isinstance(c, RotatingKVCache) else c.offset
        held += tokens * (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
    assert held == size.kv_bytes(prompt + 1)
    if family in ("gpt_oss", "gemma3_text"):  # a sliding layer holds its window, a full one everything
        assert [layer.window for layer in size.layers] == [WINDOW, 0]
        assert [c.max_size if isinstance(c, RotatingKVCache) else 0 for c in cache] == [WINDOW, 0]
