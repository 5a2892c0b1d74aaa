"""The search for tensor and hybrid plans (issue 16): tensor groups chained as a pipeline.

A group is a contiguous arc of a rotation of the ring (in either direction), of one Mac (a
pipeline stage, costed as core/placement_cost.py does) or of 2..max_group Macs (a tensor
group, costed by core/tensor_cost.py). A plan is a chain of groups along one order, each a
contiguous range of layers; Macs between two groups may be skipped (the hop then goes over
whatever connects them). A plan of one group may be any arc, up to the whole ring.

For each order (first Mac, direction) a dynamic program over (group, first layer), like the
pipeline's (placement_search.py): per unit (an arc and its split), the least cost of covering
layers [l, L) starting with it is a sliding-window minimum over the layers it may take; its
successors are folded per last Mac through one running minimum at the largest hop plus the
cheaper hops one by one. Two arrays per unit: any plan, and plans holding a tensor group
(for a forced hybrid). Costs are integer ticks: ties are real and the result bit-identical.

Bound: max_group Macs per group in a chain (MAX_GROUP, 8 by default; a one-group plan tries
every size), so a ring of N Macs costs O(N x max_group) window minima of O(L) per order and
2N orders. docs/placement.md has the measured worst case.

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from p2pmesh.core.placement_cost import CostContext
from p2pmesh.core.placement_search import HALF_INF, INF, emin, ring_orders, window_min
from p2pmesh.core.tensor_cost import GroupCost, TensorContext, group_costs

MAX_GROUP = 6
"""The largest tensor group inside a chain of groups. One-group (tensor) plans try every
size. Larger chained groups only pay off over RDMA, which needs a full mesh of TB5 cables
(a Mac has at most 5 usable RDMA ports), so 8 loses nothing real and keeps 16 Macs fast."""
MODES = ("auto", "tensor", "hybrid")

Placed = tuple[GroupCost, int, int]  # a group and its layers [start, end)


def single_unit(ctx: CostContext, i: int) -> GroupCost:
    """A Mac alone: a pipeline stage, with placement_cost's caps and no all-reduce."""
    return GroupCost((i,), (), ctx.ms[i], ctx.cap_first[i], ctx.cap_mid[i], ctx.cap_last[i], ctx.cap_both[i], 0, 0)


def evaluate_groups(ctx: CostContext, placed: list[Placed]) -> tuple[int, int]:
    """(tpot, slowest stage) in ticks of a chain of groups (tensor_cost.py's module comment)."""
    k = len(placed)
    tpot = slowest = 0
    for g, (u, a, b) in enumerate(placed):
        entry = 0 if k == 1 else (u.entry_token if g == 0 else u.entry_act)
        if g + 1 < k:
            hop = ctx.fwd[u.ranks[-1]][placed[g + 1][0].ranks[0]]
        else:
            hop = ctx.ret[u.ranks[-1]][placed[0][0].ranks[0]] if k > 1 else 0
        stage = (b - a) * u.per_layer + ctx.overhead + entry + hop
        tpot += stage
        slowest = max(slowest, stage)
    return tpot, slowest


@dataclass
class _OrderDP:
    seq: tuple[int, ...]
    units: list[list[GroupCost]]  # per start position (1..n-1): the units starting there
    A: dict[int, list[int]]  # id(unit) -> least cost from layer l (any plan)
    T: dict[int, list[int]]  # id(unit) -> least cost from layer l (plans with a tensor group)
    CA: list[list[int]]  # per last position q: the least cost from layer m after q (any plan) ...
    CT: list[list[int]]  # ... (with a tensor group)


class _Units:
    """Group costs by rank tuple, computed once per solve."""

    def __init__(self, ctx: CostContext, tctx: TensorContext) -> None:
        self.ctx, self.tctx = ctx, tctx
        self.cache: dict[tuple[int, ...], list[GroupCost]] = {}

    def at(self, ranks: tuple[int, ...]) -> list[GroupCost]:
        got = self.cache.get(ranks)
        if got is None:
            back = self.cache.get(ranks[::-1]) if len(ranks) > 1 else None
            if back is not None:  # the same Macs the other way round: the same split and costs
                got = [replace(u, ranks=ranks, shares=u.shares[::-1]) for u in back]
            else:
                got = [single_unit(self.ctx, ranks[0])] if len(ranks) == 1 else group_costs(self.tctx, ranks)
            self.cache[ranks] = got
        return got


def _fold(ctx: CostContext, seq: tuple[int, ...], q: int, B: list[list[int]], M: list[int]) -> list[int]:
    """C[m] = min over p' > q of fwd(seq[q] -> seq[p']) + B[p'][m]: M (the minimum of B[p'] for
    all p' > q) at the largest hop, exact there and never below the truth elsewhere, then the
    cheaper hops one by one (placement_search._successors' argument)."""
    n = len(seq)
    hops = [(p2, ctx.fwd[seq[q]][seq[p2]]) for p2 in range(q + 1, n)]
    top = max(h for _, h in hops)
    C = [x + top for x in M]
    for p2, h in hops:
        if h < top:
            C = emin(C, [x + h for x in B[p2]])
    return C


