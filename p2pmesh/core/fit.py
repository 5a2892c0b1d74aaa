"""Why the cluster cannot place its model, decided from the committed state alone.

The leader plans the committed model on every up member that measured it
(core/dataplane.py). This module owns the verdict when no plan can come of that: once every
member the planner would use has answered for the model (a Measure, or a MeasureFailed with
the member's own error) and no placement serves or loads, ``problem`` says why, with
numbers and a machine-readable code:

- ``model_cannot_load``: no member can load the model at all (their own errors);
- ``model_does_not_fit``: the members' memory cannot hold it: what it needs (the weights,
  and the KV cache for the context times the sequences a worker runs at once), what each
  Mac offers, and what would make it fit (a shorter context, another Mac of a given size,
  smaller weights).

A pure function of committed state: every agent derives the same verdict (its status, the
client and the HTTP API show it), and it is gone as soon as the facts change (a Mac joins
and measures, the model or its context changes), when the leader places the model by
itself (dataplane.negotiate runs on every change). The memory test is the planner's rule
(docs/placement.md: whole layers with their KV cache, the embeddings on the first stage and
the head on the last, a pipeline along the ring, Macs skipped freely) without the search;
tests compare it with solve_placement.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from p2pmesh.core.kv_quant import kv_bytes_per_token
from p2pmesh.core.messages import ClusterState, Measure, MeasureFailed, Member, ModelInfo
from p2pmesh.core.placement import ModelSpec, NodeSpec

DOES_NOT_FIT = "model_does_not_fit"
CANNOT_LOAD = "model_cannot_load"
CODES = (DOES_NOT_FIT, CANNOT_LOAD)
SEQUENCES = 1
"""Contexts a model needs KV cache for to be served at all (one request at a time): the
verdict here. The placement reserves more, up to the model's ``batch``, where memory allows
(``largest_batch``), and serves fewer at once rather than refuse."""
SHORT_ID = 8
_P = TypeVar("_P")


@dataclass(frozen=True, slots=True)
class Offer:
    node_id: str
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class Refusal:
    node_id: str
    error: str
    """The member's own error (its measuring worker's), verbatim."""


@dataclass(frozen=True, slots=True)
class PlacementProblem:
    """Why the committed model cannot be placed, for people (``message``) and programs."""

    code: str
    """DOES_NOT_FIT or CANNOT_LOAD."""
    model: str
    context_tokens: int
    message: str
    weights_bytes: int = 0
    """Every layer's weights, plus the embeddings and the head."""
    kv_bytes: int = 0
    """The KV cache of every layer for context_tokens x SEQUENCES."""
    offers: tuple[Offer, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    context_fits: int | None = None
    """The longest context that fits on these Macs (None: none does, or no KV cache)."""
    extra_mac_bytes: int | None = None
    """The usable memory one more Mac needs for the model to fit."""
    weights_fit_bytes: int | None = None
    """The largest weights that fit with this context (a smaller quantization)."""

    @property
    def needed_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code, "model": self.model, "context_tokens": self.context_tokens, "message": self.message,
            "needed_bytes": self.needed_bytes, "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
            "offers": [{"node_id": o.node_id, "memory_bytes": o.memory_bytes} for o in self.offers],
            "refusals": [{"node_id": r.node_id, "error": r.error} for r in self.refusals],
            "fits_with": {"context_tokens": self.context_fits, "extra_mac_bytes": self.extra_mac_bytes,
                          "weights_bytes": self.weights_fit_bytes},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PlacementProblem:
        """The inverse of to_json; KeyError, TypeError or ValueError on another shape."""
        fits = d.get("fits_with") or {}

        def opt(v: Any) -> int | None:
            return None if v is None else int(v)

        code = str(d["code"])
        if code not in CODES:
            raise ValueError(f"unknown placement problem {code!r}")
        return cls(code, str(d["model"]), int(d["context_tokens"]), str(d["message"]), int(d.get("weights_bytes") or 0),
                   int(d.get("kv_bytes") or 0), tuple(Offer(str(o["node_id"]), int(o["memory_bytes"])) for o in d.get("offers") or ()),
                   tuple(Refusal(str(r["node_id"]), str(r["error"])) for r in d.get("refusals") or ()),
                   opt(fits.get("context_tokens")), opt(fits.get("extra_mac_bytes")), opt(fits.get("weights_bytes")))


def model_spec(info: ModelInfo, sequences: int = SEQUENCES) -> ModelSpec:
    """The planner's view of a committed model, with KV cache for ``sequences`` contexts (at
    the model's kv_bits: core/kv_quant.py)."""
    return ModelSpec(
        layers=info.layers,
        layer_bytes=info.layer_bytes,
        kv_bytes_per_token_per_layer=kv_bytes_per_token(info.kv_bytes_per_token_per_layer, info.kv_bits,
                                                         info.context_tokens) * sequences,
        context_tokens=info.context_tokens,
        activation_bytes=info.activation_bytes,
        embed_bytes=info.embed_bytes,
        split=info.split,
    )


def largest_batch(asked: int, plan_for: Callable[[int], _P | None]) -> tuple[int, _P | None]:
    """The largest batch in [1, asked] that ``plan_for`` places (None: it does not), and its
    plan; (1, None) when not even one request at a time fits. Fitting is monotone in the
    batch (more KV cache per layer never fits better), so a bisection finds it: at most
    log2(asked) + 1 plans, and one when the asked batch fits."""
    best = plan_for(asked)
    if best is not None or asked <= 1:
        return asked, best
    low, high, found = 1, asked - 1, None  # the answer is in [low, high], or nothing fits
    while low <= high:
        mid = (low + high + 1) // 2
        plan = plan_for(mid)
        if plan is None:
            high = mid - 1
        else:
            found, low = (mid, plan), mid + 1
    return found if found is not None else (1, None)


def _candidates(state: ClusterState) -> list[Member]:
    """The members the planner would use, in ring order: up, not draining, in the ring."""
    by_id = {m.node_id: m for m in state.members}
    return [by_id[n] for n in state.ring if n in by_id and by_id[n].up and n not in state.draining]


def planned_nodes(state: ClusterState) -> list[NodeSpec]:
    """The Macs the leader plans the committed model on: the candidates that measured it."""
    name = state.model.name if state.model else None
    return [NodeSpec(m.node_id, m.measure.memory_bytes, m.measure.layer_ms, m.measure.layer_fixed_ms) for m in _candidates(state)
            if isinstance(m.measure, Measure) and m.measure.model == name]


def measurements_awaited(state: ClusterState) -> bool:
    """Some candidate measured the committed model and another has not answered yet (neither
    measured it nor failed to): a plan now would leave that Mac out (core/leader.py waits a
    while for it)."""
    name = state.model.name if state.model else None
    answered = [m.measure is not None and m.measure.model == name for m in _candidates(state)]
    return any(answered) and not all(answered)


def unloadable(state: ClusterState) -> bool:
    """Every candidate said it cannot load the committed model: serve nothing."""
    name = state.model.name if state.model else None
    members = _candidates(state)
    return bool(members) and all(isinstance(m.measure, MeasureFailed) and m.measure.model == name for m in members)


def problem(state: ClusterState) -> PlacementProblem | None:
    """The verdict on the committed model, or None while it is placed, loading, or still
    being measured (or it fits and the leader is about to place it)."""
    model = state.model
    if model is None or state.active or state.placement:
        return None
    up = [m for m in state.members if m.up and m.node_id not in state.draining]
    members = _candidates(state)
    if not members or len(members) != len(up):
        return None  # the ring has not caught up with a joining Mac: it will be measured too
    offers: list[Offer] = []
    refusals: list[Refusal] = []
    for m in members:
        if m.measure is None or m.measure.model != model.name:
            return None  # still measuring
        if isinstance(m.measure, MeasureFailed):
            refusals.append(Refusal(m.node_id, m.measure.error))
        else:
            offers.append(Offer(m.node_id, m.measure.memory_bytes))
    spec = model_spec(model)
    weights = spec.layers * spec.layer_bytes + 2 * spec.embed_bytes
    kv = spec.layers * spec.kv_bytes_per_token_per_layer * spec.context_tokens
    if not offers:
        why = "; ".join(f"{_short(r.node_id)}: {r.error}" for r in refusals)
        message = (f"no Mac can load {model.name}: {why}. Fix its files or choose a model of a family the workers "
                   "run; loading it again measures it again")
        return PlacementProblem(CANNOT_LOAD, model.name, model.context_tokens, message, weights, kv, (), tuple(refusals))
    memories = [o.memory_bytes for o in offers]
    if fits(spec, memories):
        return None
    found = PlacementProblem(DOES_NOT_FIT, model.name, model.context_tokens, "", weights, kv, tuple(offers), tuple(refusals),
                             _longest_context(spec, memories), _extra_mac(spec, memories), _largest_weights(spec, memories))
    return replace(found, message=_no_fit_message(found, spec))


# --- the planner's memory rule, without the search -----------------------------------------


def fits(spec: ModelSpec, memories: Sequence[int]) -> bool:
    """Whether some placement holds the model on Macs with these memories (in ring order):
    one Mac with everything, or a pipeline from a first Mac along the ring (either way) to a
    last one, each holding whole layers, the first also the embeddings, the last the head."""
    L, e, per = spec.layers, spec.embed_bytes, spec.bytes_per_layer

    def cap(free: int) -> int:
        if free < 0:
            return 0
        return L if per <= 0 else min(L, free // per)

    if any(cap(m - 2 * e) >= L for m in memories):
        return True
    n = len(memories)
    if L < 2 or n < 2:
        return False
    ends = [cap(m - e) for m in memories]
    mids = [cap(m) for m in memories]
    prefix = [0]
    for i in range(2 * n):
        prefix.append(prefix[-1] + mids[i % n])
    for f in range(n):
        if ends[f] < 1:
            continue
        for d in range(1, n):
            last = (f + d) % n
            # Forward from f to last (backward is the same pair forward from last to f).
            if ends[last] >= 1 and ends[f] + ends[last] + prefix[f + d] - prefix[f + 1] >= L:
                return True
    return False


def _largest(lo: int, hi: int, ok: Any) -> int | None:
    """The largest x in [lo, hi] with ok(x) (ok is monotone: true up to some x), else None."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _longest_context(spec: ModelSpec, memories: Sequence[int]) -> int | None:
    if spec.kv_bytes_per_token_per_layer <= 0:
        return None
    return _largest(1, spec.context_tokens - 1, lambda c: fits(replace(spec, context_tokens=c), memories))


def _extra_mac(spec: ModelSpec, memories: Sequence[int]) -> int:
    """The least memory one more Mac (next to the last in the ring) needs for the model to
    fit; at most spec.total_bytes, with which it holds the model alone."""
    lo, hi = 0, spec.total_bytes
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(spec, [*memories, mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _largest_weights(spec: ModelSpec, memories: Sequence[int]) -> int | None:
    """The largest weights (layers, embeddings and head scaled alike) that fit, in bytes."""
    def scaled(layer_bytes: int) -> ModelSpec:
        return replace(spec, layer_bytes=layer_bytes, embed_bytes=spec.embed_bytes * layer_bytes // spec.layer_bytes)

    best = _largest(1, spec.layer_bytes - 1, lambda b: fits(scaled(b), memories))
    if best is None:
        return None
    s = scaled(best)
    return s.layers * s.layer_bytes + 2 * s.embed_bytes


# --- words ------------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """Bytes in decimal units, as Macs and model cards count them: 1.23 GB, 456 MB, 12.3 kB."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n} bytes"


def _short(node_id: str) -> str:
    return node_id[:SHORT_ID]


def _no_fit_message(p: PlacementProblem, spec: ModelSpec) -> str:
    B = human_bytes
    have = sum(o.memory_bytes for o in p.offers)
    head = f", embeddings and head {B(2 * spec.embed_bytes)}" if spec.embed_bytes else ""
    kv = (f" + KV cache {B(p.kv_bytes)} ({p.context_tokens} tokens x {SEQUENCES} sequence at a time)"
          if p.kv_bytes else "")
    macs = f"{len(p.offers)} Mac{'s' if len(p.offers) != 1 else ''}"
    text = (f"{p.model} does not fit in the cluster's memory: it needs {B(p.needed_bytes)} = weights {B(p.weights_bytes)} "
            f"({spec.layers} layers of {B(spec.layer_bytes)}{head}){kv}; the {macs} offer {B(have)}: "
            + ", ".join(f"{_short(o.node_id)} {B(o.memory_bytes)}" for o in p.offers) + ".")
    if have >= p.needed_bytes:
        text += (f" That is enough in all, but each Mac holds whole layers ({B(spec.bytes_per_layer)} each with its KV "
                 "cache) and the first and last stage also the embeddings and the head, so the pieces do not add up.")
    fixes = []
    if p.context_fits is not None:
        fixes.append(f"--context-tokens {p.context_fits} or fewer")
    if p.extra_mac_bytes is not None:
        fixes.append(f"another Mac offering at least {B(p.extra_mac_bytes)}")
    if p.weights_fit_bytes is not None:
        share = 100 * p.weights_fit_bytes / max(1, p.weights_bytes)
        fixes.append(f"a smaller quantization (weights of at most {B(p.weights_fit_bytes)}, {share:.0f}% of these)")
    if fixes:
        text += " It would fit with " + "; or ".join(fixes) + "."
    if p.refusals:
        text += " Could not load it: " + "; ".join(f"{_short(r.node_id)}: {r.error}" for r in p.refusals) + "."
    return text
