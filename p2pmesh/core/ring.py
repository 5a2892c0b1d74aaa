"""The ring solver: which cycle through the Macs the data plane uses, given the cables.

Input: nodes and links (endpoints, kind thunderbolt/ethernet/wifi, Gb/s, optional RTT).
Parallel links between one pair count together: a pair's hop offers the sum of the Gb/s of
its links of the best kind present (two Thunderbolt cables between two Macs give twice the
bandwidth), and the lowest RTT among them.

Objective, in order (lexicographic):
1. fewest hops that are not Thunderbolt (a full Thunderbolt ring has none);
2. the highest bottleneck (the smallest hop Gb/s on the ring);
3. the lowest total latency (sum of hop RTTs; a link without RTT counts a kind default;
   compared in whole 1e-9 ms, so the sum is exact and the same in both directions).
Deterministic: ties break on the ring's node order, compared as a list of node ids, after
rotating it to start at the smallest id and choosing the lexicographically smaller
direction, so every node computes the same ring from the same graph.

Exact search in core/ring_search.py: a depth-first search with bounds, whose memo over
(visited set, current node) makes it Held-Karp's dynamic program reached lazily, so up to
EXACT_NODES_MAX nodes it always finishes and is exact. Above that a search that exceeds
``expansions_max`` steps stops and returns the best ring found, flagged ``exact=False``
(its objective is that of the best ring seen; docs/ring.md). ``solve_steps`` runs the same
solve in slices, for a caller that must stay responsive (the leader).
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from p2pmesh.core.ring_search import Pair, search_steps

KINDS = ("thunderbolt", "ethernet", "wifi", "network")
"""Best first. "network" is an IP path with no known cable (core/physical.py's last resort)."""
DEFAULT_RTT_MS = {"thunderbolt": 0.2, "ethernet": 0.5, "wifi": 3.0, "network": 5.0}
EXPANSIONS_MAX = 200_000
"""Search steps allowed above EXACT_NODES_MAX nodes."""
EXACT_NODES_MAX = 16
"""Up to this many nodes the search runs uncapped: its memo bounds it (core/ring_search.py)."""
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
    rdma: bool = False  # RDMA over Thunderbolt 5 works on this cable (placement: tensor groups' all-reduces)


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
        rdma = raw.get("rdma", False)
        if not isinstance(rdma, bool):
            raise RingError(f"link {i} has a bad \"rdma\" (true or false)")
        out.append(Link(a, b, kind, float(gbps), None if rtt is None else float(rtt), rdma))
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


def solve(nodes: list[str], links: list[Link], *, expansions_max: int | None = None) -> Ring:
    """The best ring through every node (see the module comment). ``expansions_max`` caps the
    search steps (default: no cap up to EXACT_NODES_MAX nodes, where the search is bounded
    anyway; EXPANSIONS_MAX above)."""
    steps = solve_steps(nodes, links, expansions_max=expansions_max, slice_steps=None)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def solve_steps(nodes: list[str], links: list[Link], *, expansions_max: int | None = None,
                slice_steps: int | None = None) -> Generator[None, None, Ring]:
    """``solve`` in slices of ``slice_steps`` search steps: the generator yields between
    slices and returns the ring (or raises RingError), so the leader can solve between its
    heartbeats (core/physical.py)."""
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
        return _ring(order, [0, 1], hop, exact=True)
    if len(set(pairs.values())) == 1 and len(pairs) == size * (size - 1) // 2:
        # Every pair joined by the same hop (Macs on one LAN, no Thunderbolt): every ring
        # costs the same, so the canonical one is the node order itself, which is what the
        # search's tie-break returns, at a fraction of its cost (the leader re-solves on
        # every change of the members that are up).
        return _ring(order, list(range(size)), hop, exact=True)
    for i in range(size):
        if sum(1 for j in range(size) if hop[i][j] is not None) < 2:
            raise RingError(f"node {order[i]!r} has a link to only one other node: no ring can pass through it")
    pairs_by_index = [[None if ph is None else Pair(ph.slow, ph.gbps, _lat_units(ph.rtt_ms)) for ph in row] for row in hop]
    cap = expansions_max if expansions_max is not None else (None if size <= EXACT_NODES_MAX else EXPANSIONS_MAX)
    found = yield from search_steps(size, pairs_by_index, expansions_max=cap, slice_steps=slice_steps)
    if found is None:
        raise RingError(_why_no_ring(order, hop))
    if not found.path:
        raise RingError(f"no ring found within {cap} search steps")
    return _ring(order, found.path, hop, exact=found.exact)


def _lat_units(rtt_ms: float) -> int:
    """RTT in whole 1e-9 ms: latency sums are then exact, the same in both directions."""
    units = rtt_ms * 1e9
    return round(units) if units != float("inf") else int(rtt_ms) * 10**9


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
