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

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat

from p2pmesh.core.ring import DEFAULT_RTT_MS, Link, parse_graph

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

_TICKS_PER_MS = 10**9  # picoseconds: fine enough that rounding never matters, exact in ints
_MOVE_SCALE = 1 << 13  # > LAYERS_MAX: key = cost_ticks * _MOVE_SCALE + moved_layers
_INF = 1 << 120
_HALF_INF = _INF >> 1
_SMALL_WINDOW = 8  # windows up to this size: log2(c) doubling passes beat van Herk/Gil-Werman


class PlacementError(ValueError):
    """No placement exists for this model on these Macs (the cluster's fault, not the
    input's): the message says how much memory is missing."""


class ScenarioError(ValueError):
    """A described scenario (plan solve input) is malformed: the caller's fault; the message
    names the field."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    layers: int
    layer_bytes: int
    kv_bytes_per_token_per_layer: int
    context_tokens: int
    activation_bytes: int
    embed_bytes: int = 0

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
    node_id: str
    memory_bytes: int
    layer_ms: float


@dataclass(frozen=True, slots=True)
class Stage:
    node_id: str
    start: int
    end: int  # exclusive: the stage runs layers [start, end)

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[Stage, ...]
    tpot_ms: float
    bottleneck_ms: float = 0.0  # the slowest stage with its outgoing hop (throughput bound)

    def to_json(self) -> dict[str, object]:
        return {
            "stages": [{"node_id": s.node_id, "layers": [s.start, s.end]} for s in self.stages],
            "tpot_ms": round(self.tpot_ms, 6),
            "bottleneck_ms": round(self.bottleneck_ms, 6),
        }


# --- the cost context: everything in integer ticks, indexed by ring position ---------------


@dataclass(frozen=True, slots=True)
class _Ctx:
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


def _ticks(ms: float) -> int:
    return round(ms * _TICKS_PER_MS)


def _check_model(model: ModelSpec) -> None:
    if not 1 <= model.layers <= LAYERS_MAX:
        raise ValueError(f"model.layers must be 1..{LAYERS_MAX}, not {model.layers}")
    if model.layer_bytes < 1:
        raise ValueError("model.layer_bytes must be positive")
    for name in ("kv_bytes_per_token_per_layer", "context_tokens", "activation_bytes", "embed_bytes"):
        if getattr(model, name) < 0:
            raise ValueError(f"model.{name} must not be negative")


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
    no_link_fwd = _ticks(min(HOP_MS_MAX, net_rtt / 2 + activation_bytes * 8 / (NETWORK_GBPS * 1e6)))
    no_link_ret = _ticks(net_rtt / 2)
    fwd: list[list[int | None]] = [[None] * size for _ in range(size)]
    ret: list[list[int | None]] = [[None] * size for _ in range(size)]
    for (i, j, _kind), (gbps, rtt) in groups.items():
        # bytes * 8 / (Gb/s * 1e9) seconds, in ms; min() makes the dict's order irrelevant
        f = _ticks(min(HOP_MS_MAX, rtt / 2 + activation_bytes * 8 / (gbps * 1e6)))
        r = _ticks(min(HOP_MS_MAX, rtt / 2))
        old_f, old_r = fwd[i][j], ret[i][j]
        fwd[i][j] = fwd[j][i] = f if old_f is None else min(old_f, f)
        ret[i][j] = ret[j][i] = r if old_r is None else min(old_r, r)
    out_f = [[0 if i == j else (no_link_fwd if fwd[i][j] is None else fwd[i][j]) for j in range(size)] for i in range(size)]
    out_r = [[0 if i == j else (no_link_ret if ret[i][j] is None else ret[i][j]) for j in range(size)] for i in range(size)]
    return out_f, out_r  # type: ignore[return-value]


def _context(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link]) -> _Ctx:
    _check_model(model)
    _check_nodes(nodes)
    per_layer = model.bytes_per_layer
    L, e = model.layers, model.embed_bytes

    def cap(free: int) -> int:
        return 0 if free < 0 else min(L, free // per_layer)

    ids = tuple(n.node_id for n in nodes)
    fwd, ret = _hops(ids, links, model.activation_bytes)
    return _Ctx(
        ids=ids,
        layers=L,
        ms=tuple(max(1, _ticks(n.layer_ms)) for n in nodes),
        cap_first=tuple(cap(n.memory_bytes - e) for n in nodes),
        cap_mid=tuple(cap(n.memory_bytes) for n in nodes),
        cap_last=tuple(cap(n.memory_bytes - e) for n in nodes),
        cap_both=tuple(cap(n.memory_bytes - 2 * e) for n in nodes),
        fwd=tuple(tuple(r) for r in fwd),
        ret=tuple(tuple(r) for r in ret),
        overhead=_ticks(STAGE_OVERHEAD_MS),
    )


# --- evaluating a given plan ---------------------------------------------------------------


def _stage_indices(ctx: _Ctx, stages: Sequence[Stage]) -> list[tuple[int, int, int]]:
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


def _evaluate(ctx: _Ctx, st: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
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


def _caps_for(ctx: _Ctx, pos: int, k: int, i: int) -> int:
    if k == 1:
        return ctx.cap_both[i]
    if pos == 0:
        return ctx.cap_first[i]
    return ctx.cap_last[i] if pos == k - 1 else ctx.cap_mid[i]


def _memory_shortfall(ctx: _Ctx, model: ModelSpec, nodes: Sequence[NodeSpec], st: Sequence[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The first stage that does not fit: (ring position, bytes missing); None when all fit."""
    k = len(st)
    for pos, (i, a, b) in enumerate(st):
        if b - a > _caps_for(ctx, pos, k, i):
            extras = model.embed_bytes * ((pos == 0) + (pos == k - 1))
            return i, (b - a) * model.bytes_per_layer + extras - nodes[i].memory_bytes
    return None


