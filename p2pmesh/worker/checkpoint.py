"""Reading a Hugging Face checkpoint directory tensor by tensor.

Owns the file side of model loading: config.json, where each tensor lives (the
safetensors headers, found through model.safetensors.index.json or by scanning the
files), and reading only the named tensors into MLX arrays. Reading goes through each
file's header offsets, so a tensor that is not asked for is never read from disk and
never allocated: that is how a pipeline stage holds only its share of the model.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from p2pmesh.core.model_spec import ModelSpecError, TensorEntry, parse_safetensors_header
from p2pmesh.drivers.model_files import ModelFilesError, weight_map

HEADER_PEEK_BYTES = 1 << 20
"""Read this much first; a larger header is read in a second call."""

# safetensors dtype -> (numpy dtype to read the bytes as, MLX dtype to view them as).
# bfloat16 and the fp8 formats have no numpy type: they are read as raw unsigned ints and
# reinterpreted (view) in MLX, which keeps the bits exact.
_DTYPES: dict[str, tuple[Any, Any]] = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "F64": (np.float64, mx.float32),
    "I8": (np.int8, mx.int8),
    "U8": (np.uint8, mx.uint8),
    "I16": (np.int16, mx.int16),
    "U16": (np.uint16, mx.uint16),
    "I32": (np.int32, mx.int32),
    "U32": (np.uint32, mx.uint32),
    "I64": (np.int64, mx.int64),
    "U64": (np.uint64, mx.uint64),
    "BOOL": (np.bool_, mx.bool_),
}


class CheckpointError(Exception):
    """The checkpoint directory is incomplete or malformed: the model files' fault."""


@dataclass(frozen=True, slots=True)
class Located:
    """A tensor and the file and absolute offset its bytes start at."""

    entry: TensorEntry
    file: Path
    data_start: int


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face model directory") from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path} has no model_type")
    return config


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files, from the index when there is one (only the files it names,
    so a partial download of a stage's files is enough), else every model*.safetensors."""
    try:
        wm = weight_map(model_dir)
    except ModelFilesError as e:
        raise CheckpointError(str(e)) from None
    if wm is not None:
        return sorted({model_dir / f for f in wm.values()})
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no model*.safetensors in {model_dir}")
    return files


def read_header(path: Path) -> tuple[int, list[TensorEntry]]:
    """(absolute data offset, entries) of one safetensors file; reads only the header."""
    try:
        with path.open("rb") as f:
            prefix = f.read(HEADER_PEEK_BYTES)
            if len(prefix) >= 8:
                need = 8 + int.from_bytes(prefix[:8], "little")
                if len(prefix) < need <= 8 + 100_000_000:
                    prefix += f.read(need - len(prefix))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        return parse_safetensors_header(prefix)
    except ModelSpecError as e:
        raise CheckpointError(f"{path}: {e}") from None


def locate(model_dir: Path, files: Iterable[Path] | None = None) -> dict[str, Located]:
    """Every tensor of the checkpoint (or of `files`) and where its bytes are. Reads headers
    only. A file the index names but that is absent (not downloaded for this stage) is
    skipped; asking for one of its tensors later fails with a clear message."""
    out: dict[str, Located] = {}
    for path in files if files is not None else weight_files(model_dir):
        if not path.exists():
            continue
        data_start, entries = read_header(path)
        for e in entries:
            out[e.name] = Located(e, path, data_start)
    return out


def read_tensors(located: dict[str, Located], names: Iterable[str]) -> dict[str, mx.array]:
    """The named tensors as MLX arrays, read from their byte ranges (nothing else is read)."""
    wanted = sorted(names, key=lambda n: (str(located[n].file), located[n].entry.begin) if n in located else ("", 0))
    missing = [n for n in wanted if n not in located]
    if missing:
        raise CheckpointError(f"the checkpoint lacks tensors {missing[:5]} (incomplete download?)")
    out: dict[str, mx.array] = {}
    handles: dict[Path, Any] = {}
    try:
        for name in wanted:
            loc = located[name]
            f = handles.get(loc.file) or handles.setdefault(loc.file, loc.file.open("rb"))
            np_dtype, mx_dtype = _DTYPES.get(loc.entry.dtype, (None, None))
            if np_dtype is None:
                raise CheckpointError(f"tensor {name} has dtype {loc.entry.dtype}, which the loader does not read")
            f.seek(loc.data_start + loc.entry.begin)
            buf = np.empty(loc.entry.shape, dtype=np_dtype)
            got = f.readinto(memoryview(buf).cast("B")) if buf.nbytes else 0
            if got != loc.entry.nbytes:
                raise CheckpointError(f"{loc.file} is truncated: tensor {name} has {got} of {loc.entry.nbytes} bytes")
            arr = mx.array(buf)
            if loc.entry.dtype == "BF16":
                arr = arr.view(mx.bfloat16)
            elif loc.entry.dtype == "F64":
                arr = arr.astype(mx.float32)
            out[name] = arr
    except OSError as e:
        raise CheckpointError(f"cannot read the checkpoint: {e}") from None
    finally:
        for f in handles.values():
            f.close()
    return out
