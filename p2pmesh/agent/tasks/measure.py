"""Measuring the cluster's model on this Mac (agent side, trio): whenever the committed model
changes, time one layer in a short worker process (`python -m p2pmesh.worker.measure`) and
report ``ModelMeasured``; the leader plans with every member's measurement.

The task reads the ClusterView and wakes when the committed model changes; its only timer is
the wait before trying a failed measurement again (bounded: MEASURE_TRIES_MAX).
"""
from __future__ import annotations

import json
import logging
import dataclasses
import math
import sys
from dataclasses import dataclass

import trio

from p2pmesh.agent.models import ModelError, ModelUnloadable
from p2pmesh.agent.ports import ClusterView, Inbox
from p2pmesh.agent.tasks.fetch import ensure_layers
from p2pmesh.agent.tasks.peer_copy import PeerCopy
from p2pmesh.core.messages import Measure, MeasureFailed
from p2pmesh.core.node_io import ModelMeasured
from p2pmesh.core.validate import MEASURE_ERROR_CHARS_MAX

log = logging.getLogger("p2pmesh.models")

MEASURE_TIMEOUT_S = 300.0
"""Timing one layer (the file it needs is fetched before, under models.FETCH_TIMEOUT_S)."""
MEASURE_TRIES_MAX = 6
MEASURE_RETRY_S = 5.0


@dataclass(frozen=True, slots=True)
class MeasureConfig:
    """What the user set about this Mac's offer (AgentConfig's fields of the same names)."""

    memory_limit_bytes: int | None = None
    """Offer at most this much memory to the cluster."""
    layer_ms: float | None = None
    """Publish this time per layer instead of the measured one."""


async def measure_loop(view: ClusterView, inbox: Inbox, copier: PeerCopy, config: MeasureConfig) -> None:
    """For the agent's lifetime: measure each model the cluster commits, once it is here."""
    measured: str | None = None
    failures: dict[str, int] = {}
    retry_at = 0.0
    while True:  # for the agent's lifetime; cancelled with its nursery
        snapshot = view.current
        model = snapshot.state.model if snapshot.state is not None else None
        # Said it cannot load this model: until the model is set again (the core drops it).
        mine = snapshot.measure
        refused = isinstance(mine, MeasureFailed) and model is not None and mine.model == model.name
        wanted = model is not None and model.name != measured and not refused \
            and failures.get(model.name, 0) < MEASURE_TRIES_MAX
        if model is not None and wanted and trio.current_time() >= retry_at:
            try:
                measure = await _measure(copier, model.name)
                limit = config.memory_limit_bytes
                if limit is not None and measure.memory_bytes > limit:
                    measure = dataclasses.replace(measure, memory_bytes=limit)
                if config.layer_ms is not None:
                    # The user's time per layer, with the measured share of it that is fixed.
                    fixed_share = measure.layer_fixed_ms / measure.layer_ms if measure.layer_ms > 0 else 0.0
                    measure = dataclasses.replace(measure, layer_ms=config.layer_ms,
                                                  layer_fixed_ms=config.layer_ms * fixed_share)
            except ModelUnloadable as exc:
                # The cluster hears it at once (core/fit.py): no waiting for retries.
                retry_at = trio.current_time() + MEASURE_RETRY_S
                log.warning("cannot load %s here: %s", model.name, exc)
                await inbox.put(ModelMeasured(MeasureFailed(model.name, str(exc)[-MEASURE_ERROR_CHARS_MAX:])))
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
                await inbox.put(ModelMeasured(measure))
            continue  # look again at what is current now
        # A measurement waiting for its retry time keeps a deadline; else only a change of the
        # committed model (or of this Mac's report on it) wakes the task.
        await view.changed(snapshot.version, timeout_s=max(0.0, retry_at - trio.current_time()) if wanted else math.inf)


async def _measure(copier: PeerCopy, name: str) -> Measure:
    # The measured layer's files first (this Mac's directory, a copy from another Mac, or a
    # download), without the measuring bound; then the worker times it from disk.
    path = await ensure_layers(copier, name, None)
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
    return parse_measure(name, result.stdout)


def parse_measure(name: str, stdout: bytes) -> Measure:
    """The measuring worker's last line (worker/measure.py); ModelError when it has no result.
    A worker that does not say a fixed part (or says one outside [0, layer_ms]) gives 0 or
    the nearest bound: the planner then splits layers as if all of them divided."""
    try:
        data = json.loads(stdout.decode().strip().splitlines()[-1])
        layer_ms = float(data["layer_ms"])
        fixed = float(data.get("layer_fixed_ms", 0.0))
        fixed = min(layer_ms, fixed) if fixed > 0 else 0.0  # NaN and negatives: 0
        return Measure(name, int(data["memory_bytes"]), layer_ms, fixed)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ModelError("the measuring worker printed no result") from None
