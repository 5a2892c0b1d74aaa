"""The ring solver: which cycle through the Macs the data plane uses, given the cables.

Input: nodes and links (endpoints, kind thunderbolt/ethernet/wifi, Gb/s, optional RTT).
Parallel links between one pair count together: a pair's hop offers the sum of the Gb/s of
its links of the best kind present (two Thunderbolt cables between two Macs give twice the
bandwidth), and the lowest RTT among them.

Objective, in order (lexicographic):
1. fewest hops that are not Thunderbolt (a full Thunderbolt ring has none);
2. the highest bottleneck (the smallest hop Gb/s on the ring);
3. the lowest total latency (sum of hop RTTs; a link without RTT counts a kind default).
Deterministic: ties break on the ring's node order, compared as a list of node ids, after
rotating it to start at the smallest id and choosing the lexicographically smaller
direction, so every node computes the same ring from the same graph.

Exact by branch and bound over cycles that start at the smallest node id, with pruning on
the objective so far. Real Thunderbolt graphs are sparse (a Mac has at most a few ports),
which keeps the search small. A search that exceeds ``expansions_max`` stops and returns
the best ring found, flagged ``exact=False`` (the bound is the objective of that ring: no
worse than any ring seen; docs/ring.md).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("thunderbolt", "ethernet", "wifi", "network")
"""Best first. "network" is an IP path with no known cable (core/physical.py's last resort)."""
DEFAULT_RTT_MS = {"thunderbolt": 0.2, "ethernet": 0.5, "wifi": 3.0, "network": 5.0}
EXPANSIONS_MAX = 200_000
NODES_MAX = 64


class RingError(ValueError):
    """The described cabling cannot form a ring, or the description is malformed."""


@dataclass(frozen=True, slots=True)
class Link:
    a: str
    b: str
    kind: str
    gbps: float
    rtt_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Hop:
    src: str
    dst: str
    kind: str
    gbps: float
    rtt_ms: float


@dataclass(frozen=True, slots=True)
class Ring:
    order: tuple[str, ...]
    hops: tuple[Hop, ...]
    exact: bool

    @property
    def slow_hops(self) -> tuple[Hop, ...]:
        return tuple(h for h in self.hops if h.kind != "thunderbolt")

    @property
    def bottleneck_gbps(self) -> float:
        return min((h.gbps for h in self.hops), default=0.0)

    @property
    def latency_ms(self) -> float:
        return sum(h.rtt_ms for h in self.hops)

    def to_json(self) -> dict[str, object]:
        def hop(h: Hop) -> dict[str, object]:
            return {"from": h.src, "to": h.dst, "kind": h.kind, "gbps": h.gbps, "rtt_ms": h.rtt_ms}

        return {
            "ring": list(self.order),
            "hops": [hop(h) for h in self.hops],
            "slow_hops": [hop(h) for h in self.slow_hops],
            "bottleneck_gbps": self.bottleneck_gbps,
            "latency_ms": round(self.latency_ms, 6),
            "exact": self.exact,
        }


@dataclass(frozen=True, slots=True)
class _PairHop:
    kind: str
    gbps: float
    rtt_ms: float

    @property
    def slow(self) -> int:
        return 0 if self.kind == "thunderbolt" else 1


def parse_graph(data: object) -> tuple[list[str], list[Link]]:
    """Validate the JSON description (see docs/ring.md); RingError says what is wrong."""
    if not isinstance(data, dict):
        raise RingError('the graph must be an object with "nodes" and "links"')
    nodes = data.get("nodes")
    links = data.get("links", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
        raise RingError('"nodes" must be a list of non-empty strings')
    if len(set(nodes)) != len(nodes):
        raise RingError('"nodes" lists a node twice')
    if len(nodes) > NODES_MAX:
        raise RingError(f"at most {NODES_MAX} nodes")
    if not isinstance(links, list):
        raise RingError('"links" must be a list')
    known = set(nodes)
    out: list[Link] = []
    for i, raw in enumerate(links):
        if not isinstance(raw, dict):
            raise RingError(f"link {i} must be an object")
        a, b, kind, gbps, rtt = raw.get("a"), raw.get("b"), raw.get("kind"), raw.get("gbps"), raw.get("rtt_ms")
        if not isinstance(a, str) or not isinstance(b, str) or a not in known or b not in known:
            raise RingError(f"link {i} joins {a!r} and {b!r}, which are not both in \"nodes\"")
        if a == b:
            raise RingError(f"link {i} joins {a!r} to itself")
        if kind not in KINDS:
            raise RingError(f"link {i} has kind {kind!r}; use one of {', '.join(KINDS)}")
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < float("inf"):
            raise RingError(f"link {i} needs a positive, finite \"gbps\"")
        if rtt is not None and (isinstance(rtt, bool) or not isinstance(rtt, (int, float)) or not 0 <= rtt < float("inf")):
            raise RingError(f"link {i} has a bad \"rtt_ms\"")
        out.append(Link(a, b, kind, float(gbps), None if rtt is None else float(rtt)))
    return list(nodes), out


def _pairs(links: list[Link]) -> dict[frozenset[str], _PairHop]:
    by_pair: dict[frozenset[str], list[Link]] = {}
    for link in links:
        by_pair.setdefault(frozenset((link.a, link.b)), []).append(link)
    out: dict[frozenset[str], _PairHop] = {}
    for pair, group in by_pair.items():
        best_kind = min((l.kind for l in group), key=KINDS.index)
        same = [l for l in group if l.kind == best_kind]
        rtt = min(l.rtt_ms if l.rtt_ms is not None else DEFAULT_RTT_MS[l.kind] for l in same)
        out[pair] = _PairHop(best_kind, sum(l.gbps for l in same), rtt)
    return out


def solve(nodes: list[str], links: list[Link], *, expansions_max: int = EXPANSIONS_MAX) -> Ring:
    """The best ring through every node (see the module comment)."""
    if not nodes:
        raise RingError("no nodes")
    order = sorted(nodes)
    if len(order) == 1:
        return Ring((order[0],), (), exact=True)
    pairs = _pairs(links)
    for n in order:
        if not any(n in p for p in pairs):
            raise RingError(f"node {n!r} has no link: no ring can be closed")
    index = {n: i for i, n in enumerate(order)}
    size = len(order)
    hop: list[list[_PairHop | None]] = [[None] * size for _ in range(size)]
    for pair, ph in pairs.items():
        a, b = sorted(pair)
        hop[index[a]][index[b]] = hop[index[b]][index[a]] = ph
    if size == 2:
        ph = hop[0][1]
        assert ph is not None
        return _ring(order, [0, 1], hop, exact=True)
    for i in range(size):
        if sum(1 for j in range(size) if hop[i][j] is not None) < 2:
            raise RingError(f"node {order[i]!r} has a link to only one other node: no ring can pass through it")
    # Neighbours sorted best-first so good rings are found early (tight bounds).
    neighbours = [
        sorted(
            (j for j in range(size) if hop[i][j] is not None),
            key=lambda j, i=i: (hop[i][j].slow, -hop[i][j].gbps, hop[i][j].rtt_ms, j),  # type: ignore[union-attr]
        )
        for i in range(size)
    ]
    best: list[object] = [None, None]  # [key, path]
    expansions = [0]
    exact = [True]
    path = [0]
    visited = [False] * size
    visited[0] = True
    # A lower bound on the latency still to come: every unvisited node, and node 0 (the
    # closing hop), must be entered by one of its hops, at least its cheapest.
    # The same for slow hops (a node all of whose hops are slow adds one) and, as an upper
    # bound on the bottleneck, the fastest hop into each node still to enter.
    min_in = [min(hop[i][j].rtt_ms for j in neighbours[i]) for i in range(size)]  # type: ignore[union-attr]
    slow_in = [min(hop[i][j].slow for j in neighbours[i]) for i in range(size)]  # type: ignore[union-attr]
    fast_in = [max(hop[i][j].gbps for j in neighbours[i]) for i in range(size)]  # type: ignore[union-attr]
    to_come = [sum(min_in)]
    slow_to_come = [sum(slow_in)]
    # Thunderbolt adjacency as bitmasks: the rest of the ring is a path from the current
    # node through every unvisited one back to node 0, and it must take a slow hop each
    # time it moves between two groups of nodes that no Thunderbolt cables connect.
    fast_adj = [sum(1 << j for j in neighbours[i] if hop[i][j].slow == 0) for i in range(size)]  # type: ignore[union-attr]
    unvisited = [((1 << size) - 1) & ~1]
    all_hops = [hop[i][j] for i in range(size) for j in neighbours[i]]
    fast_rtt = min((h.rtt_ms for h in all_hops if h.slow == 0), default=0.0)  # type: ignore[union-attr]
    slow_rtt = min((h.rtt_ms for h in all_hops if h.slow == 1), default=0.0)  # type: ignore[union-attr]
    by_rtt = [sorted(neighbours[i], key=lambda j, i=i: hop[i][j].rtt_ms) for i in range(size)]  # type: ignore[union-attr]

    def half_degree(cur: int, mask: int) -> float:
        """A lower bound on the latency of the rest of the ring (cur -> every node of mask
        -> node 0): each node of mask is entered and left by one hop each, cur is left and 0
        entered by one; every hop is shared by two ends, so half the cheapest usable hops at
        every end bound the sum. Infinite when some node cannot be passed through at all."""
        if not mask:
            back = hop[cur][0]
            return back.rtt_ms if back is not None else float("inf")
        allowed = mask | (1 << cur) | 1
        total = 0.0
        rest = mask
        while rest:
            bit = rest & -rest
            rest &= rest - 1
            v = bit.bit_length() - 1
            found = 0
            for u in by_rtt[v]:
                if allowed >> u & 1:
                    total += hop[v][u].rtt_ms  # type: ignore[union-attr]
                    found += 1
                    if found == 2:
                        break
            if found < 2:
                return float("inf")
        for end in (cur, 0):
            u = next((u for u in by_rtt[end] if mask >> u & 1), None)
            if u is None:
                return float("inf")
            total += hop[end][u].rtt_ms  # type: ignore[union-attr]
        return total / 2

    def groups(mask: int) -> int:
        count = 0
        while mask:
            frontier = mask & -mask
            seen = 0
            while frontier:
                seen |= frontier
                bit = frontier & -frontier
                frontier &= frontier - 1
                frontier |= fast_adj[bit.bit_length() - 1] & mask & ~seen
            mask &= ~seen
            count += 1
        return count

    def key_of(slow: int, bottleneck: float, latency: float, p: list[int]) -> tuple[int, float, float, tuple[int, ...]]:
        # The tie-break is the path itself: both directions of every ring are explored
        # from node 0, so the smallest path is the ring's canonical form (_canonical), and
        # a prefix already larger than the best path's can be pruned.
        return (slow, -bottleneck, round(latency, 9), tuple(p))

    def dfs(slow: int, bottleneck: float, latency: float) -> None:
        if expansions[0] >= expansions_max:
            exact[0] = False
            return
        expansions[0] += 1
        current = path[-1]
        if len(path) == size:
            back = hop[current][0]
            if back is None:
                return
            k = key_of(slow + back.slow, min(bottleneck, back.gbps), latency + back.rtt_ms, path)
            if best[0] is None or k < best[0]:  # type: ignore[operator]
                best[0], best[1] = k, list(path)
            return
        for j in neighbours[current]:
            if visited[j]:
                continue
            ph = hop[current][j]
            assert ph is not None
            s, bn, lat = slow + ph.slow, min(bottleneck, ph.gbps), latency + ph.rtt_ms
            if best[0] is not None:
                bs, bneg, blat, bpath = best[0]  # type: ignore[misc]
                # Prune on bounds of the finished ring, in the objective's order: each
                # component can only be at least (slow, latency) or at most (bottleneck)
                # what the prefix plus the cheapest way to finish gives.
                s_lb = s + slow_to_come[0] - slow_in[j]
                if s_lb <= bs:
                    rest = (unvisited[0] & ~(1 << j)) | (1 << j) | 1
                    s_lb = max(s_lb, s + groups(rest) - 1)
                if s_lb > bs:
                    continue
                if s_lb == bs:
                    bn_ub = bn
                    for v in range(size):
                        if (not visited[v] and v != j) or v == 0:
                            bn_ub = min(bn_ub, fast_in[v])
                    if -bn_ub > bneg:
                        continue
                    if -bn_ub == bneg:
                        left = size - len(path)  # hops still to take after this one
                        need_slow = min(left, s_lb - s)
                        by_kind = (left - need_slow) * min(fast_rtt, slow_rtt) + need_slow * slow_rtt
                        cheapest = max(to_come[0] - min_in[j], by_kind)
                        if lat + cheapest <= blat + 1e-9:
                            cheapest = max(cheapest, half_degree(j, unvisited[0] & ~(1 << j)))
                        bound = round(lat + cheapest, 9)
                        if bound > blat + 1e-9:
                            continue
                        if bound >= blat - 1e-9 and tuple(path) + (j,) > bpath[: len(path) + 1]:
                            continue  # at best a tie, and a tie this path would lose
            visited[j] = True
            path.append(j)
            to_come[0] -= min_in[j]
            slow_to_come[0] -= slow_in[j]
            unvisited[0] &= ~(1 << j)
            dfs(s, bn, lat)
            unvisited[0] |= 1 << j
            slow_to_come[0] += slow_in[j]
            to_come[0] += min_in[j]
            path.pop()
            visited[j] = False

    dfs(0, float("inf"), 0.0)
    if best[1] is None:
        if not exact[0]:
            raise RingError(f"no ring found within {expansions_max} search steps")
        raise RingError(_why_no_ring(order, hop))
    return _ring(order, best[1], hop, exact=exact[0])  # type: ignore[arg-type]


def _canonical(order: list[str], p: list[int]) -> tuple[str, ...]:
    """Ring node ids from the smallest, in the lexicographically smaller direction."""
    names = [order[i] for i in p]
    forward = tuple(names)
    backward = tuple([names[0]] + names[:0:-1])
    return min(forward, backward)


def _ring(order: list[str], p: list[int], hop: list[list[_PairHop | None]], *, exact: bool) -> Ring:
    names = list(_canonical(order, p))
    idx = {n: i for i, n in enumerate(order)}
    hops = []
    for k, src in enumerate(names):
        dst = names[(k + 1) % len(names)]
        ph = hop[idx[src]][idx[dst]]
        assert ph is not None
        hops.append(Hop(src, dst, ph.kind, ph.gbps, ph.rtt_ms))
    return Ring(tuple(names), tuple(hops), exact=exact)


def _why_no_ring(order: list[str], hop: list[list[_PairHop | None]]) -> str:
    size = len(order)
    seen = {0}
    stack = [0]
    while stack:
        i = stack.pop()
        for j in range(size):
            if hop[i][j] is not None and j not in seen:
                seen.add(j)
                stack.append(j)
    if len(seen) < size:
        cut_off = sorted(order[j] for j in range(size) if j not in seen)
        return f"the cabling is in pieces: {', '.join(cut_off)} cannot be reached from {order[0]!r}"
    return "no cycle passes through every node with these links (a line or a tree of cables cannot close a ring)"