def _plan(ctx: _Ctx, st: Sequence[tuple[int, int, int]]) -> Plan:
    tpot, slowest = _evaluate(ctx, st)
    return Plan(tuple(Stage(ctx.ids[i], a, b) for i, a, b in st), tpot / _TICKS_PER_MS, slowest / _TICKS_PER_MS)


def predict_tpot(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], stages: Sequence[Stage]) -> float:
    """Predicted time per token (ms) of a given plan; the same model for every strategy."""
    ctx = _context(model, nodes, links)
    return _evaluate(ctx, _stage_indices(ctx, stages))[0] / _TICKS_PER_MS


def fits_memory(model: ModelSpec, nodes: Sequence[NodeSpec], stages: Sequence[Stage]) -> bool:
    """Whether every stage fits its Mac (layers with their KV cache, plus embeddings/head)."""
    ctx = _context(model, nodes, ())
    st = _stage_indices(ctx, stages)
    return _memory_shortfall(ctx, model, nodes, st) is None


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


# --- the search ------------------------------------------------------------------------------


def _prefix(ctx: _Ctx, current: Plan | None) -> list[list[int]]:
    """P[j][m] = m * w_j - (layers < m that j runs in the current plan), w_j = per-layer key
    weight: a stage of j over [l, m) costs P[j][m] - P[j][l] = its compute (scaled) plus
    the layers it takes over from another Mac (the movement tie-break)."""
    L = ctx.layers
    owner = [-1] * L
    index = {n: i for i, n in enumerate(ctx.ids)}
    if current is not None:
        for s in current.stages:
            i = index.get(s.node_id, -1)
            for layer in range(max(0, s.start), min(L, s.end)):
                owner[layer] = i
    moves = 1 if current is not None else 0
    out = []
    for j in range(len(ctx.ids)):
        w = ctx.ms[j] * _MOVE_SCALE + moves
        if moves:
            kept = list(accumulate((1 if o == j else 0 for o in owner), initial=0))
            out.append([m * w - kept[m] for m in range(L + 1)])
        else:
            out.append([m * w for m in range(L + 1)])
    return out


