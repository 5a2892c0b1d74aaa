"""A contiguous range of a model's decoder layers, built from mlx-lm's model classes.

Owns `resolve_model` (a local directory, or a Hugging Face id fetched with
huggingface_hub) and `load_shard`: it builds mlx-lm's model class for the family from
config.json, keeps only layers [start, end) (the others are dropped before anything is
evaluated, so their parameters never allocate), and reads from the safetensors files only
the tensors the stage needs (core/model_spec.stage_tensors): its layers, the embeddings on
the first stage (and on the last when the head is tied), the final norm and lm_head on the
last. `Shard.forward` runs the range with the attention mask built the way mlx-lm's own
models build it, so chaining shards gives the full model's logits.

mlx-lm's own pipeline() exists only for some families (not llama, not dense qwen3) and
splits from the last rank backwards; this module works for every family whose inner model
is embed_tokens / layers / norm (llama and its remaps, qwen2, qwen3).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import MODEL_REMAPPING, _get_classes, infer_quant_config

from p2pmesh.drivers import model_files
from p2pmesh.core.model_spec import LAYER_RE, stage_tensors
from p2pmesh.worker.checkpoint import CheckpointError, locate, read_config, read_tensors

SUPPORTED_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
"""model_type values (after mlx-lm's remapping, so "mistral" counts as llama) whose
layer-range pipeline is tested here."""


class ModelError(Exception):
    """A model cannot be resolved or loaded. Subclasses say whose fault it is."""


class ModelNotFound(ModelError):
    """The name is neither a model directory nor a valid Hugging Face id: the caller's fault."""


class ModelUnavailable(ModelError):
    """A Hugging Face id that cannot be fetched (offline, unknown repository, gated): the
    environment's fault, or the caller's for a wrong id."""


class UnsupportedModel(ModelError):
    """The model's family or format is not one this loader handles: the model's fault."""


class BadStage(ModelError):
    """The layer range does not fit the model: the caller's (planner's) fault."""


def resolve_model(name_or_path: str | Path, *, layers: tuple[int, int] | None = None, metadata_only: bool = False,
                  revision: str | None = None) -> Path:
    """The local directory of a model named by a path or a Hugging Face id.

    A path that exists must hold config.json. Anything else is taken as a Hugging Face id and
    fetched with huggingface_hub (cached under HF_HOME, model_files.py): first the metadata
    (config, tokenizer, index); then nothing more with `metadata_only`, or, when `layers` =
    (start, end) is given and the checkpoint has an index, only the weight files holding that
    stage's tensors, or else every weight file."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} exists but has no config.json: not a Hugging Face model directory")
        return path
    name = str(name_or_path)
    if not model_files.is_hub_id(name):
        raise ModelNotFound(f"{name!r} is not a directory and not a Hugging Face id (owner/name)")
    try:
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        HFValidationError = ValueError  # type: ignore[misc,assignment]  # noqa: N806
    try:
        if metadata_only:
            return model_files.fetch_metadata(name, revision)
        return model_files.fetch_layers(name, layers, revision)
    except HFValidationError as e:
        raise ModelNotFound(f"{name!r} is not a valid Hugging Face id: {e}") from None
    except model_files.HubUnavailable as e:
        raise ModelUnavailable(str(e)) from None
    except (CheckpointError, model_files.ModelFilesError, KeyError, ValueError) as e:
        raise UnsupportedModel(f"{name}: {e}") from None


def family(config: dict[str, Any]) -> str:
    return MODEL_REMAPPING.get(config["model_type"], config["model_type"])


class Shard:
    """Layers [start, end) of a model, with the embeddings and the head where the stage
    needs them. `loaded` names the checkpoint tensors that were read (and nothing else was)."""

    def __init__(self, model: nn.Module, config: dict[str, Any], start: int, end: int, num_layers: int,
                 tied: bool, loaded: frozenset[str], loaded_bytes: int) -> None:
        self.model = model
        self.config = config
        self.start, self.end, self.num_layers = start, end, num_layers
        self.tied = tied
        self.loaded = loaded
        self.loaded_bytes = loaded_bytes
        self._inner = model.model
        self._layers: list[nn.Module] = list(self._inner.layers)
        self._window: int | None = getattr(self._inner, "sliding_window", None)
        self.hidden_size = int(model.args.hidden_size)
        self.vocab_size = int(model.args.vocab_size)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers

    @property
    def layer_count(self) -> int:
        return self.end - self.start

    def make_cache(self) -> list[Any]:
        """One KV cache per local layer (a rotating one for sliding-window layers)."""
        return [
            RotatingKVCache(max_size=self._window) if getattr(layer, "use_sliding", False) else KVCache()
            for layer in self._layers
        ]

    def forward(self, x: mx.array, cache: Sequence[Any] | None = None, *, last_only: bool = False) -> mx.array:
        """Token ids [B, L] (first stage) or hidden states [B, L, hidden] in; hidden states
        out, or logits [B, L, vocab] on the last stage ([B, 1, vocab] with last_only: a
        prefill chunk needs only its last position's logits)."""
        h = self._inner.embed_tokens(x) if self.first else x
        caches: Sequence[Any] = cache if cache is not None else [None] * len(self._layers)
        # Masks as mlx-lm's models make them: from the first layer's cache (its offset is
        # every local layer's offset), "causal" / an array for a prefill chunk after
        # earlier chunks, None for a single decode token.
        full_mask = create_attention_mask(h, caches[0])
        window_mask = None
        for layer, c in zip(self._layers, caches):
            if getattr(layer, "use_sliding", False) and window_mask is None:
                window_mask = create_attention_mask(h, c, window_size=self._window)
        for layer, c in zip(self._layers, caches):
            h = layer(h, window_mask if getattr(layer, "use_sliding", False) else full_mask, c)
        if not self.last:
            return h
        if last_only:
            h = h[:, -1:, :]
        h = self._inner.norm(h)
        return self._inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)


def load_shard(path: str | Path, start: int, end: int, *, families: frozenset[str] = SUPPORTED_FAMILIES) -> Shard:
    """Layers [start, end) of the model in `path` (a local directory: see resolve_model).
    `families`: the model_types the caller runs (worker/tensor.py adds MoE families)."""
    path = Path(path)
    config = read_config(path)
    fam = family(config)
    if fam not in families:
        raise UnsupportedModel(f"model_type {config['model_type']!r} is not supported (supported: {sorted(families)})")
    if "quantization_config" in config and "quantization" not in config:
        raise UnsupportedModel("this checkpoint is quantized in a non-MLX format (quantization_config); convert it with mlx_lm.convert")
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: no parameter is computed yet
    inner = model.model
    num_layers = len(inner.layers)
    if not 0 <= start < end <= num_layers:
        raise BadStage(f"layers [{start}, {end}) are not a non-empty range of the model's {num_layers} layers")
    tied = bool(getattr(model.args, "tie_word_embeddings", True))
    first, last = start == 0, end == num_layers

    # Drop everything this stage does not run before anything is evaluated: the dropped
    # modules' (lazy, random-initialised) parameters are never computed nor allocated.
    inner.layers = inner.layers[start:end]
    if not (first or (last and tied)):
        del inner.embed_tokens
    if not last:
        del inner.norm
        if "lm_head" in model:
            del model.lm_head

    located = locate(path)
    names = stage_tensors(located, start, end, num_layers, tied)
    weights = read_tensors(located, names)
    loaded_bytes = sum(located[n].entry.nbytes for n in names)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights = {_renumber(k, start): v for k, v in weights.items()}

    if (quantization := config.get("quantization")) is not None:
        def quantizable(p: str, m: nn.Module) -> bool | dict[str, Any]:
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=quantizable)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: the checkpoint does not match layers [{start}, {end}) of a {fam} model: {e}") from None
    mx.eval(model.parameters())
    return Shard(model, config, start, end, num_layers, tied, frozenset(names), loaded_bytes)


def _renumber(name: str, start: int) -> str:
    """model.layers.<i>.x -> model.layers.<i - start>.x: the shard's layer list starts at 0."""
    return LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), str(int(m.group(1)) - start), 1), name, count=1)


def load_tokenizer(path: str | Path, config: dict[str, Any] | None = None) -> Any:
    """mlx-lm's TokenizerWrapper (encode, eos_token_ids, a streaming detokenizer)."""
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    config = config if config is not None else read_config(Path(path))
    return _load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
