"""What a model in the Hugging Face layout costs, and which tensors a pipeline stage needs.

Owns the pure arithmetic over a parsed config.json and the tensor names and sizes of its
safetensors files: the size of one decoder layer, of the embeddings and the head, the KV
cache per token per layer, the activation that crosses a hop per token, and which
checkpoint tensors belong to a stage [start, end) of the layers. Also parses a safetensors
header (bytes in, entries out). The worker reads the files; the planner (agent side) can
call the same functions with what it read, without MLX.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pmesh.core.config_shape import ModelSizeError, cache_layout, kv_per_token_per_layer, routed_experts
from p2pmesh.core.split_shape import SplitShape

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A decoder layer's tensors are named "...layers.<i>.<...>" (model.layers.3.mlp.up_proj.weight)."""

SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
CONFIG_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DEFAULT_ACTIVATION_BYTES = 2
"""Checkpoints without torch_dtype are nearly always half precision."""
MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on the JSON header."""


class ModelSpecError(ValueError):
    """config.json or a safetensors header is malformed or inconsistent: the checkpoint's fault."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype code, shape and byte range of its data,
    relative to the start of the data section (after the 8-byte length and the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes in bytes, computed from config.json and the checkpoint's tensor sizes."""

    layers: int
    hidden_size: int
    layer_bytes: int
    """The largest decoder layer (layers are usually identical)."""
    embed_bytes: int
    head_bytes: int
    """lm_head; 0 when the head is tied to the embeddings."""
    norm_bytes: int
    """The final norm and any other non-layer tensor besides embeddings and head."""
    kv_bytes_per_token_per_layer: int
    activation_bytes: int
    """Hidden state of one token as it crosses a hop."""
    tied: bool
    total_bytes: int
    split: SplitShape = SplitShape()
    """The shape a tensor group splits (unknown when config.json does not say it, it does
    not divide, or the workers do not split the family: ``split_shape``), what one token
    reads of a layer, and the largest layer's attention tensors (ATTENTION_TENSOR_RE)."""


ATTENTION_TENSOR_RE = re.compile(r"\.(?:self_attn|attention|attn)\.")
"""A layer's attention tensors: "...layers.3.self_attn.q_proj.weight" (most families),
"...attention..." / "...attn..." (a few)."""
EXPERT_TENSOR_RE = re.compile(r"\.(?:experts|switch_mlp)\.")
"""A routed expert's tensors: "...mlp.experts.3.up_proj.weight" (Hugging Face), "...mlp.
switch_mlp.up_proj.weight" (mlx-lm's stacked experts), "...block_sparse_moe.experts.0.w1"
(Mixtral), "...mlp.experts.gate_up_proj" (gpt-oss); not "shared_experts"."""


def layer_index(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, or None (embeddings, norm, head)."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def is_embedding(name: str) -> bool:
    return layer_index(name) is None and "embed_tokens" in name


def is_head(name: str) -> bool:
    return layer_index(name) is None and name.split(".")[0] == "lm_head"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of the config (multimodal checkpoints nest it)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, Mapping) else config


def is_tied(config: Mapping[str, Any]) -> bool:
    """mlx-lm's default for llama and qwen2 is a tied head when the config does not say."""
    return bool(text_config(config).get("tie_word_embeddings", True))


def stage_tensors(names: Iterable[str], start: int, end: int, num_layers: int, tied: bool) -> set[str]:
    """The checkpoint tensors a stage holding layers [start, end) of num_layers needs: its
    layers; the embeddings if it is the first stage, or the last with a tied head; the final
    norm and lm_head (unless tied: a tied checkpoint may still ship one, which mlx-lm drops) if it
    is the last stage. Nothing else: the other layers never load."""
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"stage [{start}, {end}) is not a non-empty range of the {num_layers} layers")
    first, last = start == 0, end == num_layers
    needed: set[str] = set()
    for name in names:
        i = layer_index(name)
        parts = name.split(".")
        if i is not None:
            if start <= i < end:
                needed.add(name)
        elif is_embedding(name) or not STAGE_EMBED_NAMES.isdisjoint(parts):
            if first or (last and tied):
                needed.add(name)
        elif last and not (tied and parts[0] in STAGE_HEAD_NAMES):  # the final norm; the head unless tied
            needed.add(name)
    return needed


STAGE_EMBED_NAMES = frozenset({"embed_tokens", "tok_embeddings", "word_embeddings", "wte"})
"""What mlx-lm families call the token embeddings (internlm2: tok_embeddings, bailing: word_embeddings)."""
STAGE_HEAD_NAMES = frozenset({"lm_head", "output"})
"""What mlx-lm families call an untied head (internlm2: output)."""