def _orders(n: int) -> list[tuple[int, ...]]:
    """Every rotation of the ring in both directions (first Mac = rotation start), in the
    tie-break order: start at position 0, forward then backward, then position 1, ..."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for f in range(n):
        for d in (1, -1):
            seq = tuple((f + d * t) % n for t in range(n))
            if seq not in seen:
                seen.add(seq)
                out.append(seq)
    return out


def _emin(X: list[int], Y: list[int]) -> list[int]:
    """Elementwise minimum (a comprehension: about 3x faster than map(min, ...))."""
    return [x if x < y else y for x, y in zip(X, Y)]  # noqa: FURB136 (min() is the slow path)


def _window_min(A: list[int], c: int, L: int) -> list[int]:
    """W[l] = min(A[l+1 .. l+c]) for l in 0..L-1 (A has L+1 entries), W[L] = inf, in O(L)
    whatever c: a suffix minimum when the window reaches the end, doubling for small
    windows, otherwise van Herk/Gil-Werman (prefix and suffix minima within blocks of c)."""
    B = A[1:]
    if c >= L:
        W = []
        cur = _INF
        for x in reversed(B):
            if x < cur:  # noqa: PLR1730 (a comparison, not a call: this is the hot loop)
                cur = x
            W.append(cur)
        W.reverse()
    elif c <= _SMALL_WINDOW:
        B.extend(repeat(_INF, c))
        s = 1
        while 2 * s <= c:  # bounded: log2(c) passes, each widening the window to 2s
            B = _emin(B, B[s:])
            s *= 2
        if s < c:
            B = _emin(B, B[c - s :])
        W = B[:L]
    else:
        size = -(-(L + c - 1) // c) * c
        B.extend(repeat(_INF, size - L))
        pre: list[int] = []
        suf: list[int] = []
        for b in range(0, size, c):  # bounded: size / c blocks of c
            cur = _INF
            for x in B[b : b + c]:
                if x < cur:  # noqa: PLR1730 (as above)
                    cur = x
                pre.append(cur)
            cur = _INF
            back = []
            for x in reversed(B[b : b + c]):
                if x < cur:  # noqa: PLR1730 (as above)
                    cur = x
                back.append(cur)
            back.reverse()
            suf.extend(back)
        W = _emin(suf[:L], pre[c - 1 : c - 1 + L])
    W.append(_INF)
    return W


def _limit(budget: int, ms: int, cap: int) -> int:
    """Layers a stage may take when its time (layers * ms) must stay within budget."""
    return cap if budget >= cap * ms else min(cap, budget // ms)


def _order_dp(ctx: _Ctx, seq: tuple[int, ...], P: list[list[int]], bound: int | None) -> list[list[int] | None] | None:
    """The exact DP for one order. Gs[idx][l] = the least key of covering layers [l, L) with
    a stage of seq[idx] starting at l, its own overhead excluded (the predecessor adds it with
    the hop), or about _INF. Gs[0] = [key at l = 0]. None when this order has no plan.
    bound (throughput): every stage, with its outgoing hop, must take at most bound ticks."""
    n, L, S, C = len(seq), ctx.layers, _MOVE_SCALE, ctx.overhead
    p0 = seq[0]
    Gs: list[list[int] | None] = [None] * n
    M: list[int] | None = None  # elementwise minimum of Gs[idx + 1:] (latency only)
    for idx in range(n - 1, 0, -1):
        j = seq[idx]
        Pj = P[j]
        ms = ctx.ms[j]
        G = _continue(ctx, seq, idx, Gs, M, Pj, bound)
        hop_end = ctx.ret[j][p0]
        ce = ctx.cap_last[j] if bound is None else _limit(bound - C - hop_end, ms, ctx.cap_last[j])
        if ce >= 1:  # j ends the pipeline: the rest of the layers, then the token goes back
            a = max(1, L - ce)
            end = Pj[L] + hop_end * S
            G[a:L] = _emin(G[a:L], [end - p for p in Pj[a:L]])
        G[0] = G[L] = _INF
        if min(G) < _HALF_INF:
            Gs[idx] = G
            M = G if M is None else _emin(M, G)
    j = p0
    Pj = P[j]
    ms = ctx.ms[j]
    best = _INF
    ce = ctx.cap_both[j] if bound is None else _limit(bound - C, ms, ctx.cap_both[j])
    if L <= ce:
        best = Pj[L] - Pj[0]
    for idx2, hop in _successors(ctx, seq, 0, Gs, M, bound):
        G2 = Gs[idx2] if idx2 >= 0 else M
        assert G2 is not None
        c = ctx.cap_first[j] if bound is None else _limit(bound - C - hop, ms, ctx.cap_first[j])
        top = min(c, L - 1)
        if top >= 1:
            best = min(best, min([p + g for p, g in zip(Pj[1 : top + 1], G2[1 : top + 1])]) + (hop + C) * S - Pj[0])
    if best >= _HALF_INF:
        return None
    Gs[0] = [best]
    return Gs


def _successors(ctx: _Ctx, seq: tuple[int, ...], idx: int, Gs: list[list[int] | None], M: list[int] | None,
                bound: int | None) -> list[tuple[int, int]]:
    """(index in seq, hop ticks) of the successors of seq[idx] to try; index -1 stands for M,
    the elementwise minimum of all successors' G, taken at the largest hop among them.
    That is exact for the successors at the largest hop and never below the truth for the
    others (their hop is smaller), which are then tried one by one. In a ring cabling the
    others are the one or two cheap links, so a Mac costs O(L), not O(N L), per order.
    With a bound the window depends on the hop, so every successor is tried."""
    j = seq[idx]
    live = [(i2, ctx.fwd[j][seq[i2]]) for i2 in range(idx + 1, len(seq)) if Gs[i2] is not None]
    if bound is not None or len(live) <= 1:
        return live
    top = max(h for _, h in live)
    return [(-1, top)] + [(i2, h) for i2, h in live if h < top]


def _continue(ctx: _Ctx, seq: tuple[int, ...], idx: int, Gs: list[list[int] | None], M: list[int] | None,
              Pj: list[int], bound: int | None) -> list[int]:
    """G of seq[idx] when it hands over to a later stage: for each start l, the least key of
    taking layers [l, m) (at most its window) and then the best successor from m."""
    L, S, C = ctx.layers, _MOVE_SCALE, ctx.overhead
    j = seq[idx]
    groups: dict[int, list[list[int]]] = {}  # window (layers j may take) -> shifted successor Gs
    for i2, hop in _successors(ctx, seq, idx, Gs, M, bound):
        c = ctx.cap_mid[j] if bound is None else _limit(bound - C - hop, ctx.ms[j], ctx.cap_mid[j])
        if c >= 1:
            G2 = Gs[i2] if i2 >= 0 else M
            add_ = (hop + C) * S
            groups.setdefault(c, []).append([add_ + x for x in G2])  # type: ignore[union-attr]
    G: list[int] | None = None
    for c, shifted in groups.items():
        H = shifted[0]
        for other in shifted[1:]:
            H = _emin(H, other)
        W = _window_min([p + h for p, h in zip(Pj, H)], c, L)
        G = W if G is None else _emin(G, W)
    return [_INF] * (L + 1) if G is None else [g - p for g, p in zip(G, Pj)]


def _reconstruct(ctx: _Ctx, seq: tuple[int, ...], Gs: list[list[int] | None], P: list[list[int]], bound: int | None) -> list[tuple[int, int, int]]:
    """Walk the DP forward. Ties: end the pipeline, then more layers on this stage, then the
    nearer next Mac (the integer keys make every comparison exact)."""
    n, L, S, C = len(seq), ctx.layers, _MOVE_SCALE, ctx.overhead
    p0 = seq[0]
    out: list[tuple[int, int, int]] = []
    idx, l = 0, 0
    G0 = Gs[0]
    assert G0 is not None
    target = G0[0]
    for _ in range(n):
        j = seq[idx]
        Pj, ms = P[j], ctx.ms[j]
        hop_end = 0 if idx == 0 else ctx.ret[j][p0]
        ce = ctx.cap_both[j] if idx == 0 else ctx.cap_last[j]
        if bound is not None:
            ce = _limit(bound - C - hop_end, ms, ce)
        if L - l <= ce and Pj[L] - Pj[l] + hop_end * S == target:
            out.append((j, l, L))
            return out
        cm = ctx.cap_first[j] if idx == 0 else ctx.cap_mid[j]
        nxt: tuple[int, int] | None = None
        for m in range(min(L - 1, l + cm), l, -1):
            for idx2 in range(idx + 1, n):
                G2 = Gs[idx2]
                k = seq[idx2]
                if G2 is None or (bound is not None and m - l > _limit(bound - C - ctx.fwd[j][k], ms, cm)):
                    continue
                if Pj[m] - Pj[l] + (ctx.fwd[j][k] + C) * S + G2[m] == target:
                    nxt = (idx2, m)
                    break
            if nxt is not None:
                break
        if nxt is None:
            raise AssertionError("placement DP: no step reproduces the optimum (a bug)")
        out.append((j, l, nxt[1]))
        idx, l = nxt
        G = Gs[idx]
        assert G is not None
        target = G[l]
    raise AssertionError("placement DP: the walk did not end (a bug)")


def _lower_bounds(ctx: _Ctx) -> list[int | None]:
    """Per first Mac f, a lower bound (ticks) on the tpot of any plan that starts at f, or
    None when none can: the compute of the fastest layers f plus others could hold (f at
    least one), the fewest stages that can hold the model times the overhead, and that many
    hops at the cheapest forward and return costs. Each part bounds every such plan."""
    n, L, C = len(ctx.ids), ctx.layers, ctx.overhead
    by_speed = sorted(range(n), key=lambda j: (ctx.ms[j], j))
    min_fwd = min((ctx.fwd[i][j] for i in range(n) for j in range(n) if i != j), default=0)
    out: list[int | None] = []
    for f in range(n):
        if ctx.cap_first[f] < 1:
            out.append(None)  # f cannot even start the pipeline with one layer
            continue
        stages, have = 1, ctx.cap_both[f]
        if have < L:  # f alone cannot: at least f as first plus the largest other caps
            have = ctx.cap_first[f]
            for c in sorted((ctx.cap_mid[j] for j in range(n) if j != f), reverse=True):
                have += c
                stages += 1
                if have >= L:
                    break
            stages = max(stages, 2)
        if have < L or stages > n:
            out.append(None)
            continue
        left = L - 1
        total = ctx.ms[f]
        for j in by_speed:
            take = min(left, ctx.cap_first[f] - 1 if j == f else ctx.cap_mid[j])
            total += take * ctx.ms[j]
            left -= take
            if left == 0:
                break
        lb = total + stages * C
        if stages > 1:
            lb += (stages - 1) * min_fwd + min(ctx.ret[j][f] for j in range(n) if j != f)
        out.append(lb)
    return out


_Found = tuple[tuple[int, ...], list[list[int] | None], int | None]


def _solve_latency(ctx: _Ctx, P: list[list[int]]) -> _Found | None:
    orders = _orders(len(ctx.ids))
    lbs = _lower_bounds(ctx)
    S, C = _MOVE_SCALE, ctx.overhead
    ranked = sorted((lbs[seq[0]], o) for o, seq in enumerate(orders) if lbs[seq[0]] is not None)
    best: tuple[int, int, list[list[int] | None]] | None = None  # key, order index, DP
    for lb, o in ranked:  # bounded: at most 2N orders
        if best is not None:
            if lb * S > best[0]:  # type: ignore[operator]
                break  # ranked by bound: no later order can even tie
            if lb * S == best[0] and o > best[1]:
                continue  # at best a tie, which the earlier order wins
        Gs = _order_dp(ctx, orders[o], P, None)
        if Gs is None:
            continue
        key = Gs[0][0] + C * S  # type: ignore[index]
        if best is None or (key, o) < (best[0], best[1]):
            best = (key, o, Gs)
    return None if best is None else (orders[best[1]], best[2], None)


def _smear(X: int, c: int) -> int:
    """Bit l set when some bit l + 1 .. l + c of X is: which stage starts reach X's starts."""
    Y = X >> 1
    s = 1
    while 2 * s <= c:  # bounded: log2(c) doublings
        Y |= Y >> s
        s *= 2
    if s < c:
        Y |= Y >> (c - s)
    return Y


