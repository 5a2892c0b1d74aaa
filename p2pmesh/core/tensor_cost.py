"""Tensor parallelism's cost model (issue 16): how every layer of a range is split over a group
of Macs, and what one decoded token costs on such a group (docs/placement.md, "Tensor and
hybrid plans").

A group of s Macs (ranks, in their all-reduce ring order) runs each layer together. Each rank
holds a share of the KV heads, with the query heads that attend to them (GQA: heads_per_kv
query heads per KV head, so no KV head is held twice), and a share of the MLP columns
(intermediate_size, in blocks of COLUMN_BLOCK so that MLX's quantisation groups of 64 stay
whole). Shares may be uneven and a rank may hold no KV head: 3 Macs split 8 KV heads 3/3/2.

Per layer and token (decode is memory-bound, so a rank's time is the bytes it reads of the
layer over its bandwidth, which its measured layer_ms already folds in, plus the part of
layer_ms that no split divides, fixed_ms: each operation's dispatch, which a rank pays
whatever its share; worker/measure.py measures it by timing the layer cut to a quarter):

    part_r(x) = fixed_ms_r x x / bytes read + (layer_ms_r - fixed_ms_r) x x_r / bytes read
    layer = max_r part_r(attention)  + all-reduce  +  max_r part_r(MLP)  + all-reduce

where x is what the whole layer reads of that sublayer and x_r what rank r reads of it (the
fixed part goes with the sublayer in proportion to its bytes; a rank with no share of a
sublayer pays nothing there).

The bytes of a layer are split by parameter count (q, o: 2 h^2; k, v: 2 h (K h / H); MLP:
3 h I), or by the model's attention_bytes when it says them; the KV cache of the configured
context goes with the KV heads. A mixture of experts reads, per token, its attention and the
active experts only (SplitShape.active_layer_bytes, issue 17), while its memory holds every
expert: the MLP's share of the time is the active bytes', of the memory all experts'. Each all-reduce waits
for the slowest rank, hence the two maxima. A ring all-reduce of B bytes (B = the model's
activation_bytes, hidden_size x bytes per element) over s ranks takes 2 (s - 1) steps, each
the slowest ring edge's latency + (B / s) / bandwidth. The latency of an edge is
RDMA_LATENCY_MS when every edge of the group's ring has an RDMA link (the workers then use
JACCL), else half the link's measured RTT (MLX's ring backend over TCP). Shares minimise the
maximum rank time (min-max integer allocation by the part of a layer that a split divides,
each rank's fixed part an offset it pays once it holds anything), or, as a second
candidate when memory is tight, the maximum rank's bytes per free byte.

Memory of a rank: layers x its bytes per layer (weights and KV cache of its KV heads); the
embeddings and the LM head are not split: every rank of a first group holds the embeddings,
every rank of a last group the head.

Between groups the pipeline hop of core/placement_cost.py goes from the last rank of a group
to the first rank of the next, which then shares the activation with its group: one more
all-reduce of activation_bytes (MLX has no broadcast: all_sum with zeros elsewhere); the
first group of a hybrid shares the token id the same way (TOKEN_BYTES). A tensor plan of one
group has no hop at all: every rank computes the same token.

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2pmesh.core.placement_cost import (HOP_MS_MAX, NETWORK_GBPS, ModelSpec, NodeSpec, Share, ScenarioError,
                                          to_ticks)
from p2pmesh.core.ring import DEFAULT_RTT_MS, Link

RDMA_LATENCY_MS = 0.005
"""One all-reduce step's latency over RDMA on Thunderbolt 5 (JACCL). An assumption until
measured on our workers: ib_send_lat measures 4.15-4.64 us average for 64 B-4 KiB messages
between two Macs on an 80 Gb/s TB5 link (hellas-ai/thunderbolt-ibverbs, partitioning.md 7.1),
other reports 5-9 us. Without RDMA a step costs the link's measured rtt/2 (TCP over
Thunderbolt: tens to hundreds of microseconds on macOS; the kind default is 0.1 ms)."""
COLUMN_BLOCK = 64
"""MLP columns are split in blocks of this many (when intermediate_size is a multiple), so a
rank's down projection keeps MLX's quantisation groups (64 inputs) whole."""
TOKEN_BYTES = 4
"""The sampled token id that the first group of a hybrid shares with its ranks."""


@dataclass(frozen=True, slots=True)
class TensorShape:
    """The model's shape as tensor parallelism splits it, per layer: memory (weights and KV
    cache) and, separately, the bytes one token reads, which for a mixture of experts is not
    every expert (issue 17)."""
    kv_heads: int
    heads_per_kv: int
    blocks: int  # MLP column blocks
    block: int  # columns per block
    attn_bytes_per_kv: float  # weights (q, k, v, o) and KV cache of one KV head
    mlp_bytes_per_block: float
    layer_bytes: int  # weights and KV cache of a whole layer (ModelSpec.bytes_per_layer)
    attn_read_per_kv: float  # what a token reads of them: all of the attention and its cache ...
    mlp_read_per_block: float  # ... and the routed experts' share (dense: all of the MLP)
    read_bytes: int  # what a token reads of a whole layer, with the KV cache
    even: bool = False  # every rank the same share (SplitShape.even_split)


def tensor_shape(model: ModelSpec) -> TensorShape | None:
    """None when the model does not say its shape; ScenarioError when the shape is not one
    tensor parallelism can split (heads that do not divide the hidden size, query heads that
    are not a multiple of the KV heads).

    The attention's weights are model.split.attention_bytes when given, else counted from the shape
    (q, o: 2 h^2; k, v: 2 h K h/H; MLP: 3 h I). A token reads all of the attention and the KV
    cache, and model.read_layer_bytes - attention of the MLP (an MoE's active experts), cut
    in the same column proportions as the memory."""
    s = model.split
    if not s.known:
        return None
    why = s.problem(model.layer_bytes)
    if why is not None:
        raise ScenarioError(why)
    h, H, K, I = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.intermediate_size
    if s.attention_bytes:
        attn_w = float(s.attention_bytes)
        mlp_w = float(model.layer_bytes - s.attention_bytes)
    else:
        head_dim = h // H
        qo, kv, mlp = 2 * h * h, 2 * h * K * head_dim, 3 * h * I
        total = qo + kv + mlp
        attn_w = model.layer_bytes * (qo + kv) / total
        mlp_w = model.layer_bytes * mlp / total
    cache = model.kv_bytes_per_token_per_layer * model.context_tokens
    block = COLUMN_BLOCK if I % COLUMN_BLOCK == 0 else 1
    blocks = I // block
    attn, mlp_mem = (attn_w + cache) / K, mlp_w / blocks
    if not s.active_layer_bytes:  # dense: a token reads what the layer holds
        return TensorShape(K, H // K, blocks, block, attn, mlp_mem, model.bytes_per_layer, attn, mlp_mem,
                           model.bytes_per_layer, s.even_split)
    mlp_read = max(0.0, s.active_layer_bytes - attn_w) / blocks
    return TensorShape(K, H // K, blocks, block, attn, mlp_mem, model.bytes_per_layer, attn, mlp_read,
                       s.active_layer_bytes + cache, s.even_split)


def split(weights: Sequence[int], total: int, prefer: Sequence[int] | None = None,
          offsets: Sequence[int] | None = None) -> list[int]:
    """Integer x_r summing to total that minimise max_r cost_r(x_r), where cost_r(x) =
    offsets[r] + weights[r] * x for x > 0 and 0 for x = 0 (weights > 0; offsets >= 0: the
    fixed part a rank pays once it holds anything, default none): from the continuous
    optimum's floors less one (never above an optimal split), one unit at a time to the rank
    whose cost grows to the least. Ties go to the larger ``prefer`` (the group's memory: the
    split then fits more layers, and the same Macs in the other order get the same split),
    then to the earlier rank. Exact (greedy is optimal for a min-max of nondecreasing costs);
    at most ~2 s units go one by one."""
    n = len(weights)
    pref = list(prefer) if prefer is not None else [0] * n
    off = list(offsets) if offsets is not None else [0] * n
    x = [max(0, math.floor((t_c - c) / w) - 1) for w, c in zip(weights, off)] if (t_c := _level(weights, off, total)) else [0] * n
    while sum(x) > total:  # float slop only: bounded by len(x)
        r = max(range(n), key=lambda i: (off[i] + weights[i] * x[i], -pref[i], i))
        x[r] -= 1

    def cost_after(i: int) -> int:
        return off[i] + weights[i] * (x[i] + 1)

    heap = [(cost_after(i), -pref[i], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total - sum(x)):  # bounded: ~2 len(x) units
        _, _, r = heapq.heappop(heap)
        x[r] += 1
        heapq.heappush(heap, (cost_after(r), -pref[r], r))
    return x


def _level(weights: Sequence[int], offsets: Sequence[int], total: int) -> float:
    """The continuous optimum's cost t: sum over ranks of max(0, (t - offset) / weight) = total
    (every rank that holds anything at the same cost)."""
    if total <= 0:
        return 0.0
    order = sorted(range(len(weights)), key=lambda i: offsets[i])
    inv = num = 0.0
    t = 0.0
    for pos, i in enumerate(order):  # add ranks in the order of their offsets
        inv += 1.0 / weights[i]
        num += offsets[i] / weights[i]
        t = (total + num) / inv
        if pos + 1 == len(order) or t <= offsets[order[pos + 1]]:
            break
    return t


@dataclass(frozen=True, slots=True)
class GroupCost:
    """A group's split and its costs (ticks), as a pipeline stage would have them."""
    ranks: tuple[int, ...]  # node positions, in ring order
    shares: tuple[Share, ...]
    per_layer: int
    cap_first: int  # layers it holds as the first group (embeddings on every rank) ...
    cap_mid: int
    cap_last: int  # ... as the last (the LM head on every rank) ...
    cap_both: int  # ... as the only one
    entry_token: int  # sharing the token id with its ranks (first group of a hybrid)
    entry_act: int  # sharing the activation with its ranks (a later group)


@dataclass(frozen=True, slots=True)
class TensorContext:
    ids: tuple[str, ...]
    layers: int
    ms: tuple[int, ...]  # ticks per whole layer, as placement_cost
    fixed: tuple[int, ...]  # ticks of it that a rank pays whatever its share (NodeSpec.layer_fixed_ms)
    memory: tuple[int, ...]
    embed: int
    activation_bytes: int
    shape: TensorShape
    conns: dict[tuple[int, int], tuple[tuple[float, float, bool], ...]]  # (i < j) -> (gbps, rtt_ms, rdma) per kind and rdma
    memo: dict[tuple[tuple[int, ...], int], int] = field(default_factory=dict)  # all-reduce ticks, this solve only


def tensor_context(model: ModelSpec, nodes: Sequence[NodeSpec], links: Sequence[Link], ms: Sequence[int]) -> TensorContext | None:
    """None when the model does not say its shape (no tensor plan is possible)."""
    shape = tensor_shape(model)
    if shape is None:
        return None
    ids = tuple(n.node_id for n in nodes)
    index = {n: i for i, n in enumerate(ids)}
    groups: dict[tuple[int, int, str, bool], list[float]] = {}
    for link in links:
        i, j = index.get(link.a), index.get(link.b)
        if i is None or j is None or i == j:
            continue  # links are checked by placement_cost.cost_context
        rtt = DEFAULT_RTT_MS.get(link.kind, DEFAULT_RTT_MS["network"]) if link.rtt_ms is None else link.rtt_ms
        g = groups.setdefault((min(i, j), max(i, j), link.kind, bool(link.rdma)), [0.0, math.inf])
        g[0] += link.gbps
        g[1] = min(g[1], rtt)
    conns: dict[tuple[int, int], list[tuple[float, float, bool]]] = {}
    for (i, j, _kind, rdma), (gbps, rtt) in sorted(groups.items()):
        conns.setdefault((i, j), []).append((gbps, rtt, rdma))
    fixed = tuple(min(m, to_ticks(n.layer_fixed_ms)) for m, n in zip(ms, nodes))
    return TensorContext(ids, model.layers, tuple(ms), fixed, tuple(n.memory_bytes for n in nodes), model.embed_bytes,
                         model.activation_bytes, shape, {k: tuple(v) for k, v in conns.items()})


_NO_LINK = ((NETWORK_GBPS, DEFAULT_RTT_MS["network"], False),)


def allreduce_ticks(tctx: TensorContext, ranks: Sequence[int], nbytes: int) -> int:
    """A ring all-reduce of nbytes over ranks in this order: 2 (s - 1) steps of the slowest
    edge (module comment); RDMA latency only when every edge of the ring has RDMA."""
    s = len(ranks)
    if s < 2:
        return 0
    key = (min(tuple(ranks), tuple(reversed(ranks))), nbytes)  # the reversed ring has the same edges
    got = tctx.memo.get(key)
    if got is None:
        got = tctx.memo[key] = _allreduce(tctx, ranks, nbytes)
    return got


def _allreduce(tctx: TensorContext, ranks: Sequence[int], nbytes: int) -> int:
    s = len(ranks)
    edges = [tuple(sorted((ranks[t], ranks[(t + 1) % s]))) for t in range(s)]
    conns = [tctx.conns.get(e, _NO_LINK) for e in edges]  # type: ignore[call-overload]
    rdma = all(any(c[2] for c in cs) for cs in conns)
    chunk_bits = nbytes * 8 / s
    step = 0.0
    for cs in conns:
        best = min((RDMA_LATENCY_MS if rdma else rtt / 2) + chunk_bits / (gbps * 1e6)
                   for gbps, rtt, has in cs if has or not rdma)
        step = max(step, best)
    return to_ticks(min(HOP_MS_MAX, 2 * (s - 1) * step))


def _weights_by_memory(free: Sequence[int]) -> list[int]:
    """Integer weights for the split that fills each rank's free memory alike (1 / free)."""
    return [-(-(1 << 80) // f) for f in free]


def group_cost(tctx: TensorContext, ranks: tuple[int, ...], by_memory: bool = False) -> GroupCost | None:
    """The group's split and costs; None when a rank has no memory to offer (by_memory), or
    when the model splits only evenly and its KV heads or column blocks do not divide."""
    sh = tctx.shape
    n = len(ranks)
    if sh.even:
        if sh.kv_heads % n or sh.blocks % n or (by_memory and any(tctx.memory[r] <= 0 for r in ranks)):
            return None
        return split_cost(tctx, ranks, [sh.kv_heads // n] * n, [sh.blocks // n] * n)
    if by_memory:
        if any(tctx.memory[r] <= 0 for r in ranks):
            return None
        w = _weights_by_memory([tctx.memory[r] for r in ranks])
    else:
        # The part of a layer that a split divides, per unit; the fixed part is an offset
        # (split's offsets, in the same units: fixed x units in the whole layer).
        w = [max(1, tctx.ms[r] - tctx.fixed[r]) for r in ranks]
    # Split in the order of the ring positions, whatever the group's ring order: the same
    # Macs get the same split both ways round (and the search reuses it).
    canon = sorted(range(len(ranks)), key=lambda t: ranks[t])
    cw, mem = [w[t] for t in canon], [tctx.memory[ranks[t]] for t in canon]
    fixed = [0 if by_memory else tctx.fixed[ranks[t]] for t in canon]
    kv, cols = [0] * len(ranks), [0] * len(ranks)
    for t, k, b in zip(canon, split(cw, sh.kv_heads, mem, [f * sh.kv_heads for f in fixed]),
                       split(cw, sh.blocks, mem, [f * sh.blocks for f in fixed])):
        kv[t], cols[t] = k, b
    return split_cost(tctx, ranks, kv, cols)


def split_cost(tctx: TensorContext, ranks: tuple[int, ...], kv: Sequence[int], cols: Sequence[int]) -> GroupCost:
    """The costs of a group with a given split: KV heads and MLP column blocks per rank."""
    sh = tctx.shape
    # A rank's time is its fixed part of the sublayer plus the rest of layer_ms x its share of
    # the bytes a token reads (dense: of the layer); none at all without a share.
    attn_whole = sh.kv_heads * sh.attn_read_per_kv / sh.read_bytes
    mlp_whole = sh.blocks * sh.mlp_read_per_block / sh.read_bytes
    attn = max(_part(tctx, r, attn_whole, k * sh.attn_read_per_kv / sh.read_bytes) for r, k in zip(ranks, kv))
    mlp = max(_part(tctx, r, mlp_whole, b * sh.mlp_read_per_block / sh.read_bytes) for r, b in zip(ranks, cols))
    act = allreduce_ticks(tctx, ranks, tctx.activation_bytes)
    need = [math.ceil(k * sh.attn_bytes_per_kv + b * sh.mlp_bytes_per_block) for k, b in zip(kv, cols)]
    L = tctx.layers

    def cap(extra: int) -> int:
        out = L
        for r, n in zip(ranks, need):
            free = tctx.memory[r] - extra
            if free < 0:
                return 0
            if n:
                out = min(out, free // n)
        return out

    e = tctx.embed
    return GroupCost(
        ranks=ranks,
        shares=tuple(Share(k * sh.heads_per_kv, k, b * sh.block) for k, b in zip(kv, cols)),
        per_layer=max(1, attn + mlp + 2 * act),
        cap_first=cap(e), cap_mid=cap(0), cap_last=cap(e), cap_both=cap(2 * e),
        entry_token=allreduce_ticks(tctx, ranks, TOKEN_BYTES),
        entry_act=act,
    )


def _part(tctx: TensorContext, r: int, whole: float, share: float) -> int:
    """Ticks of rank r for its share of a sublayer that is `whole` of the layer's reads."""
    if share <= 0:
        return 0
    fixed = tctx.fixed[r]
    return round(fixed * whole + (tctx.ms[r] - fixed) * share)


def group_costs(tctx: TensorContext, ranks: tuple[int, ...]) -> list[GroupCost]:
    """The candidate splits of a group of two or more: the fastest, and the one that holds
    the most layers when that holds more (memory is tight). A group of one is a pipeline
    stage (placement_cost), not costed here."""
    fast = group_cost(tctx, ranks)
    if fast is None:  # an even-only model that this group's size does not divide
        return []
    if fast.cap_mid >= tctx.layers or tctx.shape.even:  # (an even split has no other candidate)
        return [fast]  # it holds every layer: memory cannot be the reason to split otherwise
    roomy = group_cost(tctx, ranks, by_memory=True)
    if roomy is None or roomy.cap_mid <= fast.cap_mid:
        return [fast]
    return [roomy] if roomy.per_layer <= fast.per_layer else [fast, roomy]