def parse_safetensors_header(prefix: bytes) -> tuple[int, list[TensorEntry]]:
    """(data offset, entries) from the start of a safetensors file: an 8-byte little-endian
    header length, then that many bytes of JSON. `prefix` must hold at least 8 + length bytes."""
    if len(prefix) < 8:
        raise ModelSpecError("safetensors file shorter than its 8-byte header length")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise ModelSpecError(f"safetensors header of {n} bytes is too large or truncated")
    try:
        header = json.loads(prefix[8 : 8 + n])
    except ValueError as e:
        raise ModelSpecError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ModelSpecError("safetensors header is not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelSpecError(f"safetensors entry {name!r} lacks dtype, shape or data_offsets") from None
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise ModelSpecError(f"tensor {name!r} has unknown dtype {dtype!r}")
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end or end - begin != count * SAFETENSORS_DTYPE_BYTES[dtype]:
            raise ModelSpecError(f"tensor {name!r}: data_offsets [{begin}, {end}) do not fit {dtype}{list(shape)}")
        entries.append(TensorEntry(name, dtype, shape, int(begin), int(end)))
    return 8 + n, entries


def model_spec(config: Mapping[str, Any], tensor_bytes: Mapping[str, int], *, activation_dtype_bytes: int | None = None,
               context_tokens: int | None = None) -> ModelSpec:
    """Sizes of the model named by `config` (parsed config.json) whose checkpoint holds
    `tensor_bytes` (tensor name -> bytes, over all safetensors files).

    The KV cache and the activations are in the model's compute dtype (torch_dtype, or
    `activation_dtype_bytes` when the caller knows better, e.g. a quantized checkpoint
    computing in float16). The KV cache is the family's real one (core/config_shape.py: MLA's
    latent, sliding windows); a sliding layer counts its window only at a given
    ``context_tokens`` (the average over layers), else as if it held every token."""
    c = text_config(config)
    try:
        layers = int(c["num_hidden_layers"])
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise ModelSpecError("config.json lacks num_hidden_layers, hidden_size or num_attention_heads") from None
    if min(layers, hidden, heads) < 1:
        raise ModelSpecError("config.json's num_hidden_layers, hidden_size and num_attention_heads must be positive")
    dtype_bytes = activation_dtype_bytes or CONFIG_DTYPE_BYTES.get(
        str(c.get("torch_dtype") or c.get("dtype") or ""), DEFAULT_ACTIVATION_BYTES
    )
    per_layer = [0] * layers
    routed = [0] * layers  # routed experts' bytes in each layer
    attention = [0] * layers
    embed = head = norm = 0
    for name, nbytes in tensor_bytes.items():
        i = layer_index(name)
        if i is not None:
            if i < layers:  # extra layers (MTP) are dropped by mlx-lm's sanitize
                per_layer[i] += nbytes
                if EXPERT_TENSOR_RE.search(name):
                    routed[i] += nbytes
                elif ATTENTION_TENSOR_RE.search(name):
                    attention[i] += nbytes
        elif is_embedding(name):
            embed += nbytes
        elif is_head(name):
            head += nbytes
        else:
            norm += nbytes
    missing = [i for i, b in enumerate(per_layer) if b == 0]
    if missing:
        raise ModelSpecError(f"the checkpoint has no tensors for layers {missing[:8]}{'...' if len(missing) > 8 else ''}")
    tied = is_tied(config)
    if tied:
        head = 0  # a tied checkpoint may still ship lm_head.weight; mlx-lm drops it
    model_type = str(c.get("model_type") or "")
    try:
        layout = cache_layout(c, model_type, layers)
        experts, top_k = routed_experts(c)
        if context_tokens is None:  # every layer as if it held every token
            layout = [(elements, 0) for elements, _ in layout]
        kv = kv_per_token_per_layer(layout, context_tokens or 1, dtype_bytes)
    except ModelSizeError as exc:
        raise ModelSpecError(str(exc)) from None
    active = 0
    if experts and any(routed):  # a token reads top_k of each layer's experts (the rest: all)
        active = -(-sum(b - r + -(-r * top_k // experts) for b, r in zip(per_layer, routed)) // layers)
    return ModelSpec(
        layers=layers,
        hidden_size=hidden,
        layer_bytes=max(per_layer),
        embed_bytes=embed,
        head_bytes=head,
        norm_bytes=norm,
        kv_bytes_per_token_per_layer=kv,
        activation_bytes=hidden * dtype_bytes,
        tied=tied,
        total_bytes=sum(per_layer) + embed + head + norm,
        split=split_shape(c, active, min(max(attention), active or max(per_layer))),
    )


TENSOR_SPLITS: dict[str, str] = {
    "llama": "uneven", "qwen2": "uneven", "qwen3": "uneven", "qwen3_moe": "uneven", "glm4_moe": "uneven",
    "deepseek_v3": "even", "gpt_oss": "even",
}
"""The families whose layers the workers split over a tensor group (worker/tensor.py, which
imports this table), and how: "uneven" shares by speed (the workers' own sharding), or
"even" only (mlx-lm's shard(): MLA attention and gpt-oss's attention have no per-head
projections to cut unevenly). Another family plans one Mac or a pipeline only."""
TENSOR_REMAPPING: dict[str, str] = {
    "mistral": "llama", "iquestcoder": "llama", "xverse": "llama", "kimi_k2": "deepseek_v3", "joyai_llm_flash": "deepseek_v3",
}
"""model_type -> the mlx-lm module that runs it, for the families above (mlx-lm's own
MODEL_REMAPPING, restricted to them: tests/worker/test_tensor.py checks the two agree)."""


def tensor_split(c: Mapping[str, Any]) -> str | None:
    """"uneven", "even", or None (no tensor plan) for a (text) config's model_type."""
    model_type = str(c.get("model_type", ""))
    return TENSOR_SPLITS.get(TENSOR_REMAPPING.get(model_type, model_type))


def split_shape(c: Mapping[str, Any], active_layer_bytes: int = 0, attention_bytes: int = 0) -> SplitShape:
    """A (text) config's shape as the planner splits it, with the byte counts given: unknown
    (all four 0) when one is missing, they do not divide (hidden size by heads, heads by KV
    heads: the planner's ScenarioError), or the workers do not split this family
    (TENSOR_SPLITS)."""
    bytes_only = SplitShape(active_layer_bytes=active_layer_bytes, attention_bytes=attention_bytes)
    how = tensor_split(c)
    if how is None:
        return bytes_only
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        columns = int(c.get("intermediate_size") or 0)
    except (KeyError, TypeError, ValueError):
        return bytes_only
    if min(hidden, heads, kv, columns) <= 0 or hidden % heads or heads % kv:
        return bytes_only
    return SplitShape(hidden, heads, kv, columns, active_layer_bytes, attention_bytes, even_split=how == "even")
