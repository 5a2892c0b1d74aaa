"""Models on the agent side (no MLX here): find a model's files, describe it for the planner,
and keep this Mac's copies of models under ``<state dir>/models/`` (tasks/peer_copy.py fills
them from the other Macs, tasks/fetch.py links Hugging Face downloads into them; the
measuring is tasks/measure.py).

A model is named by a local directory in the Hugging Face layout or by a Hugging Face id,
which each Mac resolves on its own (huggingface_hub's cache; nothing is fetched when the
name is a directory, and only metadata when it is an id: model_files.py). The description
(layers, bytes per layer, KV bytes per token, ...) comes from config.json and the
safetensors headers only, read without loading any weight (the hub's headers when the
weight files are not here).
"""
from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio

from p2pmesh.drivers import model_files
from p2pmesh.core.errors import MeshError
from p2pmesh.core.messages import ModelInfo


FETCH_TIMEOUT_S = 12 * 3600.0
"""A download of a stage's files: hours for a large model on a slow line, never forever."""


class ModelError(MeshError):
    """The model named by the user cannot be found or read (the user's to fix)."""


class KvBitsUnsupported(ModelError):
    """`kv_bits` asked for a model whose cache mlx-lm cannot quantize (MLA's latent, attention
    with sinks): the workers would keep it at full precision, and the planner would count
    memory the Macs do not save."""


class ModelUnloadable(ModelError):
    """The measuring worker refused the model itself (a family it does not run, a broken
    checkpoint: its exit status 2), so trying again here would fail the same way."""