def _order_dp(ctx: CostContext, units: _Units, seq: tuple[int, ...], max_group: int, with_t: bool,
              useless: int) -> _OrderDP:
    """The suffix arrays of every unit after the first position of this order (with_t: also
    those of plans holding a tensor group, for a forced hybrid). Units whose per-layer cost
    is at least ``useless`` are left out: no plan with them can win (solve_grouped)."""
    n, L, Cst = len(seq), ctx.layers, ctx.overhead
    p0 = seq[0]
    none = [INF] * (L + 1)
    BA: list[list[int]] = [none] * (n + 1)
    BT: list[list[int]] = [none] * (n + 1)
    CA: list[list[int]] = [none] * n  # per last position q: the best successor from layer m
    CT: list[list[int]] = [none] * n
    MA, MT = none, none
    dp = _OrderDP(seq, [[] for _ in range(n)], {}, {}, CA, CT)
    for p in range(n - 1, 0, -1):
        bA, bT = none, none
        for s in range(1, min(max_group, n - p) + 1):
            q = p + s - 1
            for u in units.at(seq[p:q + 1]):
                if u.per_layer >= useless:
                    continue
                dp.units[p].append(u)
                c, entry = u.per_layer, u.entry_act
                wide = s > 1
                ends = [INF] * (L + 1)
                ce = u.cap_last
                if ce >= 1:
                    end_add = Cst + entry + ctx.ret[seq[q]][p0]
                    for l in range(max(1, L - ce), L):
                        ends[l] = (L - l) * c + end_add
                a_arr = _cont(CA[q], c, u.cap_mid, Cst + entry, L)
                a_arr = emin(a_arr, ends)
                t_arr = a_arr if wide or not with_t else _cont(CT[q], c, u.cap_mid, Cst + entry, L)
                a_arr[0] = t_arr[0] = INF  # a later group never starts at layer 0
                dp.A[id(u)], dp.T[id(u)] = a_arr, t_arr
                bA = emin(bA, a_arr)
                if with_t:
                    bT = emin(bT, t_arr)
        BA[p], BT[p] = bA, bT
        MA = emin(MA, bA)
        MT = emin(MT, bT) if with_t else none
        CA[p - 1] = _fold(ctx, seq, p - 1, BA, MA)
        CT[p - 1] = _fold(ctx, seq, p - 1, BT, MT) if with_t else none
    return dp


def _cont(C: list[int], c: int, cap: int, add: int, L: int) -> list[int]:
    """Least cost from each layer l of taking layers [l, m), m within cap, then C[m]."""
    if cap < 1:
        return [INF] * (L + 1)
    W = window_min([m * c + x for m, x in enumerate(C)], cap, L)
    return [w - l * c + add for l, w in enumerate(W)]


def _first_options(ctx: CostContext, dp: _OrderDP, u: GroupCost, mode: str) -> list[tuple[int, int]]:
    """(cost, layers of the first group; L = it is the only one) for a first unit u."""
    L, Cst = ctx.layers, ctx.overhead
    s = len(u.ranks)
    out: list[tuple[int, int]] = []
    if L <= u.cap_both and (mode == "auto" or (mode == "tensor" and s > 1)):
        out.append((L * u.per_layer + Cst, L))
    if mode == "tensor":
        return out
    C = (dp.CT if mode == "hybrid" and s == 1 else dp.CA)[s - 1]
    add = Cst + u.entry_token
    for m in range(1, min(u.cap_first, L - 1) + 1):
        if C[m] < HALF_INF:
            out.append((m * u.per_layer + add + C[m], m))
    return out


