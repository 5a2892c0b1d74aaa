"""The placement planner: which contiguous range of a model's decoder layers each Mac runs.

Inputs (each agent measures and publishes them): usable memory (on macOS the Metal
working-set limit), the time of one decoder layer of the model on that Mac (a short
benchmark), and the links between Macs (ring.Link: kind, Gb/s, RTT). The model brings its
layer count, bytes per layer, KV bytes per token per layer, the configured context length,
the activation size sent between stages, and the embedding/head size.

Cost model (docs/placement.md). A pipeline is a run of stages along a rotation of the ring,
in either direction; a Mac with zero layers is not in it. For one decoded token:

    tpot = sum over stages (layers * layer_ms + STAGE_OVERHEAD_MS)
         + sum over forward hops (rtt/2 + activation_bytes*8 / Gb/s)
         + the return hop, last stage -> first (the sampled token id: rtt/2)

A hop uses the best direct connection between the two Macs (links of one kind count
together, like the ring solver: Gb/s add up, lowest RTT); two Macs with no link at all
talk over a "network" path of 0.1 Gb/s. A stage's memory is layers * (layer_bytes +
kv_bytes_per_token_per_layer * context_tokens), plus embed_bytes on the first stage (the
embeddings) and embed_bytes on the last (the LM head).

Objectives: "latency" minimises tpot (one stream). "throughput" minimises the slowest stage
(its compute, its overhead and its outgoing hop), which bounds tokens/s when the pipeline is
full of concurrent streams; ties go to the lower tpot.

Exactness and determinism: every cost is converted to integer picoseconds before the
search, so sums are exact, ties are real ties and every Mac computes the bit-identical plan.
The search is an exact dynamic program over contiguous splits for each rotation and
direction (a sliding-window minimum over list operations; successors folded through one
running minimum, so a ring cabling costs O(N L) per order), with orders skipped only when a
sound lower bound shows they cannot win. Ties on the
objective go to fewer moved layers (relative to the current plan), then to the order that
comes first (rotation starting at ring position 0, forward before backward, ...), then,
stage by stage, to ending the pipeline, then to more layers on the earlier stage, then to
the nearer next Mac.

Tensor parallelism (issue 16): with the model's shape (hidden size, heads, KV heads, MLP
columns), a group of Macs may run a range of layers together, each Mac a share of every
layer; "auto" takes the fastest of one Mac, a pipeline, one tensor group and a hybrid (tensor
groups chained as a pipeline), never slower than the best single Mac or the best pipeline.

Where things are: the values (ModelSpec, NodeSpec, Stage, Group, Share, Plan), the limits and
the cost context in integer ticks are core/placement_cost.py; the exact pipeline search is
core/placement_search.py; tensor groups' cost model is core/tensor_cost.py and the search
for tensor and hybrid plans core/tensor_search.py. This module is the public face: the
planners (with hysteresis), the memory-proportional baseline, and the scenario format of
`p2pmesh plan solve`; it re-exports the values so callers import from one place.

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from p2pmesh.core.placement_cost import (BYTES_MAX, GBPS_MAX, HOP_MS_MAX, LAYERS_MAX, LINKS_MAX, MS_MAX, NETWORK_GBPS,
                                          NODES_MAX, OBJECTIVES, SINGLE_NODE_SLACK, STAGE_OVERHEAD_MS, TICKS_PER_MS,
                                          CostContext, Group, ModelSpec, NodeSpec, ParallelismError, PlacementError,
                                          Plan, ScenarioError, Share, Stage, cost_context, evaluate, memory_shortfall,
                                          stage_indices)
from p2pmesh.core.placement_search import prefix_keys, reconstruct, solve_latency, solve_throughput
from p2pmesh.core.ring import Link, parse_graph
from p2pmesh.core.split_shape import SHAPE_MAX, SplitShape
from p2pmesh.core.tensor_cost import GroupCost, TensorContext, group_costs, split_cost, tensor_context
from p2pmesh.core.tensor_search import Placed, evaluate_groups, single_unit, solve_grouped

__all__ = [
    "BYTES_MAX", "GBPS_MAX", "HOP_MS_MAX", "LAYERS_MAX", "LINKS_MAX", "MS_MAX", "NETWORK_GBPS", "NODES_MAX",
    "OBJECTIVES", "PARALLELISM_CHOICES", "SINGLE_NODE_SLACK", "STAGE_OVERHEAD_MS", "Group", "ModelSpec", "NodeSpec",
    "ParallelismError", "PlacementError", "Plan", "ScenarioError", "Share", "SplitShape", "Stage", "fits_memory",
    "memory_proportional", "parse_current", "parse_scenario", "predict_plan", "predict_tpot", "solve_placement",
]


def _plan(ctx: CostContext, st: Sequence[tuple[int, int, int]]) -> Plan:
    tpot, slowest = evaluate(ctx, st)
    return Plan(tuple(Stage(ctx.ids[i], a, b) for i, a, b in st), tpot / TICKS_PER_MS, slowest / TICKS_PER_MS)


def predict_tpot(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], stages: Sequence[Stage]) -> float:
    """Predicted time per token (ms) of a given plan; the same model for every strategy."""
    ctx = cost_context(model, nodes, links)
    return evaluate(ctx, stage_indices(ctx, stages))[0] / TICKS_PER_MS


def predict_plan(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], plan: Plan,
                 stage_overhead_ms: float = STAGE_OVERHEAD_MS) -> Plan:
    """Any plan (pipeline, tensor or hybrid) re-predicted by the one cost model, its tensor
    groups split afresh; ValueError when it is not a plan of this model that fits these Macs.
    stage_overhead_ms: as cost_context's."""
    ctx = cost_context(model, nodes, links, stage_overhead_ms)
    placed = _placed(ctx, tensor_context(model, nodes, links, ctx.ms), plan)
    if placed is None:
        raise ValueError("the plan does not cover this model's layers on these Macs within their memory")
    return _grouped_plan(ctx, placed)


