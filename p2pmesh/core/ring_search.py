"""The exact search behind core/ring.py: the best Hamiltonian cycle under the ring objective.

Input is the pair matrix ring.py builds (per pair of node indices: slow 0/1, Gb/s, RTT as an
integer count of 1e-9 ms, so sums are exact and the same in both directions). Output is the
best cycle as a list of indices from node 0, and whether it is proven best.

Three passes, all depth-first from node 0 over *states* (the set of nodes visited, the node
the path stands on) carrying the prefix's cost (slow hops, bottleneck, latency):

0. **Fewest slow hops.** The objective's first level alone, with a memo of the fewest slow
   hops each state was reached with. Its ring is the next pass's first incumbent, and its
   value bounds every prefix there: every ring has at least that many slow hops, so a
   prefix needs at least the difference, which also bounds its bottleneck (a slow hop is
   still to come) and its latency (that many slow hop ends are still to pay).
1. **Value.** Neighbours best first; a prefix is dropped when a lower bound on every ring it
   can finish (see ``_Bounds``) is no better than the best ring found, or when an earlier
   prefix reached the same state at no worse cost in every component (the completions are
   the same set of paths, so it cannot do better: this memo is Held-Karp's dynamic program
   over subsets, reached lazily). The work is therefore at most the n 2^(n-1) states times
   the prefix costs per state that no earlier one dominates, whatever the bounds achieve:
   the search always finishes, so every graph of up to 16 nodes is solved exactly.
2. **Tie-break.** With the best value known, a search in node-index order returns the first
   ring that reaches it: the lexicographically smallest node list, which is the canonical
   form (both directions of every ring start at node 0). It prunes every prefix whose bound
   exceeds the value, and every prefix dominated by one already proven unable to reach it.

**By segments.** When every pair of Macs has a hop (one network joins them all), a ring with
k >= 1 slow hops is k Thunderbolt paths joined in a circle by slow hops, and any order of
those paths is a ring too: passes 0 and, when every slow hop is the same one (a LAN whose
RTTs are unknown, as in a cluster), 1 search the paths in one canonical order only (see
``_fewest_by_segments``), which removes the (k-1)! orders the subset memo cannot merge.

All passes count *steps* (a state the memo did not settle, whose bounds are evaluated). A
search that reaches ``expansions_max`` steps stops and reports the best ring seen as not
exact (only graphs above 16 nodes get a cap by default). ``search_steps`` yields every
``slice_steps`` steps so that one solve can be spread over several steps of the leader.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

_UNREACHABLE = 1 << 200
"""A latency bound no ring reaches: the rest cannot be finished at all."""
PENALTY_ROUNDS = 10
Cost = tuple[int, float, int]
"""(slow hops, bottleneck Gb/s, latency in 1e-9 ms) of a prefix or a ring."""


def _cheapest_ends(by_lat: list[tuple[int, int]], reach: int, ends: int) -> tuple[int, int]:
    """The costs of the ``ends`` (1 or 2) cheapest ends of a node's hop list (sorted by
    cost) that lead into ``reach`` (a node bitmask): (first, second), -1 where there is none."""
    first = -1
    for cost, u in by_lat:
        if reach >> u & 1:
            if first >= 0:
                return first, cost
            if ends == 1:
                return cost, -1
            first = cost
    return first, -1


@dataclass(frozen=True, slots=True)
class Pair:
    """One usable hop between two node indices, as the search sees it."""

    slow: int
    """1 for a slow hop (anything but Thunderbolt), 0 otherwise: a number, so that the
    slow hops of a prefix are a sum like its latency."""
    gbps: float
    lat: int


@dataclass(frozen=True, slots=True)
class Found:
    """The best cycle found (node indices from 0), its cost, whether it is proven best (and
    the canonical one among equals), and how many search steps it took."""

    path: list[int]
    cost: Cost
    exact: bool
    steps: int


def better(a: Cost, b: Cost) -> bool:
    """Ring objective: fewer slow hops, then a higher bottleneck, then lower latency."""
    return (a[0], -a[1], a[2]) < (b[0], -b[1], b[2])


class _Bounds:
    """Lower bounds on what finishing a prefix costs: the rest of the ring is a path from the
    current node ``v`` through every unvisited node back to node 0.

    - Slow hops: a Thunderbolt-connected group C of those nodes carries at most |C|-1 of the
      path's Thunderbolt hops, and at most half the sum over its nodes of the cables each
      can use (a node passed through uses two, the path's two ends one each, and none more
      than it has inside C; a node whose one cable leads to a hub that has more such
      neighbours than it can use may have to use none): a Mac uses only two of its cables
      in a ring. Every other hop is slow; and never fewer than the proven fewest of any
      ring allow (``slow_min``, pass 0).
    - Bottleneck: no better than the fastest hop into each node still to enter, nor, when a
      slow hop is still needed, than the fastest slow hop.
    - Latency: each node still to enter, and node 0, is entered by one of its hops (its
      cheapest); and each hop has two ends, so half the cheapest way to give every node its
      ends (two for a node passed through, one for v and for 0) bounds the path, where at
      least two ends per slow hop still needed are slow ones. Ends are priced with node
      prices (``reprice``, ``_penalties``) when those raise the bound for the whole ring.
    """

    def __init__(self, size: int, hop: list[list[Pair | None]]) -> None:
        self.size = size
        self.hop = hop
        nb = [[j for j in range(size) if hop[i][j] is not None] for i in range(size)]
        self.fast_adj = [sum(1 << j for j in nb[i] if hop[i][j].slow == 0) for i in range(size)]  # type: ignore[union-attr]
        self.fast_in = [max(hop[i][j].gbps for j in nb[i]) for i in range(size)]  # type: ignore[union-attr]
        self.min_in = [min(hop[i][j].lat for j in nb[i]) for i in range(size)]  # type: ignore[union-attr]
        self.nb = nb
        self.pi: list[int] = []
        self.shift = 0
        self.fast_by_lat: list[list[tuple[int, int]]] = []
        self.slow_by_lat: list[list[tuple[int, int]]] = []
        self._lat_memo: dict[int, int] = {}
        self.reprice([0] * size)
        slow_gbps = [hop[i][j].gbps for i in range(size) for j in nb[i] if hop[i][j].slow]  # type: ignore[union-attr]
        self.slow_gbps_max = max(slow_gbps, default=0.0)
        self._slow_memo: dict[int, int] = {}
        self._bn_memo: dict[int, float] = {}
        self.slow_min = 0
        """The fewest slow hops of any ring, once pass 0 has proven it: every ring has at
        least that many, so a prefix with s slow hops takes at least slow_min - s more."""

    def reprice(self, pi: list[int]) -> None:
        """Price each hop end at lat + pi[x] + pi[u] (see ``_penalties``), plus a shift that
        keeps every price >= 0; the latency bound reads these prices."""
        hop, nb, size = self.hop, self.nb, self.size
        self.pi = pi
        self.shift = max(0, -min((hop[i][j].lat + pi[i] + pi[j] for i in range(size) for j in nb[i]), default=0))  # type: ignore[union-attr]
        priced = [sorted((hop[i][j].lat + pi[i] + pi[j] + self.shift, j, hop[i][j].slow) for j in nb[i]) for i in range(size)]  # type: ignore[union-attr]
        self.fast_by_lat = [[(c, j) for c, j, slow in priced[i] if not slow] for i in range(size)]
        self.slow_by_lat = [[(c, j) for c, j, slow in priced[i] if slow] for i in range(size)]
        self._lat_memo = {}

    def may_finish(self, v: int, rest: int, s: int, bn: float, lat: int, ref: Cost, *, ties: bool) -> bool:
        """Whether a ring finishing this prefix (standing on v, ``s`` slow hops, bottleneck
        ``bn``, latency ``lat``) may be better than ``ref``, or as good with ``ties``: False
        only when these bounds show that every one is worse (the value pass prunes what
        cannot improve on its best, the tie-break what cannot reach the best value)."""
        slow_more = self.slow_to_come(v, rest, s)
        s_lb = s + slow_more
        if s_lb != ref[0]:
            return s_lb < ref[0]
        bn_ub = min(bn, self.bottleneck(v, rest, slow_more > 0))
        if bn_ub != ref[1]:
            return bn_ub > ref[1]
        lat_lb = lat + self.latency(v, rest, slow_more)
        return lat_lb <= ref[2] if ties else lat_lb < ref[2]

    def slow_to_come(self, v: int, rest: int, s: int) -> int:
        """At least this many slow hops after a prefix with ``s`` of them, standing on v."""
        return max(self.slow(v, rest), self.slow_min - s)

    def slow(self, v: int, rest: int) -> int:
        """At least this many slow hops on a path v -> every node of ``rest`` -> 0."""
        if not rest:
            back = self.hop[v][0]
            return back.slow if back is not None else 0
        if v == 0:
            return 0  # the whole ring is still to come (only at the root): no bound needed
        base = self._slow_memo.get(rest)
        if base is None:
            base = self._slow_memo[rest] = self._fast_hops_max(rest | 1, 1)
        # v adds at most one Thunderbolt hop (it is an end of the path), to a node of rest
        fast = base + (1 if self.fast_adj[v] & rest else 0)
        return max(0, rest.bit_count() + 1 - fast)

    def _fast_hops_max(self, nodes: int, ends: int) -> int:
        """At most this many Thunderbolt hops in a path (or set of paths) over ``nodes``,
        where the nodes of ``ends`` can use one of their cables and the others two. Per
        group that cables connect: fewer than its nodes, and half the cables its nodes can
        use, where a node with one cable in the group that leads to a node already using
        all it can (a Mac cabled to many that have no other cable) uses none."""
        fast_adj = self.fast_adj
        fast_max = 0
        left = nodes
        while left:
            seen = frontier = left & -left
            while frontier:
                bit = frontier & -frontier
                frontier ^= bit
                new = fast_adj[bit.bit_length() - 1] & nodes & ~seen
                seen |= new
                frontier |= new
            left &= ~seen
            count = seen.bit_count()
            if count == 1:
                continue
            uses = 0
            members = seen
            leaves: dict[int, int] = {}
            while members:
                bit = members & -members
                members ^= bit
                cabled = fast_adj[bit.bit_length() - 1] & seen
                degree = cabled.bit_count()
                if degree == 1:
                    leaves[cabled] = leaves.get(cabled, 0) + 1
                uses += min(degree, 1 if bit & ends else 2)
            for hub, count_leaves in leaves.items():
                uses -= max(0, count_leaves - (1 if hub & ends else 2))
            fast_max += min(count - 1, uses // 2)
        return fast_max

    def latency(self, v: int, rest: int, slow_more: int) -> int:
        """At least this much latency on a path v -> every node of ``rest`` -> 0 (1e-9 ms),
        given that it takes at least ``slow_more`` slow hops."""
        hop = self.hop
        if not rest:
            back = hop[v][0]
            return back.lat if back is not None else 0
        key = (rest * self.size + v) * (self.size + 1) + slow_more
        got = self._lat_memo.get(key)
        if got is not None:
            return got
        # Every hop of the path has two ends; a node passed through is the end of two hops,
        # v and 0 of one each. Each end costs at least the hop it belongs to, so half the
        # cheapest way to give every node its ends bounds the path, and at least
        # 2 * slow_more of those ends are slow ones (cost per node is convex in how many of
        # its ends are slow, so taking the cheapest extra slow ends greedily is exact).
        allowed = rest | (1 << v) | 1
        total = 0
        penalty = 0  # what the prices add to any such path, counted twice (once per end)
        slow_ends = 0
        extra: list[int] = []
        entered = self.min_in[0]
        left = rest | (1 << v) | 1
        for_ends = rest
        fast_by_lat, slow_by_lat = self.fast_by_lat, self.slow_by_lat
        while left:
            bit = left & -left
            left ^= bit
            x = bit.bit_length() - 1
            if x == v or x == 0:
                ends, reach = (2 if v == 0 else 1), for_ends  # at the root, 0 is both ends
            else:
                ends, reach = 2, allowed
                entered += self.min_in[x]
            penalty += ends * (2 * self.pi[x] + self.shift)
            # the two cheapest Thunderbolt and slow ends (-1: none)
            f1, f2 = _cheapest_ends(fast_by_lat[x], reach, ends)
            s1, s2 = _cheapest_ends(slow_by_lat[x], reach, ends)
            # The node's cost with as few slow ends as it can, and the extra cost of each
            # further slow end (increasing: the cost is convex in their number).
            if ends == 1:
                if f1 >= 0:
                    total += f1
                    if s1 >= 0:
                        extra.append(s1 - f1)
                elif s1 >= 0:
                    total += s1
                    slow_ends += 1
                else:
                    return _UNREACHABLE
            elif f2 >= 0:
                total += f1 + f2
                if s1 >= 0:
                    extra.append(s1 - f2)
                    if s2 >= 0:
                        extra.append(s2 - f1)
            elif f1 >= 0:
                if s1 < 0:
                    return _UNREACHABLE
                total += f1 + s1
                slow_ends += 1
                if s2 >= 0:
                    extra.append(s2 - f1)
            elif s2 >= 0:
                total += s1 + s2
                slow_ends += 2
            else:
                return _UNREACHABLE
        # Slow ends cheaper than the Thunderbolt ends they replace are always taken; then
        # the cheapest further ones until the slow hops still needed have their ends.
        extra.sort()
        missing = 2 * slow_more - slow_ends
        if len(extra) < missing:
            return _UNREACHABLE
        take = max(missing, sum(1 for e in extra if e < 0))
        total += sum(extra[:take])
        # An end's price is its hop's latency plus both nodes' pi and the shift, the same
        # from either end: twice the path's latency is its ends' prices less ``penalty``
        # (2 pi per end at each node, a shift per end), and ``total`` bounds those prices.
        out = max(entered, (total - penalty + 1) // 2)
        self._lat_memo[key] = out
        return out

    def bottleneck(self, v: int, rest: int, need_slow: bool) -> float:
        """At most this bottleneck on a path v -> every node of ``rest`` -> 0."""
        out = self._bn_memo.get(rest)
        if out is None:
            out = self.fast_in[0]
            fast_in = self.fast_in
            left = rest
            while left:
                bit = left & -left
                left ^= bit
                out = min(out, fast_in[bit.bit_length() - 1])
            self._bn_memo[rest] = out
        if need_slow:
            out = min(out, self.slow_gbps_max)
        return out


def search_steps(size: int, hop: list[list[Pair | None]], *, expansions_max: int | None,
                 slice_steps: int | None) -> Generator[None, None, Found | None]:
    """The best cycle through nodes 0..size-1 (size >= 3), or None when there is none; a
    Found with no path when the cap stopped the search before any ring. The generator
    yields after every ``slice_steps`` search steps (never when None), so a caller that
    must stay responsive (the leader's event loop) can spread one solve over its steps."""
    budget = _Budget(expansions_max, slice_steps)
    bounds = _Bounds(size, hop)
    neighbours = _neighbours(size, hop)
    slow_kinds = _slow_kinds(size, hop)
    by_segments = (yield from _fewest_by_segments(size, hop, budget)) if slow_kinds else None
    if by_segments is not None:
        slow_fewest, fewest_path = by_segments
        if len(slow_kinds) == 1:
            (background,) = slow_kinds
            return (yield from _value_by_segments(size, hop, background, slow_fewest, fewest_path, budget))
    else:
        fewest = _FewestSlow(size, hop, neighbours, bounds, budget)
        yield from fewest.run()
        if fewest.complete and fewest.best is None:
            return None
        slow_fewest = fewest.best if fewest.complete else 0
        fewest_path = fewest.best_path
    bounds.slow_min = slow_fewest
    _choose_prices(size, hop, bounds)
    value = _Value(size, hop, neighbours, bounds, budget)
    if fewest_path:  # its ring is a good first incumbent: it has the fewest slow hops
        value.best, value.best_path = _cost(hop, fewest_path), fewest_path
    yield from value.run()
    if value.best is None:
        return None if value.exact else Found([], (0, 0.0, 0), False, budget.used)
    if not value.exact:
        return Found(value.best_path, value.best, False, budget.used)
    path = yield from _tie_break(size, hop, bounds, value.best, budget)
    if path is None:  # the tie-break ran out of steps: the value is still proven
        return Found(value.best_path, value.best, False, budget.used)
    return Found(path, value.best, True, budget.used)


def _neighbours(size: int, hop: list[list[Pair | None]]) -> list[list[int]]:
    """Each node's neighbours, best hop first (the value pass finds good rings early)."""
    return [
        sorted((j for j in range(size) if hop[i][j] is not None),
               key=lambda j, i=i: (hop[i][j].slow, -hop[i][j].gbps, hop[i][j].lat, j))  # type: ignore[union-attr]
        for i in range(size)
    ]


def _tie_break(size: int, hop: list[list[Pair | None]], bounds: _Bounds, target: Cost,
               budget: _Budget) -> Generator[None, None, list[int] | None]:
    ties = _TieBreak(size, hop, bounds, target, budget)
    return (yield from ties.run())


def _slow_kinds(size: int, hop: list[list[Pair | None]]) -> set[Pair]:
    """The distinct slow hops when every pair has a hop (every Mac on one network): segments
    joined by slow hops may then go in any order, and when there is only one kind (one LAN
    whose RTTs are unknown, as in a cluster: only cables are probed) every order costs the
    same. Empty when a pair has no hop or no hop is slow."""
    pairs = [hop[i][j] for i in range(size) for j in range(i + 1, size)]
    if any(h is None for h in pairs):
        return set()
    return {h for h in pairs if h.slow}  # type: ignore[union-attr]


def _segment_need(need: int, j: int, rest: int, slow: int) -> int:
    """The segment rule (``_fewest_by_segments``) for a step onto node j: -1 when it breaks the
    rule, else the node the current segment must still reach (0: none)."""
    if slow:
        if need:
            return -1  # the segment ends without its smallest node: a reordering covers it
        first = (rest & -rest).bit_length() - 1  # the smallest node not yet visited
        return 0 if first == j else first
    return 0 if need == j else need


def _segment_graph(size: int, hop: list[list[Pair | None]], half: Pair) -> list[list[Pair | None]]:
    """The graph plus a virtual node (index 0) joined to every node by ``half``; the other
    nodes move up one index and their latencies double (so ``half`` can be half of one)."""
    n = size + 1
    graph: list[list[Pair | None]] = [[None] * n for _ in range(n)]
    for i in range(size):
        graph[0][i + 1] = graph[i + 1][0] = half
        for j in range(size):
            h = hop[i][j]
            if h is not None:
                graph[i + 1][j + 1] = Pair(h.slow, h.gbps, 2 * h.lat)
    return graph


def _fewest_by_segments(size: int, hop: list[list[Pair | None]],
                        budget: _Budget) -> Generator[None, None, tuple[int, list[int]] | None]:
    """Pass 0 for a complete graph: the fewest slow hops and a ring with them, found by
    segments. A ring with k >= 1 slow hops is k Thunderbolt paths (segments) joined in a
    circle by slow hops, and since every pair has a hop, any order and direction of the
    same segments is a ring with (at most) as many slow hops. So the search runs from a
    virtual node (joined to every Mac by half a slow hop: the two halves at its ends make
    one) and takes the segments in the order of their smallest Mac: a segment must reach
    the smallest Mac not yet visited when it starts (``_segment_need``, part of the memo's
    key). That removes the (k-1)! orders of the same segments, which the memo over subsets
    cannot merge. None when the general pass must run: a Thunderbolt ring exists (no slow
    hop to order), or the cap stopped the search."""
    half = Pair(1, max(h.gbps for row in hop for h in row if h is not None and h.slow), 0)
    graph = _segment_graph(size, hop, half)
    fewest = _FewestSlow(size + 1, graph, _neighbours(size + 1, graph), _Bounds(size + 1, graph), budget, segments=True)
    yield from fewest.run()
    if not fewest.complete or fewest.best is None:
        return None
    slow_fewest = fewest.best - 1  # the virtual node's two halves make one slow hop
    if slow_fewest == 1:
        # One segment: is there a Thunderbolt ring after all? Search rings of no slow hop.
        cabled = _FewestSlow(size, hop, _neighbours(size, hop), _Bounds(size, hop), budget, best=1)
        yield from cabled.run()
        if not cabled.complete or cabled.best == 0:
            return None
    return slow_fewest, _from_segments(fewest.best_path)


def _value_by_segments(size: int, hop: list[list[Pair | None]], background: Pair, slow_fewest: int,
                       fewest_ring: list[int], budget: _Budget) -> Generator[None, None, Found]:
    """Pass 1 by segments (see ``_fewest_by_segments``) when every slow hop is the same one:
    then, at the fewest slow hops, every order and direction of the segments costs the same
    in every component, so the value search takes them in one order too; the tie-break then
    runs on the graph itself."""
    n = size + 1
    graph = _segment_graph(size, hop, background)
    bounds = _Bounds(n, graph)
    bounds.slow_min = slow_fewest + 1
    _choose_prices(n, graph, bounds)
    value = _Value(n, graph, _neighbours(n, graph), bounds, budget, segments=True)
    # The first incumbent: pass 0's ring, cut open at a slow hop and hung on the virtual node.
    cut = next(i for i in range(size) if hop[fewest_ring[i - 1]][fewest_ring[i]].slow)  # type: ignore[union-attr]
    value.best_path = [0] + [x + 1 for x in fewest_ring[cut:] + fewest_ring[:cut]]
    value.best = _cost(graph, value.best_path)
    yield from value.run()
    ring = _from_segments(value.best_path)
    cost = _cost(hop, ring)
    if not value.exact:
        return Found(ring, cost, False, budget.used)
    plain = _Bounds(size, hop)
    plain.slow_min = slow_fewest
    _choose_prices(size, hop, plain)
    path = yield from _tie_break(size, hop, plain, cost, budget)
    if path is None:
        return Found(ring, cost, False, budget.used)
    return Found(path, cost, True, budget.used)


def _from_segments(path: list[int]) -> list[int]:
    """A path from the virtual node as a ring of the original nodes from node 0."""
    ring = [i - 1 for i in path[1:]]
    start = ring.index(0)
    return ring[start:] + ring[:start]


class _Budget:
    """Search steps used (a step: a state the memo did not settle, whose bounds are
    evaluated and which may be expanded), the cap on them, and when the next slice ends."""

    def __init__(self, cap: int | None, slice_steps: int | None) -> None:
        self.cap, self.slice = cap, slice_steps
        self.used = 0

    def spent(self) -> bool:
        return self.cap is not None and self.used >= self.cap

    def take(self) -> bool:
        """Count one step; True when the slice is over (the caller yields)."""
        self.used += 1
        return self.slice is not None and self.used % self.slice == 0


def _choose_prices(size: int, hop: list[list[Pair | None]], bounds: _Bounds) -> None:
    """Use node prices for the latency bound when they raise it for the whole ring (they can
    lower it, e.g. on a star, where every ring costs the same and the plain bound is exact)."""
    whole = ((1 << size) - 1) & ~1
    plain = bounds.latency(0, whole, bounds.slow_min)
    pi = _penalties(size, hop, bounds.nb)
    if any(pi):
        bounds.reprice(pi)
        if bounds.latency(0, whole, bounds.slow_min) <= plain:
            bounds.reprice([0] * size)


def _penalties(size: int, hop: list[list[Pair | None]], nb: list[list[int]]) -> list[int]:
    """Node prices pi (1e-9 ms) for the latency bound (Held and Karp's Lagrangian idea, on
    the two-cheapest-ends relaxation): a hop's price is its latency plus pi at both ends,
    which changes every ring's price by the same 2 * sum(pi), so any pi gives a valid bound;
    a node that other nodes' cheapest ends crowd into gets a higher price, one that none
    reach a lower one. A few subgradient steps at the whole ring; the best pi is kept."""
    pi = [0] * size
    best_pi, best = pi, None
    step = max(1, sum(min((hop[i][j].lat for j in nb[i]), default=0) for i in range(size)) // (4 * size))  # type: ignore[union-attr]
    for _ in range(PENALTY_ROUNDS):
        reached = [0] * size
        total = 0
        for x in range(size):
            two = sorted((hop[x][u].lat + pi[u], u) for u in nb[x])[:2]  # type: ignore[union-attr]
            total += sum(c for c, _ in two) + 2 * pi[x]
            for _, u in two:
                reached[u] += 1
        value = total - 4 * sum(pi)  # twice the relaxation's bound on a ring
        if best is None or value > best:
            best, best_pi = value, pi[:]
        if all(r == 2 for r in reached):
            break  # every node reached exactly twice: nothing to move
        pi = [p + step * (r - 2) for p, r in zip(pi, reached)]
        step = max(1, step * 4 // 5)
    return best_pi


def _cost(hop: list[list[Pair | None]], path: list[int]) -> Cost:
    steps = [hop[a][b] for a, b in zip(path, path[1:] + path[:1])]
    return (sum(h.slow for h in steps), min(h.gbps for h in steps), sum(h.lat for h in steps))  # type: ignore[union-attr]


def _dominated(entries: list[Cost], s: int, bn: float, lat: int) -> bool:
    for es, ebn, elat in entries:
        if es <= s and ebn >= bn and elat <= lat:
            return True
    return False


def _remember(memo: dict[int, list[Cost]], key: int, s: int, bn: float, lat: int) -> None:
    entries = memo.get(key)
    if entries is None:
        memo[key] = [(s, bn, lat)]
        return
    entries[:] = [e for e in entries if not (s <= e[0] and bn >= e[1] and lat <= e[2])]
    entries.append((s, bn, lat))


class _FewestSlow:
    """Pass 0: the fewest slow hops of any ring (the objective's first level alone). Knowing
    it lets the later passes bound every prefix's slow hops, and so its bottleneck and
    latency, by the true optimum instead of by what the rest of the graph suggests."""

    def __init__(self, size: int, hop: list[list[Pair | None]], neighbours: list[list[int]], bounds: _Bounds,
                 budget: _Budget, *, segments: bool = False, best: int | None = None) -> None:
        self.size, self.hop, self.neighbours, self.bounds, self.budget = size, hop, neighbours, bounds, budget
        self.segments = segments
        self.complete = True
        self.best: int | None = best
        self.best_path: list[int] = []
        self.memo: dict[int, int] = {}
        self.path = [0]

    def run(self) -> Generator[None, None, None]:
        yield from self._dfs(0, 1, 0, 0)

    def _dfs(self, v: int, mask: int, s: int, need: int) -> Generator[None, None, None]:
        size = self.size
        rest = ((1 << size) - 1) & ~mask
        if not rest:
            back = self.hop[v][0]
            if back is not None and (self.best is None or s + back.slow < self.best):
                self.best, self.best_path = s + back.slow, list(self.path)
            return
        key = (mask * size + v) * size + need
        seen = self.memo.get(key)
        if seen is not None and seen <= s:
            return
        self.memo[key] = s
        if self.budget.spent():
            self.complete = False
            return
        if self.budget.take():
            yield
        if self.best is not None and s + self.bounds.slow(v, rest) >= self.best:
            return
        hop_v = self.hop[v]
        for j in self.neighbours[v]:
            if rest >> j & 1:
                ph = hop_v[j]
                child_need = _segment_need(need, j, rest, ph.slow) if self.segments else 0  # type: ignore[union-attr]
                if child_need < 0:
                    continue
                self.path.append(j)
                yield from self._dfs(j, mask | (1 << j), s + ph.slow, child_need)  # type: ignore[union-attr]
                self.path.pop()
                if self.best == 0:
                    return  # no ring has fewer


class _Value:
    """Pass 1: the best value (see the module comment)."""

    def __init__(self, size: int, hop: list[list[Pair | None]], neighbours: list[list[int]], bounds: _Bounds,
                 budget: _Budget, *, segments: bool = False) -> None:
        self.size, self.hop, self.neighbours, self.bounds, self.budget = size, hop, neighbours, bounds, budget
        self.segments = segments
        self.exact = True
        self.best: Cost | None = None
        self.best_path: list[int] = []
        self.memo: dict[int, list[Cost]] = {}
        self.path = [0]

    def run(self) -> Generator[None, None, None]:
        yield from self._expand(0, 1, 0, float("inf"), 0, 0)

    def _expand(self, v: int, mask: int, s: int, bn: float, lat: int, need: int) -> Generator[None, None, None]:
        """Visit every child of the state (mask, v); descend into those worth it. The checks
        run here, not in the child, so a pruned child costs no generator."""
        size = self.size
        rest = ((1 << size) - 1) & ~mask
        hop = self.hop
        hop_v = hop[v]
        memo = self.memo
        for j in self.neighbours[v]:
            if not rest >> j & 1:
                continue
            ph = hop_v[j]
            cs = s + ph.slow  # type: ignore[union-attr]
            if self.best is not None and cs > self.best[0]:
                continue  # already more slow hops than the best ring (the bound's cheap part)
            child_need = _segment_need(need, j, rest, ph.slow) if self.segments else 0  # type: ignore[union-attr]
            if child_need < 0:
                continue
            cbn, clat = min(bn, ph.gbps), lat + ph.lat  # type: ignore[union-attr]
            crest = rest & ~(1 << j)
            if not crest:
                back = hop[j][0]
                if back is not None:
                    cost = (cs + back.slow, min(cbn, back.gbps), clat + back.lat)
                    if self.best is None or better(cost, self.best):
                        self.best, self.best_path = cost, [*self.path, j]
                continue
            key = ((mask | (1 << j)) * size + j) * size + child_need
            entries = memo.get(key)
            if entries is not None and _dominated(entries, cs, cbn, clat):
                continue
            _remember(memo, key, cs, cbn, clat)
            if self.budget.spent():
                self.exact = False
                return
            if self.budget.take():
                yield
            if self.best is not None and not self.bounds.may_finish(j, crest, cs, cbn, clat, self.best, ties=False):
                continue
            self.path.append(j)
            yield from self._expand(j, mask | (1 << j), cs, cbn, clat, child_need)
            self.path.pop()


class _TieBreak:
    """Pass 2: the smallest node list among the rings of the best value."""

    def __init__(self, size: int, hop: list[list[Pair | None]], bounds: _Bounds, target: Cost, budget: _Budget) -> None:
        self.size, self.hop, self.bounds, self.target, self.budget = size, hop, bounds, target, budget
        self.out_of_steps = False
        self.failed: dict[int, list[Cost]] = {}
        self.path = [0]
        self.neighbours = [[j for j in range(size) if hop[i][j] is not None] for i in range(size)]

    def run(self) -> Generator[None, None, list[int] | None]:
        if (yield from self._dfs(0, 1, 0, float("inf"), 0)):
            return list(self.path)
        return None  # only when out of steps: the value pass found a ring with this value

    def _dfs(self, v: int, mask: int, s: int, bn: float, lat: int) -> Generator[None, None, bool]:
        size = self.size
        rest = ((1 << size) - 1) & ~mask
        target = self.target
        if not rest:
            back = self.hop[v][0]
            return back is not None and (s + back.slow, min(bn, back.gbps), lat + back.lat) == target
        key = mask * size + v
        entries = self.failed.get(key)
        if entries is not None and _dominated(entries, s, bn, lat):
            return False
        if self.budget.spent():
            self.out_of_steps = True
            return False
        if self.budget.take():
            yield
        if not self.bounds.may_finish(v, rest, s, bn, lat, self.target, ties=True):
            return False
        hop_v = self.hop[v]
        for j in self.neighbours[v]:
            if not rest >> j & 1:
                continue
            ph = hop_v[j]
            self.path.append(j)
            if (yield from self._dfs(j, mask | (1 << j), s + ph.slow, min(bn, ph.gbps), lat + ph.lat)):  # type: ignore[union-attr]
                return True
            self.path.pop()
            if self.out_of_steps:
                return False
        _remember(self.failed, key, s, bn, lat)
        return False
