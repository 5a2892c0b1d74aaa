"""The placement planner's values and its cost model: the model and Macs it is given
(ModelSpec, NodeSpec), the plan it returns (Stage, Plan), its limits and errors, and the
cost context every search and check works on: per ring position, a layer's time, how many
layers a Mac holds as first, middle, last or only stage, and the hop times between Macs, all
in integer picoseconds so sums are exact and ties are real ties (core/placement.py says how
a plan is costed; docs/placement.md).

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from p2pmesh.core.ring import DEFAULT_RTT_MS, Link
from p2pmesh.core.split_shape import SplitShape

STAGE_OVERHEAD_MS = 0.1
"""Fixed cost of one stage per token (MLX eval/sync, the runtime's send and receive), on top
of the wire. Not yet measured on our runtime (partitioning.md 11); 0.1 ms is the order of an
MLX graph evaluation round trip. It makes an extra stage cost something even on RDMA."""
SINGLE_NODE_SLACK = 0.05
"""A kept (hysteresis) plan may be at most this much slower than the best single Mac that
holds the model (partitioning.md T2); more than that, the guarantee wins over stability.
A fresh plan is never slower at all. The slack keeps per-layer timing noise alone from moving
a model between two nearly equal Macs."""
NETWORK_GBPS = 0.1
"""Two Macs with no link at all still reach each other through the control plane's IP path."""
NODES_MAX = 64
LAYERS_MAX = 4096
LINKS_MAX = 4096
BYTES_MAX = 1 << 50  # 1 PiB: any larger figure is a typo, and it keeps arithmetic small
MS_MAX = 1e6
GBPS_MAX = 1e6
HOP_MS_MAX = 1e9  # a hop is never costed above ~11 days: keeps a 1e-300 Gb/s link finite
OBJECTIVES = ("latency", "throughput")

TICKS_PER_MS = 10**9  # picoseconds: fine enough that rounding never matters, exact in ints
MOVE_SCALE = 1 << 13  # > LAYERS_MAX: key = cost_ticks * MOVE_SCALE + moved_layers


class PlacementError(ValueError):
    """No placement exists for this model on these Macs (the cluster's fault, not the
    input's): the message says how much memory is missing."""


class ScenarioError(ValueError):
    """A described scenario (plan solve input) is malformed: the caller's fault; the message
    names the field."""


class ParallelismError(ValueError):
    """The parallelism asked for cannot be planned from these inputs (the caller's choice, not
    the cluster's memory): ``code`` is "model_shape_unknown" (a tensor plan needs the model's
    hidden_size, heads, KV heads and intermediate_size) or "too_few_macs"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelSpec:
    layers: int
    layer_bytes: int
    kv_bytes_per_token_per_layer: int
    context_tokens: int
    activation_bytes: int
    embed_bytes: int = 0
    split: SplitShape = SplitShape()
    """The shape tensor parallelism splits (unknown: only one Mac or a pipeline is planned)
    and what one token reads of a layer (a mixture of experts: not every expert). A Mac's
    measured layer_ms already reflects the latter; tensor groups split layer_ms by it
    (core/tensor_cost.py), and scenarios that derive layer_ms from memory bandwidth use it
    (docs/placement.md)."""

    @property
    def read_layer_bytes(self) -> int:
        """Weights one token reads in a layer (all of layer_bytes for a dense model)."""
        return self.split.read_bytes(self.layer_bytes)

    @property
    def has_shape(self) -> bool:
        """Whether the model says enough of its shape for a tensor-parallel plan."""
        return self.split.known

    @property
    def bytes_per_layer(self) -> int:
        """Weights plus the KV cache of the configured context."""
        return self.layer_bytes + self.kv_bytes_per_token_per_layer * self.context_tokens

    @property
    def total_bytes(self) -> int:
        """What one Mac needs to hold the whole model (embeddings and head included)."""
        return self.layers * self.bytes_per_layer + 2 * self.embed_bytes


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One Mac as the planner sees it: the memory it offers the model (its measurement) and
    how fast it runs one of the model's layers, whole or as a tensor rank's share."""
    node_id: str
    memory_bytes: int
    layer_ms: float
    layer_fixed_ms: float = 0.0
    """The part of layer_ms that a tensor rank pays whatever its share of the layer (each
    operation's dispatch: a kernel launch, a CPU op's overhead), measured by cutting the
    layer (worker/measure.py); 0 when unknown. Pipelines run whole layers and ignore it."""


@dataclass(frozen=True, slots=True)
class Stage:
    node_id: str
    start: int
    end: int  # exclusive: the stage runs layers [start, end)

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Share:
    """One rank's part of every layer of a tensor group: query heads, KV heads (the query
    heads are those of its KV heads) and MLP columns (intermediate_size)."""
    heads: int
    kv_heads: int
    columns: int


@dataclass(frozen=True, slots=True)
class Group:
    """Macs that run the layers [start, end) tensor-parallel, in their all-reduce ring order
    (the first receives the pipeline hop, the last sends it on). One Mac: a pipeline stage,
    with no shares."""
    node_ids: tuple[str, ...]
    start: int
    end: int
    shares: tuple[Share, ...] = ()

    @property
    def layers(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"node_ids": list(self.node_ids), "layers": [self.start, self.end]}
        if len(self.node_ids) > 1:
            out["shares"] = [{"node_id": n, "heads": s.heads, "kv_heads": s.kv_heads, "columns": s.columns}
                             for n, s in zip(self.node_ids, self.shares)]
        return out


PARALLELISMS = ("single", "pipeline", "tensor", "hybrid")


@dataclass(frozen=True, slots=True)
class Plan:
    """A placement. ``stages`` is the pipeline (one per group; a tensor group's stage names its
    first rank, which takes the hop in); ``groups`` is empty for a plain pipeline (each stage
    is a group of one)."""
    stages: tuple[Stage, ...]
    tpot_ms: float
    bottleneck_ms: float = 0.0  # the slowest stage with its outgoing hop (throughput bound)
    groups: tuple[Group, ...] = ()

    @property
    def layout(self) -> tuple[Group, ...]:
        """The groups, a plain pipeline's stages as groups of one."""
        return self.groups or tuple(Group((s.node_id,), s.start, s.end) for s in self.stages)

    @property
    def parallelism(self) -> str:
        """"single" (one Mac), "pipeline" (Macs in a row), "tensor" (one group of Macs) or
        "hybrid" (tensor groups in a row)."""
        groups = self.layout
        wide = any(len(g.node_ids) > 1 for g in groups)
        if len(groups) == 1:
            return "tensor" if wide else "single"
        return "hybrid" if wide else "pipeline"

    def to_json(self) -> dict[str, object]:
        return {
            "stages": [{"node_id": s.node_id, "layers": [s.start, s.end]} for s in self.stages],
            "tpot_ms": round(self.tpot_ms, 6),
            "bottleneck_ms": round(self.bottleneck_ms, 6),
            "parallelism": self.parallelism,
            "groups": [g.to_json() for g in self.layout],
        }


# --- the cost context: everything in integer ticks, indexed by ring position ---------------


@dataclass(frozen=True, slots=True)
class CostContext:
    ids: tuple[str, ...]
    layers: int
    ms: tuple[int, ...]  # ticks per layer
    cap_first: tuple[int, ...]  # layers a node can hold as first (embeddings) ...
    cap_mid: tuple[int, ...]
    cap_last: tuple[int, ...]  # ... as last (LM head) ...
    cap_both: tuple[int, ...]  # ... as the only stage
    fwd: tuple[tuple[int, ...], ...]  # ticks of the activation hop i -> j
    ret: tuple[tuple[int, ...], ...]  # ticks of the token-id hop i -> j
    overhead: int


def to_ticks(ms: float) -> int:
    return round(ms * TICKS_PER_MS)


def _check_model(model: ModelSpec) -> None:
    if not 1 <= model.layers <= LAYERS_MAX:
        raise ValueError(f"model.layers must be 1..{LAYERS_MAX}, not {model.layers}")
    if model.layer_bytes < 1:
        raise ValueError("model.layer_bytes must be positive")
    for name in ("kv_bytes_per_token_per_layer", "context_tokens", "activation_bytes", "embed_bytes"):
        if getattr(model, name) < 0:
            raise ValueError(f"model.{name} must not be negative")
    why = model.split.problem(model.layer_bytes)
    if why is not None:
        raise ScenarioError(why)


def _check_nodes(nodes: Sequence[NodeSpec]) -> None:
    if len(nodes) > NODES_MAX:
        raise ValueError(f"at most {NODES_MAX} nodes")
    seen: set[str] = set()
    for n in nodes:
        if n.node_id in seen:
            raise ValueError(f"node {n.node_id!r} is listed twice")
        seen.add(n.node_id)
        if not (math.isfinite(n.layer_ms) and 0 < n.layer_ms <= MS_MAX):
            raise ValueError(f"node {n.node_id!r}: layer_ms must be in (0, {MS_MAX:g}]")


def _hops(ids: Sequence[str], links: Sequence[Link], activation_bytes: int) -> tuple[list[list[int]], list[list[int]]]:
    """Forward (activation) and return (token id) hop ticks for every ordered pair: for each
    message the best kind of connection the pair has, the links of one kind together (Gb/s
    add up, lowest RTT, as the ring solver counts them); the network path when there is none."""
    index = {n: i for i, n in enumerate(ids)}
    groups: dict[tuple[int, int, str], list[float]] = {}  # (i < j, kind) -> [gbps, rtt]
    for link in links:
        i, j = index.get(link.a), index.get(link.b)
        if i is None or j is None or i == j:
            continue  # a link to a Mac that is not a candidate (down, left) plays no part
        if not (math.isfinite(link.gbps) and link.gbps > 0):
            raise ValueError(f"link {link.a!r}-{link.b!r} needs a positive finite gbps")
        rtt = DEFAULT_RTT_MS.get(link.kind, DEFAULT_RTT_MS["network"]) if link.rtt_ms is None else link.rtt_ms
        if not (math.isfinite(rtt) and rtt >= 0):
            raise ValueError(f"link {link.a!r}-{link.b!r} has a bad rtt_ms")
        g = groups.setdefault((min(i, j), max(i, j), link.kind), [0.0, math.inf])
        g[0] += link.gbps
        g[1] = min(g[1], rtt)
    size = len(ids)
    net_rtt = DEFAULT_RTT_MS["network"]
    no_link_fwd = to_ticks(min(HOP_MS_MAX, net_rtt / 2 + activation_bytes * 8 / (NETWORK_GBPS * 1e6)))
    no_link_ret = to_ticks(net_rtt / 2)
    fwd: list[list[int | None]] = [[None] * size for _ in range(size)]
    ret: list[list[int | None]] = [[None] * size for _ in range(size)]
    for (i, j, _kind), (gbps, rtt) in groups.items():
        # bytes * 8 / (Gb/s * 1e9) seconds, in ms; min() makes the dict's order irrelevant
        f = to_ticks(min(HOP_MS_MAX, rtt / 2 + activation_bytes * 8 / (gbps * 1e6)))
        r = to_ticks(min(HOP_MS_MAX, rtt / 2))
        old_f, old_r = fwd[i][j], ret[i][j]
        fwd[i][j] = fwd[j][i] = f if old_f is None else min(old_f, f)
        ret[i][j] = ret[j][i] = r if old_r is None else min(old_r, r)
    out_f = [[0 if i == j else (no_link_fwd if fwd[i][j] is None else fwd[i][j]) for j in range(size)] for i in range(size)]
    out_r = [[0 if i == j else (no_link_ret if ret[i][j] is None else ret[i][j]) for j in range(size)] for i in range(size)]
    return out_f, out_r  # type: ignore[return-value]


def cost_context(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link],
                 stage_overhead_ms: float = STAGE_OVERHEAD_MS) -> CostContext:
    """stage_overhead_ms: the runtime's cost of a stage per token beyond the wire (default
    STAGE_OVERHEAD_MS); scripts/bench_tensor.py passes the one it measures."""
    if not (math.isfinite(stage_overhead_ms) and 0 <= stage_overhead_ms <= HOP_MS_MAX):
        raise ScenarioError(f"a stage's overhead is a number of ms in [0, {HOP_MS_MAX:g}], not {stage_overhead_ms}")
    _check_model(model)
    _check_nodes(nodes)
    per_layer = model.bytes_per_layer
    L, e = model.layers, model.embed_bytes

    def cap(free: int) -> int:
        return 0 if free < 0 else min(L, free // per_layer)

    ids = tuple(n.node_id for n in nodes)
    fwd, ret = _hops(ids, links, model.activation_bytes)
    return CostContext(
        ids=ids,
        layers=L,
        ms=tuple(max(1, to_ticks(n.layer_ms)) for n in nodes),
        cap_first=tuple(cap(n.memory_bytes - e) for n in nodes),
        cap_mid=tuple(cap(n.memory_bytes) for n in nodes),
        cap_last=tuple(cap(n.memory_bytes - e) for n in nodes),
        cap_both=tuple(cap(n.memory_bytes - 2 * e) for n in nodes),
        fwd=tuple(tuple(r) for r in fwd),
        ret=tuple(tuple(r) for r in ret),
        overhead=to_ticks(stage_overhead_ms),
    )


# --- evaluating a given plan ---------------------------------------------------------------


def stage_indices(ctx: CostContext, stages: Sequence[Stage]) -> list[tuple[int, int, int]]:
    """(ring position, start, end) per stage; ValueError when the stages are not a plan of
    this model on these Macs (unknown or repeated Mac, a gap, an overlap, a wrong end)."""
    index = {n: i for i, n in enumerate(ctx.ids)}
    if not stages:
        raise ValueError("a plan needs at least one stage")
    out: list[tuple[int, int, int]] = []
    at = 0
    for s in stages:
        i = index.get(s.node_id)
        if i is None:
            raise ValueError(f"a stage runs on {s.node_id!r}, which is not one of the nodes")
        if any(o[0] == i for o in out):
            raise ValueError(f"{s.node_id!r} has two stages")
        if s.start != at or s.end <= s.start:
            raise ValueError(f"stages must cover layers [0, {ctx.layers}) in order, each non-empty (stage on {s.node_id!r})")
        out.append((i, s.start, s.end))
        at = s.end
    if at != ctx.layers:
        raise ValueError(f"the stages end at layer {at}, the model has {ctx.layers}")
    return out


def evaluate(ctx: CostContext, st: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """(tpot, slowest stage) in ticks; a stage's time includes its outgoing hop."""
    k = len(st)
    tpot = 0
    slowest = 0
    for pos, (i, a, b) in enumerate(st):
        if pos + 1 < k:
            hop = ctx.fwd[i][st[pos + 1][0]]
        else:
            hop = ctx.ret[i][st[0][0]] if k > 1 else 0  # one stage samples its own token
        stage = (b - a) * ctx.ms[i] + ctx.overhead + hop
        tpot += stage
        slowest = max(slowest, stage)
    return tpot, slowest


def _caps_for(ctx: CostContext, pos: int, k: int, i: int) -> int:
    if k == 1:
        return ctx.cap_both[i]
    if pos == 0:
        return ctx.cap_first[i]
    return ctx.cap_last[i] if pos == k - 1 else ctx.cap_mid[i]


def memory_shortfall(ctx: CostContext, model: ModelSpec, nodes: Sequence[NodeSpec], st: Sequence[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The first stage that does not fit: (ring position, bytes missing); None when all fit."""
    k = len(st)
    for pos, (i, a, b) in enumerate(st):
        if b - a > _caps_for(ctx, pos, k, i):
            extras = model.embed_bytes * ((pos == 0) + (pos == k - 1))
            return i, (b - a) * model.bytes_per_layer + extras - nodes[i].memory_bytes
    return None