def _feasible(ctx: _Ctx, seq: tuple[int, ...], bound: int) -> bool:
    """Whether this order has a plan whose every stage takes at most bound ticks: the DP's
    reachability alone, with the starts as bits of one integer."""
    n, L, C = len(seq), ctx.layers, ctx.overhead
    p0 = seq[0]
    inner = ((1 << L) - 1) & ~1  # starts 1 .. L-1
    R = [0] * n
    for idx in range(n - 1, 0, -1):
        j = seq[idx]
        ms = ctx.ms[j]
        r = 0
        ce = _limit(bound - C - ctx.ret[j][p0], ms, ctx.cap_last[j])
        if ce >= 1:
            r = inner & ~((1 << max(1, L - ce)) - 1)
        for idx2 in range(idx + 1, n):
            if R[idx2]:
                c = _limit(bound - C - ctx.fwd[j][seq[idx2]], ms, ctx.cap_mid[j])
                if c >= 1:
                    r |= _smear(R[idx2], c)
        R[idx] = r & inner
    j = p0
    ms = ctx.ms[j]
    if L <= _limit(bound - C, ms, ctx.cap_both[j]):
        return True
    for idx2 in range(1, n):
        if R[idx2]:
            c = _limit(bound - C - ctx.fwd[j][seq[idx2]], ms, ctx.cap_first[j])
            if c >= 1 and _smear(R[idx2], c) & 1:
                return True
    return False