def solve_grouped(ctx: CostContext, tctx: TensorContext, mode: str = "auto", max_group: int = MAX_GROUP,
                  beat: int | None = None) -> list[Placed] | None:
    """The least-tpot chain of groups. mode "auto": any (one Mac, a pipeline, tensor or
    hybrid); "tensor": one group of two or more Macs; "hybrid": two or more groups, one of
    them a tensor group. None when no such plan fits (or, with ``beat``, none costs less
    than beat ticks: the caller has that plan already, e.g. the best pipeline).

    One-group plans are tried first (one cost per arc); the chains' DP runs only when a sound
    lower bound says a chain could win: L x the least per-layer cost of any arc of at most
    max_group Macs, two overheads, the cheapest forward and return hops."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    n, L, Cst = len(ctx.ids), ctx.layers, ctx.overhead
    units = _Units(ctx, tctx)
    orders = ring_orders(n)
    best: Best | None = None
    if mode != "hybrid":
        for seq in orders:  # bounded: 2n orders x n sizes
            for s in range(2 if mode == "tensor" else 1, n + 1):
                for u in units.at(seq[:s]):
                    if L <= u.cap_both and (best is None or L * u.per_layer + Cst < best[0]):
                        best = (L * u.per_layer + Cst, None, u, "one group")
    if mode != "tensor" and n > 1:
        least = min(u.per_layer for seq in orders for s in range(1, min(max_group, n) + 1) for u in units.at(seq[:s]))
        hops = [ctx.fwd[i][j] for i in range(n) for j in range(n) if i != j]
        rets = [ctx.ret[i][j] for i in range(n) for j in range(n) if i != j]
        fixed = 2 * Cst + min(hops) + min(rets)  # what any chain costs beside its layers
        limits = [x for x in (beat, None if best is None else best[0]) if x is not None]
        if not limits or L * least + fixed < min(limits):
            best = _chains(ctx, units, orders, mode, max_group, best, limits, least, fixed)
    if best is None or (beat is not None and best[0] >= beat):
        return None
    cost, dp, u, _how = best
    if dp is None:
        return [(u, 0, L)]
    return _walk(ctx, dp, u, cost, mode)


Best = tuple[int, "_OrderDP | None", GroupCost, str]  # cost, the order's DP (None: one group), first unit


def _chains(ctx: CostContext, units: _Units, orders: list[tuple[int, ...]], mode: str, max_group: int,
            best: Best | None, limits: list[int], least: int, fixed: int) -> Best | None:
    """The best plan starting each order with a unit of at most max_group Macs (the DP). A
    unit whose one layer, with every other layer at the least cost, already reaches the best
    plan known is left out of the DP (sound: such a plan cannot win)."""
    n, L = len(orders[0]), ctx.layers
    for seq in orders:  # bounded: 2n orders
        limit = min(limits + ([best[0]] if best is not None else []), default=None)
        useless = INF if limit is None else limit - (L - 1) * least - fixed
        dp = _order_dp(ctx, units, seq, max_group, mode == "hybrid", useless)
        for s in range(1, min(max_group, n) + 1):
            for u in units.at(seq[:s]):
                for cost, _m in _first_options(ctx, dp, u, mode):
                    if best is None or cost < best[0]:
                        best = (cost, dp, u, "chain")
    return best


def _walk(ctx: CostContext, dp: _OrderDP, first: GroupCost, cost: int, mode: str) -> list[Placed]:
    """The groups of the winning plan: the DP walked forward, matching exact costs (ties:
    more layers on the earlier group, then the nearer next group, then the candidate found
    first)."""
    L, Cst, seq = ctx.layers, ctx.overhead, dp.seq
    n = len(seq)
    m = max(mm for c, mm in _first_options(ctx, dp, first, mode) if c == cost)
    out: list[Placed] = [(first, 0, m)]
    if m == L:
        return out
    need = mode == "hybrid" and len(first.ranks) == 1  # the rest must hold a tensor group
    q, l, target = len(first.ranks) - 1, m, cost - (m * first.per_layer + Cst + first.entry_token)
    for _ in range(n):  # bounded: at most n groups
        nxt = _next(ctx, dp, q, l, target, need)
        assert nxt is not None, "tensor search: no group reproduces the optimum (a bug)"
        p2, u = nxt
        target -= ctx.fwd[seq[q]][seq[p2]]  # now the cost of u's plan from layer l
        q, wide, add = p2 + len(u.ranks) - 1, len(u.ranks) > 1, Cst + u.entry_act
        if (wide or not need) and L - l <= u.cap_last and (L - l) * u.per_layer + add + ctx.ret[seq[q]][seq[0]] == target:
            out.append((u, l, L))
            return out
        need = need and not wide
        for m in range(min(L - 1, l + u.cap_mid), l, -1):
            rest = target - ((m - l) * u.per_layer + add)
            if _next(ctx, dp, q, m, rest, need) is not None:
                break
        else:
            raise AssertionError("tensor search: no split reproduces the optimum (a bug)")
        out.append((u, l, m))
        l, target = m, rest
    raise AssertionError("tensor search: the walk did not end (a bug)")


def _next(ctx: CostContext, dp: _OrderDP, q: int, l: int, target: int, need: bool) -> tuple[int, GroupCost] | None:
    """The first unit after position q whose plan from layer l, with the hop to it, costs
    exactly target."""
    seq = dp.seq
    for p2 in range(q + 1, len(seq)):
        hop = ctx.fwd[seq[q]][seq[p2]]
        for u in dp.units[p2]:
            if (dp.T if need else dp.A)[id(u)][l] + hop == target:
                return p2, u
    return None
