"""A contiguous range of a model's decoder layers, built from mlx-lm's model classes.

Owns `resolve_model` (a local directory, or a Hugging Face id fetched with
huggingface_hub) and `load_shard`: it builds mlx-lm's model class for the family from
config.json, keeps only layers [start, end) (the others are dropped before anything is
evaluated, so their parameters never allocate), and reads from the safetensors files only
the tensors the stage needs (core/model_spec.stage_tensors): its layers, the embeddings on
the first stage (and on the last when the head is tied), the final norm and lm_head on the
last. `Shard.forward` runs the range with the attention mask built the way mlx-lm's own
models build it, so chaining shards gives the full model's logits.

There is no allowlist of families: any decoder-only mlx-lm family whose inner model lists
its decoder layers (`model.model.layers`) runs through worker/stage_view.py, which drives
the family's own code (embedding and its scale, masks by global layer index, caches from
its own make_cache(), final norm, head) on the stage's layers only. A model that cannot be
split (multimodal towers, no layer list, an inner call that is more than embedding, layers,
norm) is refused with UnsupportedModel naming its model_type and the reason.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import MODEL_REMAPPING, _get_classes, infer_quant_config

from p2pmesh.drivers import model_files
from p2pmesh.core.model_spec import LAYER_RE, stage_tensors
from p2pmesh.worker.checkpoint import CheckpointError, locate, read_config, read_tensors
from p2pmesh.worker.stage_view import NotSplittable, StageView

HEAD_NAMES = ("lm_head", "output")
"""What families call the untied head of their outer model (internlm2: output)."""
MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "speech_config")
"""config.json keys of checkpoints with an encoder tower besides the language model."""


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
                 tied: bool, loaded: frozenset[str], loaded_bytes: int, view: StageView) -> None:
        self.model = model
        self.config = config
        self.start, self.end, self.num_layers = start, end, num_layers
        self.tied = tied
        self.loaded = loaded
        self.loaded_bytes = loaded_bytes
        self._inner = model.model
        self._view = view
        args = model.args
        self.hidden_size = int(args.hidden_size)
        self.vocab_size = int(args.vocab_size)

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
        """One cache per local layer, of the kind the family's own make_cache() gives that
        (global) layer: rotating for sliding-window layers, MLA latents, SSM state ..."""
        return self._view.make_cache()

    def forward(self, x: mx.array, cache: Sequence[Any] | None = None, *, last_only: bool = False) -> mx.array:
        """Token ids [B, L] (first stage) or hidden states [B, L, hidden] in; hidden states
        out, or logits [B, L, vocab] on the last stage ([B, 1, vocab] with last_only: a
        prefill chunk needs only its last position's logits). The family's own code runs
        (stage_view.py): the outer model with its head on the last stage, the inner one
        elsewhere."""
        full = self._view.full_cache(cache)
        last_only = last_only and self.last
        with self._view.installed(list(self._inner.layers), last_only=last_only):
            out = self.model(x, cache=full) if self.last else self._inner(x, cache=full)
        if last_only and out.shape[1] != 1:  # a family without a known final norm
            out = out[:, -1:, :]
        return out


def _check_family(config: dict[str, Any], model: nn.Module) -> nn.Module:
    """The inner model whose `layers` list the stages cut, or UnsupportedModel saying why not."""
    model_type = config.get("model_type")
    tower = next((k for k in MULTIMODAL_KEYS if k in config), None)
    if tower is not None:
        raise UnsupportedModel(f"model_type {model_type!r} cannot be split into pipeline stages: it is multimodal "
                               f"({tower}); only the decoder-only language models of mlx-lm are")
    inner = model.get("model") if isinstance(model, nn.Module) else None
    if not isinstance(inner, nn.Module) or not isinstance(inner.get("layers"), list) or not inner["layers"]:
        raise UnsupportedModel(f"model_type {model_type!r} cannot be split into pipeline stages: its mlx-lm model has "
                               "no decoder layer list (model.layers), e.g. an encoder-decoder or a differently built model")
    return inner


def load_shard(path: str | Path, start: int, end: int, *, families: frozenset[str] | None = None) -> Shard:
    """Layers [start, end) of the model in `path` (a local directory: see resolve_model).
    `families`: when given, the only model_types the caller runs (worker/tensor.py's)."""
    path = Path(path)
    config = read_config(path)
    fam = family(config)
    if families is not None and fam not in families:
        raise UnsupportedModel(f"model_type {config['model_type']!r} is not supported here (supported: {sorted(families)})")
    if "quantization_config" in config and "quantization" not in config:
        raise UnsupportedModel("this checkpoint is quantized in a non-MLX format (quantization_config); convert it with mlx_lm.convert")
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise UnsupportedModel(f"model_type {config['model_type']!r} is not an mlx-lm family: {e}") from None
    try:
        model = model_class(args_class.from_dict(config))  # lazy: no parameter is computed yet
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise UnsupportedModel(f"model_type {config['model_type']!r}: config.json does not fit mlx-lm's model class "
                               f"({type(e).__name__}: {e})") from None
    inner = _check_family(config, model)
    num_layers = len(inner.layers)
    if not 0 <= start < end <= num_layers:
        raise BadStage(f"layers [{start}, {end}) are not a non-empty range of the model's {num_layers} layers")
    first, last = start == 0, end == num_layers

    located = locate(path)
    # A model class without a head module ties the head to the embeddings; one with it
    # (gemma3, deepseek_v3, gpt_oss) is tied when the checkpoint has no head (sanitize then
    # drops it).
    head = next((n for n in HEAD_NAMES if n in model), None)
    tied = head is None or f"{head}.weight" not in located
    names = stage_tensors(located, start, end, num_layers, tied)
    weights = read_tensors(located, names)
    loaded_bytes = sum(located[n].entry.nbytes for n in names)
    # The family's own make_cache() and sanitize() see the whole (lazy) model: they may walk
    # every layer or drop a head the checkpoint does not have.
    templates = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in range(num_layers)]
    # Renumbered before sanitize: a family's sanitize may test for layer 0's tensors to
    # decide whether to stack experts (mixtral), and it must see the stage's first layer there.
    weights = {_renumber(k, start): v for k, v in weights.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    # Drop everything this stage does not run before anything is evaluated: the dropped
    # modules' (lazy, random-initialised) parameters are never computed nor allocated. The
    # other stages' layer objects stay referenced (StageView reads their attributes), lazy.
    view = StageView(model, inner, list(inner.layers), templates, start, end)
    inner.layers = inner.layers[start:end]
    if view.embed_name is not None and not (first or (last and tied)):
        del inner[view.embed_name]
    if not last:
        if view.norm_name is not None:
            del inner[view.norm_name]
        if head is not None:
            model.pop(head, None)  # sanitize may have dropped it already (gemma3, tied)
    if not (first and last):
        try:
            view.check_splittable(int(model.args.hidden_size))
        except NotSplittable as e:
            raise UnsupportedModel(f"model_type {config['model_type']!r} cannot be split into pipeline stages: {e}") from None

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
    return Shard(model, config, start, end, num_layers, tied, frozenset(names), loaded_bytes, view)


def _renumber(name: str, start: int) -> str:
    """model.layers.<i>.x -> model.layers.<i - start>.x: the shard's layer list starts at 0."""
    return LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), str(int(m.group(1)) - start), 1), name, count=1)


def load_tokenizer(path: str | Path, config: dict[str, Any] | None = None) -> Any:
    """mlx-lm's TokenizerWrapper (encode, eos_token_ids, a streaming detokenizer)."""
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    config = config if config is not None else read_config(Path(path))
    return _load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