def fits_memory(model: ModelSpec, nodes: Sequence[NodeSpec], stages: Sequence[Stage]) -> bool:
    """Whether every stage fits its Mac (layers with their KV cache, plus embeddings/head)."""
    ctx = cost_context(model, nodes, ())
    st = stage_indices(ctx, stages)
    return memory_shortfall(ctx, model, nodes, st) is None


def _fits_nowhere(model: ModelSpec, nodes: Sequence[NodeSpec]) -> PlacementError:
    need = model.total_bytes
    have = sum(max(0, n.memory_bytes) for n in nodes)
    what = (
        f"{model.layers} layers x {model.bytes_per_layer} bytes (weights {model.layer_bytes} + KV cache "
        f"{model.kv_bytes_per_token_per_layer * model.context_tokens} for {model.context_tokens} tokens)"
        + (f" + 2 x {model.embed_bytes} embeddings/head" if model.embed_bytes else "")
    )
    if not nodes:
        return PlacementError(f"the model fits nowhere: there are no nodes; it needs {need} bytes ({what})")
    big = max(nodes, key=lambda n: (n.memory_bytes, n.node_id))
    one = f"on one Mac it needs {need} bytes ({what}); the largest, {big.node_id!r}, has {big.memory_bytes} ({need - big.memory_bytes} missing)"
    if have < need:
        return PlacementError(f"the model fits nowhere: {need - have} bytes missing: the {len(nodes)} Macs have {have} bytes in total; {one}")
    return PlacementError(
        f"the model fits nowhere: the {len(nodes)} Macs have {have} bytes in total, {have - need} more than the "
        f"{need} needed, but each Mac holds whole layers ({model.bytes_per_layer} bytes each) and the first and "
        f"last stage also hold the embeddings/head, so the pieces do not add up; at least one more layer's worth "
        f"({model.bytes_per_layer} bytes) is missing on some Mac; {one}"
    )