def resolve(name: str, *, allow_download: bool = True) -> Path:
    """The local directory of a model: the name itself when it is a directory, else the
    Hugging Face snapshot of that id with its metadata only (config, index, tokenizer; no
    weights: a Mac fetches only the weight files its stage holds, model_files.py)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not allow_download or not model_files.is_hub_id(name):
        raise ModelError(f"no model directory at {name!r} (and it is not a Hugging Face id such as org/name)")
    try:
        return model_files.fetch_metadata(name)
    except model_files.ModelFilesError as exc:
        raise ModelError(str(exc)) from None


def read_config(path: Path) -> dict[str, Any]:
    try:
        return model_files.read_config(path)
    except model_files.ModelFilesError as exc:
        raise ModelError(str(exc)) from None


def describe(name: str, path: Path, context_tokens: int, batch: int = 1, parallelism: str = "auto",
             kv_bits: int = 0) -> ModelInfo:
    """What the planner needs to know about a model (core/model_spec.py does the sums)."""
    from p2pmesh.core.config_shape import kv_quant_problem
    from p2pmesh.core.model_spec import ModelSpecError, model_spec

    try:
        config = read_config(path)
        if kv_bits and (problem := kv_quant_problem(config)) is not None:
            raise KvBitsUnsupported(f"{name}: its KV cache cannot be quantized by mlx-lm ({problem}); "
                                    "load it without kv_bits")
        # The KV cache at this context: a sliding layer holds its window only (core/config_shape.py).
        n = model_spec(config, model_files.tensor_bytes(name, path), context_tokens=context_tokens)
    except ModelSpecError as exc:
        raise ModelError(f"{name}: {exc}") from None
    except model_files.ModelFilesError as exc:
        raise ModelError(f"{name}: {exc}") from None
    return ModelInfo(
        name=name,
        layers=n.layers,
        layer_bytes=n.layer_bytes,
        kv_bytes_per_token_per_layer=n.kv_bytes_per_token_per_layer,
        context_tokens=context_tokens,
        activation_bytes=n.activation_bytes,
        # What the first and last stage hold besides layers (embeddings, head, final norm).
        embed_bytes=n.embed_bytes + n.head_bytes + n.norm_bytes,
        batch=batch,
        parallelism=parallelism,
        kv_bits=kv_bits,
        # The shape tensor groups split (all four, or none: only pipelines are planned), and
        # what a token reads of a layer (a mixture of experts: not every expert).
        **asdict(n.split),
    )


def memory_for_share(info: ModelInfo, parts: int) -> int:
    """Memory for about one ``parts``-th of the model: that share of its layers (rounded up)
    with their KV cache for ``info.context_tokens``, the embeddings and head, and half a layer
    of slack. Given to every agent as ``--memory-limit``, it takes ``parts`` Macs to hold the
    model (the demo's two of three; chaos's ``--split``)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, not {parts}")
    per_layer = info.layer_bytes + info.kv_bytes_per_token_per_layer * info.context_tokens
    return -(-info.layers // parts) * per_layer + 2 * info.embed_bytes + per_layer // 2


def located(name: str, root: Path | None) -> str:
    """Where this Mac looks for the model the cluster names: under the agent's
    ``--model-root`` for a relative name, else the name itself (a path or a hub id)."""
    return str(root / name) if root is not None and not Path(name).is_absolute() else name


async def fetch_in_thread(fetch: Callable[[], Path], what: str) -> Path:
    """Run a (possibly long) download in a thread, bounded by FETCH_TIMEOUT_S."""
    with trio.move_on_after(FETCH_TIMEOUT_S):
        try:
            return await trio.to_thread.run_sync(fetch, abandon_on_cancel=True)
        except model_files.ModelFilesError as exc:
            raise ModelError(str(exc)) from None
    raise ModelError(f"fetching {what} took more than {FETCH_TIMEOUT_S / 3600:.0f} h")


# ------------------------------------------------------------------------------------
# This Mac's copies of models (from other Macs, or linked from the Hugging Face cache)

COPY_DIR = "models"


def copy_dir(state_dir: Path, name: str) -> Path:
    """Where this Mac keeps the model files it copied from others: a readable tail of the
    name plus a hash, so two names never share a directory."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip("/"))[-48:].strip("-.") or "model"
    return state_dir / COPY_DIR / f"{tail}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def prune_copies(state_dir: Path, keep: str) -> list[Path]:
    """Delete this Mac's copies of every model but ``keep`` (blocking); returns what went.
    They are p2pmesh's own files, and a model's can be hundreds of GB; a model chosen again
    is copied again, over Thunderbolt."""
    wanted = copy_dir(state_dir, keep)
    gone = []
    for d in sorted((state_dir / COPY_DIR).glob("*")) if (state_dir / COPY_DIR).is_dir() else []:
        if d != wanted and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def model_dir(name: str, root: Path | None, state_dir: Path) -> str:
    """What a worker of this Mac loads the model from: its own directory, else its copy
    (from the other Macs, or linked from the Hugging Face cache), else the name itself."""
    local = located(name, root)
    if Path(local).expanduser().is_dir():
        return local
    mine = copy_dir(state_dir, name)
    return str(mine) if (mine / "config.json").is_file() else local


def weights_for(directory: Path, layers: tuple[int, int] | None) -> list[str] | None:
    """The weight files layers [start, end) load (None: the measured layer), from the
    directory's config and index; None without an index (the one weight file, whatever its name)."""
    config = model_files.read_config(directory)
    wm = model_files.weight_map(directory)
    if wm is None:
        return None
    return model_files.files_for_layers(config, wm, *(layers or model_files.measured_layers(config)))


def has_layers(directory: Path, layers: tuple[int, int] | None) -> bool:
    """The directory holds config.json and every weight file those layers load."""
    try:
        needed = weights_for(directory, layers)
    except (model_files.ModelFilesError, OSError, ValueError):
        return False
    if needed is None:
        return any(directory.glob("*.safetensors"))
    return all((directory / f).is_file() for f in needed)


def link_snapshot(snapshot: Path, dest: Path) -> None:
    """Make ``dest`` show a Hugging Face snapshot's files (symlinks; blocking), so this Mac
    loads, and serves to the others, one directory whatever each file came from."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in snapshot.iterdir():
        target = dest / f.name
        if f.is_file() and not target.exists():
            target.unlink(missing_ok=True)  # a dangling link from an evicted cache entry
            try:
                target.symlink_to(f.resolve())
            except FileExistsError:  # linked meanwhile by another fetch of the same model
                pass