def _solve_throughput(ctx: _Ctx, P: list[list[int]]) -> _Found | None:
    """The least bottleneck (binary search per order, skipping orders that cannot beat the
    best so far), then the least (tpot, moves) among the plans that reach it."""
    orders = _orders(len(ctx.ids))
    n, L, C, S = len(ctx.ids), ctx.layers, ctx.overhead, _MOVE_SCALE
    lo = C + min(ctx.ms) - 1  # no stage is faster than one layer on the fastest Mac
    hops = [ctx.fwd[i][j] for i in range(n) for j in range(n)] + [ctx.ret[i][j] for i in range(n) for j in range(n)]
    hi = L * max(ctx.ms) + C + max(hops)  # every stage fits this: only memory can say no
    best_b: int | None = None
    for seq in orders:  # bounded: 2N orders, each at most ~log2(hi) checks
        top = hi if best_b is None else best_b - 1
        if top <= lo or not _feasible(ctx, seq, top):
            continue
        a, b = lo, top  # a infeasible, b feasible
        while b - a > 1:
            mid = (a + b) // 2
            if _feasible(ctx, seq, mid):
                b = mid
            else:
                a = mid
        best_b = b
    if best_b is None:
        return None
    best: tuple[int, int, list[list[int] | None]] | None = None
    for o, seq in enumerate(orders):
        if not _feasible(ctx, seq, best_b):
            continue
        Gs = _order_dp(ctx, seq, P, best_b)
        if Gs is None:
            continue
        key = Gs[0][0] + C * S  # type: ignore[index]
        if best is None or key < best[0]:
            best = (key, o, Gs)
    assert best is not None, "a feasible bottleneck without a plan (a bug)"
    return orders[best[1]], best[2], best_b