# --- the public planners ---------------------------------------------------------------------


def solve_placement(
    model: ModelSpec,
    nodes: Sequence[NodeSpec],
    links: Sequence[Link],
    *,
    objective: str = "latency",
    current: Plan | None = None,
    margin: float = 0.15,
    parallelism: str = "auto",
) -> Plan:
    """The best placement (module comment, docs/placement.md), nodes in ring order.

    ``parallelism``: "auto" (default) the best of one Mac, a pipeline, a tensor group and a
    hybrid (tensor groups need the model's shape: without it, as "pipeline"); "pipeline" only
    one Mac or a pipeline; "tensor" one group of two or more Macs; "hybrid" two or more groups,
    one of them tensor-parallel. Ties go to the pipeline (simpler to run).

    With ``current``: the current plan is kept (re-predicted) while it is still valid (its
    Macs present, the model's layers covered, every stage fits, of the asked parallelism) and
    no slower than the best single Mac, unless the optimum beats it by more than ``margin`` (a
    fraction of the current objective). Among optimal pipelines the one moving the fewest
    layers is chosen. PlacementError when the model fits nowhere; ParallelismError when the
    asked parallelism cannot be planned at all."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}")
    if parallelism not in PARALLELISM_CHOICES:
        raise ValueError(f"parallelism must be one of {', '.join(PARALLELISM_CHOICES)}")
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError("margin must be a fraction in [0, 1)")
    ctx = cost_context(model, nodes, links)
    if not nodes:
        raise _fits_nowhere(model, nodes)
    tctx = None if parallelism == "pipeline" else tensor_context(model, nodes, links, ctx.ms)
    if parallelism in ("tensor", "hybrid"):
        if tctx is None:
            raise ParallelismError("model_shape_unknown", f"a {parallelism} plan needs the model's hidden_size, "
                                   "num_attention_heads, num_key_value_heads and intermediate_size")
        least = 2 if parallelism == "tensor" else 3  # a hybrid: a tensor group and one more group
        if len(nodes) < least:
            raise ParallelismError("too_few_macs", f"a {parallelism} plan needs at least {least} Macs, not {len(nodes)}")
    best: Plan | None = None
    if parallelism in ("auto", "pipeline"):
        P = prefix_keys(ctx, current)
        found = solve_latency(ctx, P) if objective == "latency" else solve_throughput(ctx, P)
        if found is not None:
            seq, Gs, bound = found
            best = _plan(ctx, reconstruct(ctx, seq, Gs, P, bound))
    if tctx is not None and len(nodes) > 1:
        beat = None if best is None or objective != "latency" else round(best.tpot_ms * TICKS_PER_MS)
        placed = solve_grouped(ctx, tctx, parallelism if parallelism != "pipeline" else "auto", beat=beat)
        if placed is not None:
            grouped = _grouped_plan(ctx, placed)
            if best is None or _objective(grouped, objective) < _objective(best, objective):
                best = grouped
    if best is None:
        if parallelism in ("tensor", "hybrid"):
            raise PlacementError(f"no {parallelism} plan fits: " + str(_fits_nowhere(model, nodes)))
        raise _fits_nowhere(model, nodes)
    if current is not None:
        kept = _keep(ctx, tctx, model, nodes, current, objective, margin, best, parallelism)
        if kept is not None:
            return kept
    return best


PARALLELISM_CHOICES = ("auto", "pipeline", "tensor", "hybrid")


def _objective(plan: Plan, objective: str) -> tuple[float, float]:
    return (plan.tpot_ms, 0.0) if objective == "latency" else (plan.bottleneck_ms, plan.tpot_ms)


def _grouped_plan(ctx: CostContext, placed: list[Placed]) -> Plan:
    tpot, slowest = evaluate_groups(ctx, placed)
    stages = tuple(Stage(ctx.ids[u.ranks[0]], a, b) for u, a, b in placed)
    groups = tuple(Group(tuple(ctx.ids[r] for r in u.ranks), a, b, u.shares) for u, a, b in placed)
    if all(len(g.node_ids) == 1 for g in groups):
        groups = ()  # a plain pipeline: the stages say it all
    return Plan(stages, tpot / TICKS_PER_MS, slowest / TICKS_PER_MS, groups)


def _placed(ctx: CostContext, tctx: TensorContext | None, plan: Plan) -> list[Placed] | None:
    """A plan's groups with fresh splits and costs, or None when it no longer fits these Macs
    and this model (a Mac gone, other layers, a group that does not fit its memory)."""
    index = {n: i for i, n in enumerate(ctx.ids)}
    out: list[Placed] = []
    at = 0
    groups = plan.layout
    seen: set[int] = set()
    for pos, g in enumerate(groups):
        ranks = tuple(index.get(n, -1) for n in g.node_ids)
        if -1 in ranks or seen & set(ranks) or len(set(ranks)) != len(ranks) or g.start != at or g.end <= g.start:
            return None
        seen |= set(ranks)
        if len(ranks) == 1:
            units = [single_unit(ctx, ranks[0])]
        elif tctx is None:
            return None
        else:
            units = _given_split(tctx, ranks, g) or group_costs(tctx, ranks)
        first, last = pos == 0, pos == len(groups) - 1
        fits = [u for u in units if g.end - g.start <= (u.cap_both if first and last else u.cap_first if first
                                                         else u.cap_last if last else u.cap_mid)]
        if not fits:
            return None
        out.append((fits[0], g.start, g.end))
        at = g.end
    return out if out and at == ctx.layers else None


def _given_split(tctx: TensorContext, ranks: tuple[int, ...], g: Group) -> list[GroupCost]:
    """The group's own shares, costed, when it has shares of this model; else []."""
    sh = tctx.shape
    if len(g.shares) != len(ranks):
        return []
    kv = [s.kv_heads for s in g.shares]
    if sh.even and len({(s.kv_heads, s.columns) for s in g.shares}) > 1:
        return []  # an uneven split of a model the workers split only evenly
    if (sum(kv) != sh.kv_heads or any(s.heads != s.kv_heads * sh.heads_per_kv or s.columns % sh.block for s in g.shares)
            or sum(s.columns for s in g.shares) != sh.blocks * sh.block or min(kv + [s.columns for s in g.shares]) < 0):
        return []
    return [split_cost(tctx, ranks, kv, [s.columns // sh.block for s in g.shares])]


def _keep(ctx: CostContext, tctx: TensorContext | None, model: ModelSpec, nodes: Sequence[NodeSpec], current: Plan,
          objective: str, margin: float, new: Plan, parallelism: str) -> Plan | None:
    """The current plan, re-predicted, when hysteresis keeps it, else None."""
    if parallelism != "auto" and current.parallelism not in ({"single", "pipeline"} if parallelism == "pipeline" else {parallelism}):
        return None  # not what was asked for
    placed = _placed(ctx, tctx, current)
    if placed is None:
        return None  # a Mac is gone, the model changed, or it no longer fits (more context, less memory)
    kept = _grouped_plan(ctx, placed)
    cur_obj, new_obj = _objective(kept, objective)[0], _objective(new, objective)[0]
    L = ctx.layers
    singles = [L * ctx.ms[j] + ctx.overhead for j in range(len(ctx.ids)) if ctx.cap_both[j] >= L]
    if singles and cur_obj > (1 + min(margin, SINGLE_NODE_SLACK)) * min(singles) / TICKS_PER_MS:
        return None  # the single-Mac guarantee outranks stability beyond measurement noise
    return None if new_obj < (1 - margin) * cur_obj else kept


def memory_proportional(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], *, check_memory: bool = True) -> Plan:
    """The baseline other systems use (exo v1): every Mac in ring order from position 0, layers
    in proportion to its memory (largest remainder, ties to the earlier Mac), at least one
    layer each when there are enough layers (taken from the Mac with the most, the earlier on
    a tie). No device selection. With check_memory, PlacementError when the total memory is
    short or a stage does not fit its Mac with its KV cache (exo checks weights only); without
    it, the plan is returned anyway (what exo would try to load)."""
    ctx = cost_context(model, nodes, links)
    mem = [max(0, n.memory_bytes) for n in nodes]
    total = sum(mem)
    if not nodes or total == 0 or (check_memory and total < model.total_bytes):
        raise _fits_nowhere(model, nodes)
    L, n = model.layers, len(nodes)
    counts = [L * m // total for m in mem]
    by_remainder = sorted(range(n), key=lambda i: (-(L * mem[i] % total), i))
    for i in by_remainder[: L - sum(counts)]:
        counts[i] += 1
    if L >= n:
        for i in range(n):
            if counts[i] == 0:
                donor = max(range(n), key=lambda d: (counts[d], -d))
                counts[donor] -= 1
                counts[i] = 1
    st = []
    at = 0
    for i in range(n):
        if counts[i]:
            st.append((i, at, at + counts[i]))
            at += counts[i]
    if check_memory:
        short = memory_shortfall(ctx, model, nodes, st)
        if short is not None:
            i, missing = short
            layers = counts[i]
            raise PlacementError(
                f"memory-proportional placement does not fit: {nodes[i].node_id!r} would run {layers} layers "
                f"({layers} x {model.bytes_per_layer} bytes with KV cache for {model.context_tokens} tokens, plus "
                f"embeddings/head if first or last) and has {nodes[i].memory_bytes} bytes: {missing} bytes missing"
            )
    return _plan(ctx, st)


# --- the scenario format of `p2pmesh plan solve` (docs/placement.md) --------------------------


def _int_field(obj: dict[str, object], key: str, where: str, lo: int, hi: int, default: int | None = None) -> int:
    raw = obj.get(key, default)
    if raw is None:
        raise ScenarioError(f"{where}.{key} is missing")
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ScenarioError(f"{where}.{key} must be an integer")
    if isinstance(raw, float):
        if not (math.isfinite(raw) and raw.is_integer()):
            raise ScenarioError(f"{where}.{key} must be an integer")
        raw = int(raw)
    if not lo <= raw <= hi:
        raise ScenarioError(f"{where}.{key} must be in [{lo}, {hi}], not {raw}")
    return raw


def _num_field(obj: dict[str, object], key: str, where: str, lo_excl: float, hi: float) -> float:
    raw = obj.get(key)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or not lo_excl < raw <= hi:
        raise ScenarioError(f"{where}.{key} must be a number in ({lo_excl:g}, {hi:g}]")
    return float(raw)


SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def _shape_fields(m: dict[str, object]) -> dict[str, int]:
    """The model's optional shape for tensor plans: all four fields or none."""
    given = [k for k in SHAPE_FIELDS if m.get(k) is not None]
    if not given:
        return {}
    if len(given) < len(SHAPE_FIELDS):
        missing = ", ".join(f"model.{k}" for k in SHAPE_FIELDS if k not in given)
        raise ScenarioError(f"{missing} missing: a tensor plan needs all of {', '.join(SHAPE_FIELDS)} (or none of them)")
    out = {k: _int_field(m, k, "model", 1, SHAPE_MAX) for k in SHAPE_FIELDS}
    why = SplitShape(**out).problem(1)
    if why is not None:
        raise ScenarioError(why)  # heads that do not divide
    return out


def _bool_field(m: dict[str, object], key: str, where: str) -> bool:
    """An optional true/false field (false when absent)."""
    value = m.get(key, False)
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}.{key} must be true or false")
    return value


def _active_fields(m: dict[str, object]) -> dict[str, int]:
    """The optional bytes a token reads of a layer and a layer's attention (issue 17; `p2pmesh
    plan model` prints them): each at most what contains it."""
    layer = _int_field(m, "layer_bytes", "model", 1, BYTES_MAX)
    active = _int_field(m, "active_layer_bytes", "model", 0, layer, default=0)
    attention = _int_field(m, "attention_bytes", "model", 0, active or layer, default=0)
    return {"active_layer_bytes": active, "attention_bytes": attention}


def parse_scenario(data: object) -> tuple[ModelSpec, list[NodeSpec], list[Link]]:
    """Validate a `plan solve` scenario; ScenarioError (or the ring's RingError, both
    ValueError) names the bad field."""
    if not isinstance(data, dict):
        raise ScenarioError('the scenario must be an object with "model", "nodes" and "links"')
    m = data.get("model")
    if not isinstance(m, dict):
        raise ScenarioError('"model" must be an object')
    model = ModelSpec(
        layers=_int_field(m, "layers", "model", 1, LAYERS_MAX),
        layer_bytes=_int_field(m, "layer_bytes", "model", 1, BYTES_MAX),
        kv_bytes_per_token_per_layer=_int_field(m, "kv_bytes_per_token_per_layer", "model", 0, BYTES_MAX),
        context_tokens=_int_field(m, "context_tokens", "model", 0, 1 << 30),
        activation_bytes=_int_field(m, "activation_bytes", "model", 0, BYTES_MAX, default=0),
        embed_bytes=_int_field(m, "embed_bytes", "model", 0, BYTES_MAX, default=0),
        split=SplitShape(**_shape_fields(m), **_active_fields(m), even_split=_bool_field(m, "even_split", "model")),
    )
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not 1 <= len(raw_nodes) <= NODES_MAX:
        raise ScenarioError(f'"nodes" must be a list of 1 to {NODES_MAX} objects')
    nodes: list[NodeSpec] = []
    for i, raw in enumerate(raw_nodes):
        where = f"nodes[{i}]"
        if not isinstance(raw, dict):
            raise ScenarioError(f"{where} must be an object")
        node_id = raw.get("id", raw.get("node_id"))
        if not isinstance(node_id, str) or not 1 <= len(node_id) <= 256:
            raise ScenarioError(f'{where}.id must be a non-empty string (at most 256 characters)')
        if any(n.node_id == node_id for n in nodes):
            raise ScenarioError(f"{where}.id {node_id!r} is listed twice")
        layer_ms = _num_field(raw, "layer_ms", where, 0.0, MS_MAX)
        fixed = raw.get("layer_fixed_ms", 0.0)
        if isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or not 0.0 <= fixed <= layer_ms:
            raise ScenarioError(f"{where}.layer_fixed_ms must be a number in [0, layer_ms] ({layer_ms:g})")
        nodes.append(NodeSpec(node_id, _int_field(raw, "memory_bytes", where, 0, BYTES_MAX), layer_ms, float(fixed)))
    raw_links = data.get("links", [])
    if not isinstance(raw_links, list) or len(raw_links) > LINKS_MAX:
        raise ScenarioError(f'"links" must be a list of at most {LINKS_MAX} link objects')
    for i, raw in enumerate(raw_links):
        if isinstance(raw, dict):
            for end in ("a", "b", "kind"):
                if not isinstance(raw.get(end), str):
                    raise ScenarioError(f"links[{i}].{end} must be a string")
            gbps, rtt = raw.get("gbps"), raw.get("rtt_ms")
            if isinstance(gbps, float) and not (math.isfinite(gbps) and gbps <= GBPS_MAX):
                raise ScenarioError(f"links[{i}].gbps must be a finite number up to {GBPS_MAX:g}")
            if isinstance(gbps, int) and not isinstance(gbps, bool) and gbps > GBPS_MAX:
                raise ScenarioError(f"links[{i}].gbps must be a finite number up to {GBPS_MAX:g}")
            if isinstance(rtt, (int, float)) and not isinstance(rtt, bool) and not (math.isfinite(rtt) and rtt <= MS_MAX):
                raise ScenarioError(f"links[{i}].rtt_ms must be a finite number up to {MS_MAX:g}")
    try:
        _, links = parse_graph({"nodes": [n.node_id for n in nodes], "links": raw_links})
    except ValueError as exc:
        raise ScenarioError(f"links: {exc}") from exc
    return model, nodes, links


def parse_current(data: object, *, default_margin: float = 0.15) -> tuple[Plan | None, float]:
    """The optional "current" plan ({"stages": [...]} as `plan solve --json` prints it) and
    "margin" of a scenario, for hysteresis."""
    if not isinstance(data, dict):
        raise ScenarioError("the scenario must be an object")
    margin = data.get("margin", default_margin)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (math.isfinite(margin) and 0 <= margin < 1):
        raise ScenarioError('"margin" must be a fraction in [0, 1)')
    raw = data.get("current")
    if raw is None:
        return None, float(margin)
    if isinstance(raw, dict) and raw.get("groups") is not None:
        return _parse_groups(raw["groups"]), float(margin)
    if not isinstance(raw, dict) or not isinstance(raw.get("stages"), list) or not 1 <= len(raw["stages"]) <= NODES_MAX:
        raise ScenarioError(f'"current" must be an object with "stages": a list of 1 to {NODES_MAX} stages')
    stages = []
    for i, s in enumerate(raw["stages"]):
        where = f"current.stages[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("node_id"), str):
            raise ScenarioError(f'{where} must be an object with a string "node_id"')
        span = _span(s, where, stages[-1].end if stages else 0)
        if any(p.node_id == s["node_id"] for p in stages):
            raise ScenarioError(f"{where}: {s['node_id']!r} has two stages")
        stages.append(Stage(s["node_id"], span[0], span[1]))
    # A Mac of the current plan missing from "nodes" is fine: it is gone, and the plan is replaced.
    return Plan(tuple(stages), 0.0), float(margin)


def _span(obj: dict[str, object], where: str, at: int) -> tuple[int, int]:
    span = obj.get("layers")
    if (not isinstance(span, list) or len(span) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= LAYERS_MAX for v in span)
            or span[0] >= span[1]):
        raise ScenarioError(f'{where}.layers must be [start, end) with 0 <= start < end <= {LAYERS_MAX}')
    if span[0] != at:
        raise ScenarioError(f"{where}.layers must start where the previous {where.split('[')[0].split('.')[-1][:-1]} ends (the first at 0)")
    return span[0], span[1]


def _parse_groups(raw: object) -> Plan:
    """A current plan given by its "groups" (as `plan solve --json` prints them; "shares" are
    not read: a kept group is split afresh)."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= NODES_MAX:
        raise ScenarioError(f'"current.groups" must be a list of 1 to {NODES_MAX} groups')
    groups: list[Group] = []
    seen: set[str] = set()
    for i, g in enumerate(raw):
        where = f"current.groups[{i}]"
        ids = g.get("node_ids") if isinstance(g, dict) else None
        if not isinstance(ids, list) or not 1 <= len(ids) <= NODES_MAX or not all(isinstance(n, str) for n in ids):
            raise ScenarioError(f'{where} must be an object with "node_ids": a list of 1 to {NODES_MAX} strings')
        if seen & set(ids) or len(set(ids)) != len(ids):
            raise ScenarioError(f"{where}: a Mac is in two groups")
        seen |= set(ids)
        a, b = _span(g, where, groups[-1].end if groups else 0)
        groups.append(Group(tuple(ids), a, b))
    stages = tuple(Stage(g.node_ids[0], g.start, g.end) for g in groups)
    return Plan(stages, 0.0, 0.0, tuple(groups) if any(len(g.node_ids) > 1 for g in groups) else ())
