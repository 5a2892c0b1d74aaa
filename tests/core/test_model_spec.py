"""core/model_spec.py: the sizes of a model from its config and tensor sizes, which tensors a
stage needs, and safetensors header parsing (pure; no files, no MLX)."""
from __future__ import annotations

import json

import pytest

from p2pmesh.core.model_spec import ModelSpecError, layer_index, model_spec, parse_safetensors_header, stage_tensors

CONFIG = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
LAYER = {"input_layernorm.weight": 128, "self_attn.q_proj.weight": 8192, "self_attn.k_proj.weight": 4096,
         "self_attn.v_proj.weight": 4096, "self_attn.o_proj.weight": 8192, "mlp.up_proj.weight": 16384}
TENSORS = {
    "model.embed_tokens.weight": 64_000,
    "model.norm.weight": 128,
    "lm_head.weight": 64_000,
    **{f"model.layers.{i}.{k}": v for i in range(3) for k, v in LAYER.items()},
}


def test_sizes() -> None:
    spec = model_spec(CONFIG, TENSORS)
    assert spec.layers == 3 and spec.layer_bytes == sum(LAYER.values())
    assert (spec.embed_bytes, spec.head_bytes, spec.norm_bytes) == (64_000, 64_000, 128)
    assert spec.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2  # k and v, 2 kv heads of 16, bf16
    assert spec.activation_bytes == 64 * 2
    assert spec.total_bytes == sum(TENSORS.values())
    tied = model_spec({**CONFIG, "tie_word_embeddings": True, "torch_dtype": "float32"}, TENSORS)
    assert tied.head_bytes == 0 and tied.tied and tied.activation_bytes == 256
    with pytest.raises(ModelSpecError, match=r"no tensors for layers \[2\]"):
        model_spec(CONFIG, {k: v for k, v in TENSORS.items() if layer_index(k) != 2})
    with pytest.raises(ModelSpecError):
        model_spec({"model_type": "llama"}, TENSORS)


def test_stage_tensors() -> None:
    middle = stage_tensors(TENSORS, 1, 2, 3, tied=False)
    assert middle == {f"model.layers.1.{k}" for k in LAYER}
    assert stage_tensors(TENSORS, 0, 1, 3, tied=False) == {f"model.layers.0.{k}" for k in LAYER} | {"model.embed_tokens.weight"}
    last = stage_tensors(TENSORS, 2, 3, 3, tied=False) - {f"model.layers.2.{k}" for k in LAYER}
    assert last == {"model.norm.weight", "lm_head.weight"}
    # Tied: the last stage needs the embeddings as its head, and not a shipped lm_head.
    last_tied = stage_tensors(TENSORS, 2, 3, 3, tied=True) - {f"model.layers.2.{k}" for k in LAYER}
    assert last_tied == {"model.norm.weight", "model.embed_tokens.weight"}
    assert len(stage_tensors(TENSORS, 0, 3, 3, tied=False)) == len(TENSORS)
    with pytest.raises(ValueError):
        stage_tensors(TENSORS, 2, 2, 3, tied=False)


def header(obj: object) -> bytes:
    raw = json.dumps(obj).encode()
    return len(raw).to_bytes(8, "little") + raw


def test_safetensors_header() -> None:
    raw = header({
        "__metadata__": {"format": "mlx"},
        "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "F32", "shape": [], "data_offsets": [12, 16]},
    })
    data_start, entries = parse_safetensors_header(raw + b"\0" * 16)
    assert data_start == len(raw)  # the 8-byte length plus the JSON
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in entries] == [("a", "BF16", (2, 3), 12), ("b", "F32", (), 4)]
    for bad in [b"\x01", header([1]), header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}),
                header({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}), header({"a": {"shape": [1]}}),
                (10**9).to_bytes(8, "little")]:
        with pytest.raises(ModelSpecError):
            parse_safetensors_header(bad)


def test_moe_and_mla_sizes() -> None:
    """A mixture of experts: a token reads the rest of a layer and top_k / experts of its routed
    experts (not the shared ones); MLA caches its latent; a sliding window caps a layer's cache
    at a given context (issue 17)."""
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    experts = {f"model.layers.1.mlp.experts.{e}.up_proj.weight": 1000 for e in range(8)}
    tensors = {"model.embed_tokens.weight": 500, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": 300,
               "model.layers.0.mlp.up_proj.weight": 700, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": 300,
               "model.layers.1.mlp.shared_experts.up_proj.weight": 200, **experts}
    spec = model_spec(config, tensors)
    assert spec.layer_bytes == 300 + 200 + 8000
    assert spec.split.active_layer_bytes == -(-(1000 + 300 + 200 + 2000) // 2)
    assert spec.kv_bytes_per_token_per_layer == (32 + 16) * 2
    assert spec.split.attention_bytes == 300
    assert model_spec(CONFIG, TENSORS).split.active_layer_bytes == 0  # dense
    assert model_spec(CONFIG, TENSORS).split.attention_bytes == 8192 + 4096 + 4096 + 8192
    sliding = {**CONFIG, "layer_types": ["sliding_attention", "full_attention", "full_attention"], "sliding_window": 8}
    full = 2 * 2 * 16 * 2
    assert model_spec(sliding, TENSORS).kv_bytes_per_token_per_layer == full
    assert model_spec(sliding, TENSORS, context_tokens=64).kv_bytes_per_token_per_layer == -(-(full * (8 + 64 + 64)) // (3 * 64))
    with pytest.raises(ModelSpecError, match="num_experts_per_tok"):
        model_spec({**config, "num_experts_per_tok": None}, tensors)