# --- the public planners ---------------------------------------------------------------------


def solve_placement(
    model: ModelSpec,
    nodes: Sequence[NodeSpec],
    links: Sequence[Link],
    *,
    objective: str = "latency",
    current: Plan | None = None,
    margin: float = 0.15,
) -> Plan:
    """The best placement (module comment, docs/placement.md), nodes in ring order.

    With ``current``: the current plan is kept (re-predicted) while it is still valid (its
    Macs present, the model's layers covered, every stage fits) and no slower than the best
    single Mac, unless the optimum beats it by more than ``margin`` (a fraction of the
    current objective). Among optimal plans the one moving the fewest layers is chosen.
    PlacementError when the model fits nowhere."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}")
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError("margin must be a fraction in [0, 1)")
    ctx = _context(model, nodes, links)
    if not nodes:
        raise _fits_nowhere(model, nodes)
    P = _prefix(ctx, current)
    found = _solve_latency(ctx, P) if objective == "latency" else _solve_throughput(ctx, P)
    if found is None:
        raise _fits_nowhere(model, nodes)
    seq, Gs, bound = found
    st = _reconstruct(ctx, seq, Gs, P, bound)
    if current is not None:
        kept = _keep(ctx, model, nodes, current, objective, margin, _evaluate(ctx, st))
        if kept is not None:
            st = kept
    return _plan(ctx, st)


def _keep(ctx: _Ctx, model: ModelSpec, nodes: Sequence[NodeSpec], current: Plan, objective: str, margin: float,
          new: tuple[int, int]) -> list[tuple[int, int, int]] | None:
    """The current plan's stages when hysteresis keeps it, else None."""
    try:
        st = _stage_indices(ctx, current.stages)
    except ValueError:
        return None  # a Mac is gone, or the model changed: a new plan is required
    if _memory_shortfall(ctx, model, nodes, st) is not None:
        return None  # no longer fits (more context, less free memory)
    which = 0 if objective == "latency" else 1
    cur_obj, new_obj = _evaluate(ctx, st)[which], new[which]
    L = ctx.layers
    singles = [L * ctx.ms[j] + ctx.overhead for j in range(len(ctx.ids)) if ctx.cap_both[j] >= L]
    if singles and cur_obj > (1 + min(margin, SINGLE_NODE_SLACK)) * min(singles):
        return None  # the single-Mac guarantee outranks stability beyond measurement noise
    return None if new_obj < (1 - margin) * cur_obj else st


