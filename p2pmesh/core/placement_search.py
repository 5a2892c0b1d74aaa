"""The exact search behind core/placement.py: the plan of least cost over every rotation and
direction of the ring.

Input is the cost context (core/placement_cost.py) and, per Mac, prefix keys that fold the
movement tie-break into the compute (``prefix_keys``). For each order an exact dynamic
program over contiguous splits (a sliding-window minimum over list operations; successors
folded through one running minimum, so a ring cabling costs O(N L) per order); orders are
skipped only when a sound lower bound shows they cannot win. "latency" minimises the key
(tpot, then moved layers); "throughput" first finds the least bottleneck (a binary search
per order over a bit-parallel reachability check), then the least key among the plans that
reach it. ``reconstruct`` walks the winning DP forward with the tie-breaks of
core/placement.py.

Pure: no clock, no I/O, no randomness; only p2pmesh.core imports.
"""
from __future__ import annotations

from itertools import accumulate, repeat

from p2pmesh.core.placement_cost import MOVE_SCALE, CostContext, Plan

INF = 1 << 120
HALF_INF = INF >> 1
_SMALL_WINDOW = 8  # windows up to this size: log2(c) doubling passes beat van Herk/Gil-Werman


def prefix_keys(ctx: CostContext, current: Plan | None) -> list[list[int]]:
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
        w = ctx.ms[j] * MOVE_SCALE + moves
        if moves:
            kept = list(accumulate((1 if o == j else 0 for o in owner), initial=0))
            out.append([m * w - kept[m] for m in range(L + 1)])
        else:
            out.append([m * w for m in range(L + 1)])
    return out


def ring_orders(n: int) -> list[tuple[int, ...]]:
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


def emin(X: list[int], Y: list[int]) -> list[int]:
    """Elementwise minimum (a comprehension: about 3x faster than map(min, ...))."""
    return [x if x < y else y for x, y in zip(X, Y)]  # noqa: FURB136 (min() is the slow path)


def window_min(A: list[int], c: int, L: int) -> list[int]:
    """W[l] = min(A[l+1 .. l+c]) for l in 0..L-1 (A has L+1 entries), W[L] = inf, in O(L)
    whatever c: a suffix minimum when the window reaches the end, doubling for small
    windows, otherwise van Herk/Gil-Werman (prefix and suffix minima within blocks of c)."""
    B = A[1:]
    if c >= L:
        W = []
        cur = INF
        for x in reversed(B):
            if x < cur:  # noqa: PLR1730 (a comparison, not a call: this is the hot loop)
                cur = x
            W.append(cur)
        W.reverse()
    elif c <= _SMALL_WINDOW:
        B.extend(repeat(INF, c))
        s = 1
        while 2 * s <= c:  # bounded: log2(c) passes, each widening the window to 2s
            B = emin(B, B[s:])
            s *= 2
        if s < c:
            B = emin(B, B[c - s :])
        W = B[:L]
    else:
        size = -(-(L + c - 1) // c) * c
        B.extend(repeat(INF, size - L))
        pre: list[int] = []
        suf: list[int] = []
        for b in range(0, size, c):  # bounded: size / c blocks of c
            cur = INF
            for x in B[b : b + c]:
                if x < cur:  # noqa: PLR1730 (as above)
                    cur = x
                pre.append(cur)
            cur = INF
            back = []
            for x in reversed(B[b : b + c]):
                if x < cur:  # noqa: PLR1730 (as above)
                    cur = x
                back.append(cur)
            back.reverse()
            suf.extend(back)
        W = emin(suf[:L], pre[c - 1 : c - 1 + L])
    W.append(INF)
    return W


def _limit(budget: int, ms: int, cap: int) -> int:
    """Layers a stage may take when its time (layers * ms) must stay within budget."""
    return cap if budget >= cap * ms else min(cap, budget // ms)


def _order_dp(ctx: CostContext, seq: tuple[int, ...], P: list[list[int]], bound: int | None) -> list[list[int] | None] | None:
    """The exact DP for one order. Gs[idx][l] = the least key of covering layers [l, L) with
    a stage of seq[idx] starting at l, its own overhead excluded (the predecessor adds it with
    the hop), or about INF. Gs[0] = [key at l = 0]. None when this order has no plan.
    bound (throughput): every stage, with its outgoing hop, must take at most bound ticks."""
    n, L, S, C = len(seq), ctx.layers, MOVE_SCALE, ctx.overhead
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
            G[a:L] = emin(G[a:L], [end - p for p in Pj[a:L]])
        G[0] = G[L] = INF
        if min(G) < HALF_INF:
            Gs[idx] = G
            M = G if M is None else emin(M, G)
    j = p0
    Pj = P[j]
    ms = ctx.ms[j]
    best = INF
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
    if best >= HALF_INF:
        return None
    Gs[0] = [best]
    return Gs


def _successors(ctx: CostContext, seq: tuple[int, ...], idx: int, Gs: list[list[int] | None], M: list[int] | None,
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


def _continue(ctx: CostContext, seq: tuple[int, ...], idx: int, Gs: list[list[int] | None], M: list[int] | None,
              Pj: list[int], bound: int | None) -> list[int]:
    """G of seq[idx] when it hands over to a later stage: for each start l, the least key of
    taking layers [l, m) (at most its window) and then the best successor from m."""
    L, S, C = ctx.layers, MOVE_SCALE, ctx.overhead
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
            H = emin(H, other)
        W = window_min([p + h for p, h in zip(Pj, H)], c, L)
        G = W if G is None else emin(G, W)
    return [INF] * (L + 1) if G is None else [g - p for g, p in zip(G, Pj)]


def reconstruct(ctx: CostContext, seq: tuple[int, ...], Gs: list[list[int] | None], P: list[list[int]], bound: int | None) -> list[tuple[int, int, int]]:
    """Walk the DP forward. Ties: end the pipeline, then more layers on this stage, then the
    nearer next Mac (the integer keys make every comparison exact)."""
    n, L, S, C = len(seq), ctx.layers, MOVE_SCALE, ctx.overhead
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


def _lower_bounds(ctx: CostContext) -> list[int | None]:
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


Found = tuple[tuple[int, ...], list[list[int] | None], int | None]


def solve_latency(ctx: CostContext, P: list[list[int]]) -> Found | None:
    orders = ring_orders(len(ctx.ids))
    lbs = _lower_bounds(ctx)
    S, C = MOVE_SCALE, ctx.overhead
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


def _feasible(ctx: CostContext, seq: tuple[int, ...], bound: int) -> bool:
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


def solve_throughput(ctx: CostContext, P: list[list[int]]) -> Found | None:
    """The least bottleneck (binary search per order, skipping orders that cannot beat the
    best so far), then the least (tpot, moves) among the plans that reach it."""
    orders = ring_orders(len(ctx.ids))
    n, L, C, S = len(ctx.ids), ctx.layers, ctx.overhead, MOVE_SCALE
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
