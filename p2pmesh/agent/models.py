"""Models on the agent side (no MLX here): find a model's files, describe it for the planner,
and measure it on this Mac through a worker process.

A model is named by a local directory in the Hugging Face layout or by a Hugging Face id,
which each Mac resolves on its own (huggingface_hub's cache; nothing is fetched when the
name is a directory, and only metadata when it is an id: model_files.py). The description
(layers, bytes per layer, KV bytes per token, ...) comes from config.json and the
safetensors headers only, read without loading any weight (the hub's headers when the
weight files are not here).
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pmesh import model_files
from p2pmesh.core.errors import MeshError
from p2pmesh.core.machine import ModelMeasured
from p2pmesh.core.messages import Measure, MeasureFailed, ModelInfo
from p2pmesh.core.validate import MEASURE_ERROR_CHARS_MAX

if TYPE_CHECKING:
    from p2pmesh.agent import Agent

log = logging.getLogger("p2pmesh.models")

MEASURE_TIMEOUT_S = 300.0
"""Timing one layer (the file it needs is fetched before, under FETCH_TIMEOUT_S)."""
MEASURE_TRIES_MAX = 6
MEASURE_RETRY_S = 5.0
FETCH_TIMEOUT_S = 12 * 3600.0
"""A download of a stage's files: hours for a large model on a slow line, never forever."""


class ModelError(MeshError):
    """The model named by the user cannot be found or read (the user's to fix)."""


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


def describe(name: str, path: Path, context_tokens: int) -> ModelInfo:
    """What the planner needs to know about a model (core/model_spec.py does the sums)."""
    from p2pmesh.core.model_spec import ModelSpecError, model_spec

    try:
        n = model_spec(read_config(path), model_files.tensor_bytes(name, path))
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


async def measure_loop(agent: Agent) -> None:
    """Whenever the cluster's model changes, measure it here (a short worker run) and
    publish the result; the leader plans with every member's measurement."""
    measured: str | None = None
    failures: dict[str, int] = {}
    retry_at = 0.0
    while True:  # for the agent's lifetime
        m = agent.machine
        model = m.raft.state.model if m and m.raft else None
        # Said it cannot load this model: until the model is set again (machine.py drops it).
        refused = m is not None and isinstance(m.measure, MeasureFailed) and model is not None and m.measure.model == model.name
        if model is not None and model.name != measured and not refused and trio.current_time() >= retry_at \
                and failures.get(model.name, 0) < MEASURE_TRIES_MAX:
            try:
                measure = await _measure(agent, model.name)
                limit = agent.config.memory_limit_bytes
                if limit is not None and measure.memory_bytes > limit:
                    measure = Measure(measure.model, limit, measure.layer_ms)
                if agent.config.layer_ms is not None:
                    measure = Measure(measure.model, measure.memory_bytes, agent.config.layer_ms)
            except ModelUnloadable as exc:
                # The cluster hears it at once (core/fit.py): no waiting for retries.
                retry_at = trio.current_time() + MEASURE_RETRY_S
                log.warning("cannot load %s here: %s", model.name, exc)
                await agent.inbox_send.send(ModelMeasured(MeasureFailed(model.name, str(exc)[-MEASURE_ERROR_CHARS_MAX:])))
            except ModelError as exc:
                # A peer busy or briefly unreachable, a download that broke off: try again
                # later (bounded), or this Mac never offers its memory for the model.
                tries = failures[model.name] = failures.get(model.name, 0) + 1
                wait = min(MEASURE_RETRY_S * 2 ** (tries - 1), 300.0)
                retry_at = trio.current_time() + wait
                log.warning("cannot measure %s here (try %d of %d%s): %s", model.name, tries, MEASURE_TRIES_MAX,
                            f", again in {wait:.0f} s" if tries < MEASURE_TRIES_MAX else "", exc)
            else:
                measured = model.name
                log.info("measured %s: %.3f ms per layer, %.1f GiB usable", model.name, measure.layer_ms, measure.memory_bytes / 2**30)
                await agent.inbox_send.send(ModelMeasured(measure))
        await trio.sleep(0.5)


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


async def _measure(agent: Agent, name: str) -> Measure:
    from p2pmesh.fetch import ensure_layers

    # The measured layer's files first (this Mac's directory, a copy from another Mac, or a
    # download), without the measuring bound; then the worker times it from disk.
    path = await ensure_layers(agent, name, None)
    cmd = [sys.executable, "-m", "p2pmesh.worker.measure", "--model", str(path)]
    with trio.move_on_after(MEASURE_TIMEOUT_S) as scope:
        result = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    if scope.cancelled_caught:
        raise ModelError(f"measuring took more than {MEASURE_TIMEOUT_S:.0f} s")
    lines = result.stderr.decode(errors="replace").strip().splitlines()
    if result.returncode == 2 and lines and not lines[-1].startswith("measure: ModelUnavailable"):
        # The worker's "the model is unusable" (worker/measure.py), not a hub out of reach.
        raise ModelUnloadable(lines[-1].removeprefix("measure: "))
    if result.returncode != 0:
        raise ModelError(f"the measuring worker failed: {result.stderr.decode(errors='replace')[-500:]}")
    try:
        data = json.loads(result.stdout.decode().strip().splitlines()[-1])
        return Measure(name, int(data["memory_bytes"]), float(data["layer_ms"]))
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelError("the measuring worker printed no result") from None