def memory_proportional(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], *, check_memory: bool = True) -> Plan:
    """The baseline other systems use (exo v1): every Mac in ring order from position 0, layers
    in proportion to its memory (largest remainder, ties to the earlier Mac), at least one
    layer each when there are enough layers (taken from the Mac with the most, the earlier on
    a tie). No device selection. With check_memory, PlacementError when the total memory is
    short or a stage does not fit its Mac with its KV cache (exo checks weights only); without
    it, the plan is returned anyway (what exo would try to load)."""
    ctx = _context(model, nodes, links)
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
        short = _memory_shortfall(ctx, model, nodes, st)
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
        nodes.append(NodeSpec(node_id, _int_field(raw, "memory_bytes", where, 0, BYTES_MAX), _num_field(raw, "layer_ms", where, 0.0, MS_MAX)))
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
    if not isinstance(raw, dict) or not isinstance(raw.get("stages"), list) or not 1 <= len(raw["stages"]) <= NODES_MAX:
        raise ScenarioError(f'"current" must be an object with "stages": a list of 1 to {NODES_MAX} stages')
    stages = []
    for i, s in enumerate(raw["stages"]):
        where = f"current.stages[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("node_id"), str):
            raise ScenarioError(f'{where} must be an object with a string "node_id"')
        span = s.get("layers")
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= LAYERS_MAX for v in span)
                or span[0] >= span[1]):
            raise ScenarioError(f'{where}.layers must be [start, end) with 0 <= start < end <= {LAYERS_MAX}')
        if span[0] != (stages[-1].end if stages else 0):
            raise ScenarioError(f"{where}.layers must start where the previous stage ends (the first at 0)")
        if any(p.node_id == s["node_id"] for p in stages):
            raise ScenarioError(f"{where}: {s['node_id']!r} has two stages")
        stages.append(Stage(s["node_id"], span[0], span[1]))
    # A Mac of the current plan missing from "nodes" is fine: it is gone, and the plan is replaced.
    return Plan(tuple(stages), 0.0), float(margin)
