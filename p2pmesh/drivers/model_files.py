"""A model's files, wherever they are: which weight files a stage (or a measurement) needs,
fetching only those from Hugging Face, and every tensor's size from the safetensors
headers, of the local files or, when they are not here, of the hub's (huggingface_hub
reads them with HTTP range requests, so no weight is downloaded for it).

Why it matters: a model too large for one Mac is spread over several, and each one needs
only its stage's files. Naming a model (`p2pmesh load`) fetches its metadata only;
measuring it fetches the one file holding the measured layer; a stage's worker fetches the
files holding its layers (and the embeddings or head where it needs them). No Mac downloads
the whole checkpoint unless it holds the whole model. exo downloads the whole repository
on every node.

No MLX and no trio: the agent, the client and the workers all use it.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from p2pmesh.core.model_spec import MAX_HEADER_BYTES, ModelSpecError, parse_safetensors_header, stage_tensors

INDEX_FILE = "model.safetensors.index.json"
METADATA_PATTERNS = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]
"""What is fetched besides weight files (mlx-lm's own list): config, index, tokenizer."""
INDEX_BYTES_MAX = 64 * 1024 * 1024
CONFIG_BYTES_MAX = 1024 * 1024
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
"""What a hub download reads (and counts for its progress) at a time."""


class ModelFilesError(Exception):
    """A model's files are missing, malformed or cannot be fetched. The message says which."""


class HubUnavailable(ModelFilesError):
    """Hugging Face cannot be reached or refuses the id (offline, unknown, gated): the
    environment's fault, or the caller's for a wrong id."""


def is_hub_id(name: str) -> bool:
    """`owner/name` that is not a local path."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def _hub_call(what: str, repo_id: str, call: Any) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - offline, 404, gated, bad id: all "cannot fetch"
        raise HubUnavailable(
            f"cannot fetch {repo_id!r} ({what}) from Hugging Face ({type(exc).__name__}: {exc}); "
            "on a machine without internet pass a local model directory"
        ) from None


def fetch_metadata(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of a hub model's config, index and tokenizer files (no weights)."""
    from huggingface_hub import snapshot_download

    return Path(_hub_call("the metadata", repo_id,
                          lambda: snapshot_download(repo_id, revision=revision, allow_patterns=METADATA_PATTERNS)))


def fetch_weights(repo_id: str, files: Iterable[str] | None, revision: str | None = None) -> Path:
    """The local snapshot with these weight files too (None: every model*.safetensors)."""
    from huggingface_hub import snapshot_download

    patterns = ["model*.safetensors"] if files is None else sorted(set(files))
    return Path(_hub_call("the weights", repo_id,
                          lambda: snapshot_download(repo_id, revision=revision, allow_patterns=[*METADATA_PATTERNS, *patterns])))


def hub_file_size(repo_id: str, filename: str, revision: str | None = None) -> int:
    """The size of one file on the hub (a HEAD request, no bytes of it; 0 when the hub does
    not say): the total a download's progress counts towards."""
    from huggingface_hub import hf_hub_download

    info = _hub_call(f"the size of {filename}", repo_id,
                     lambda: hf_hub_download(repo_id, filename, revision=revision, dry_run=True))
    return int(getattr(info, "file_size", None) or 0)


def fetch_hub_file(repo_id: str, filename: str, on_bytes: Callable[[int], None], revision: str | None = None) -> Path:
    """Download one file from the hub into its cache (resumed by huggingface_hub when a partial
    is there); ``on_bytes(n)`` is called as bytes arrive (from this thread). Returns the
    snapshot directory holding it: a file is in a snapshot only once it is complete, which is
    what lets this Mac serve it to the others file by file (agent/tasks/hub_share.py)."""
    from huggingface_hub import constants, hf_hub_download
    from tqdm.auto import tqdm

    class Counting(tqdm):  # type: ignore[misc, type-arg]
        """huggingface_hub's progress bar, silent, counting the bytes for p2pmesh's progress."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            on_bytes(int(n or 0))
            return super().update(n)  # type: ignore[no-any-return]

    # huggingface_hub reads (and counts) 10 MiB at a time; 1 MiB gives a progress that moves
    # on a slow line too, at no cost to speed worth measuring (read at each download).
    constants.DOWNLOAD_CHUNK_SIZE = DOWNLOAD_CHUNK_BYTES
    path = _hub_call(filename, repo_id, lambda: hf_hub_download(repo_id, filename, revision=revision, tqdm_class=Counting))
    return Path(path).parent


def cached_metadata(repo_id: str) -> Path | None:
    """The cached snapshot of a hub model's metadata when this Mac has it (no request)."""
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(repo_id, allow_patterns=METADATA_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached here
        return None
    return local if (local / "config.json").is_file() else None


def fetch_layers(repo_id: str, layers: tuple[int, int] | None, revision: str | None = None) -> Path:
    """The local snapshot of a hub model with what a stage of layers [start, end) loads
    (None: every weight file). Without an index (one weight file) that is the whole file."""
    local = fetch_metadata(repo_id, revision)
    wm = weight_map(local)
    files = None
    if layers is not None and wm is not None:
        files = files_for_layers(read_config(local), wm, layers[0], layers[1])
    return fetch_weights(repo_id, files, revision)


def fetch_for_measure(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot with the weight file(s) of the layer a measurement times."""
    return fetch_layers(repo_id, measured_layers(read_config(fetch_metadata(repo_id, revision))), revision)


def read_json(path: Path, limit: int = INDEX_BYTES_MAX) -> Any:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ModelFilesError(f"cannot read {path}: {exc}") from None
    if len(data) > limit:
        raise ModelFilesError(f"{path} is larger than {limit} bytes")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ModelFilesError(f"{path} is not JSON: {exc}") from None


def read_config(model_dir: Path, limit: int = CONFIG_BYTES_MAX) -> dict[str, Any]:
    """config.json of a model directory, as a JSON object."""
    config = read_json(model_dir / "config.json", limit)
    if not isinstance(config, dict):
        raise ModelFilesError(f"{model_dir / 'config.json'} is not a JSON object")
    return config


def weight_map(model_dir: Path) -> dict[str, str] | None:
    """tensor name -> file name from model.safetensors.index.json (None without an index)."""
    index = model_dir / INDEX_FILE
    if not index.exists():
        return None
    raw = read_json(index)
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise ModelFilesError(f"{index} has no weight_map of tensor names to file names")
    for f in set(wm.values()):
        if "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors"):
            raise ModelFilesError(f"{index} names {f!r}, not a safetensors file beside it")
    return dict(wm)


def num_layers(config: Mapping[str, Any]) -> int:
    text = config.get("text_config", config)
    try:
        return int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise ModelFilesError("config.json has no num_hidden_layers") from None


def measured_layer(layers: int) -> int:
    """The layer a measurement times: a middle one when there are three or more, so neither
    the embeddings nor the head are read (worker/measure.py)."""
    return 1 if layers >= 3 else 0


def measured_layers(config: Mapping[str, Any]) -> tuple[int, int]:
    """The measured layer as a one-layer stage [i, i + 1): what a measurement loads."""
    index = measured_layer(num_layers(config))
    return index, index + 1


def files_for_layers(config: Mapping[str, Any], wm: Mapping[str, str], start: int, end: int) -> list[str]:
    """The weight files holding what a stage of layers [start, end) loads."""
    tied = bool(config.get("tie_word_embeddings", True))
    return sorted({wm[n] for n in stage_tensors(wm, start, end, num_layers(config), tied)})


def local_tensor_bytes(model_dir: Path) -> dict[str, int] | None:
    """Tensor name -> bytes from the headers of the local weight files; None when some file
    the index names is not here (a partial download) or there is no weight file at all."""
    wm = weight_map(model_dir)
    files = sorted({model_dir / f for f in wm.values()}) if wm is not None else sorted(model_dir.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        return None
    out: dict[str, int] = {}
    for f in files:
        try:
            with f.open("rb") as fh:
                prefix = fh.read(8)
                size = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
                prefix += fh.read(min(size, MAX_HEADER_BYTES))
            _, entries = parse_safetensors_header(prefix)
        except OSError as exc:
            raise ModelFilesError(f"cannot read {f}: {exc}") from None
        except ModelSpecError as exc:
            raise ModelFilesError(f"{f}: {exc}") from None
        out.update((e.name, e.nbytes) for e in entries)
    return out


def hub_tensor_bytes(repo_id: str, revision: str | None = None) -> dict[str, int]:
    """Tensor name -> bytes from the hub's safetensors headers (range requests, no weights)."""
    from huggingface_hub import get_safetensors_metadata

    meta = _hub_call("the safetensors headers", repo_id, lambda: get_safetensors_metadata(repo_id, revision=revision))
    out: dict[str, int] = {}
    for file_meta in meta.files_metadata.values():
        for name, info in file_meta.tensors.items():
            begin, end = info.data_offsets
            out[name] = int(end) - int(begin)
    return out


def tensor_bytes(name: str, model_dir: Path, revision: str | None = None) -> dict[str, int]:
    """Every tensor's size: from the local files when they are all here, else from the hub
    for a hub id (a Mac holding one stage, or none yet, still describes the whole model)."""
    local = local_tensor_bytes(model_dir)
    if local is not None:
        return local
    if is_hub_id(name):
        return hub_tensor_bytes(name, revision)
    raise ModelFilesError(f"{model_dir} holds no complete set of .safetensors files")
