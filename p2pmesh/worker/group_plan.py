"""Which ranks of a serve worker's plan run together (issue 16): `--stages`, `--group-sizes`
and `--shares` parsed and checked, and this rank's role in the plan. No MLX, no sockets.

Ranks are numbered group-major: `--group-sizes [2, 2]` makes ranks 0, 1 group 0 and ranks
2, 3 group 1. Every rank of a group holds the same layer range, split tensor-parallel
(worker/tensor.py); the groups, in order, are a pipeline covering layer 0 to the model's
last layer. All groups of one rank (the default) are a plain pipeline: serve.py then runs
exactly as before, over MLX's ring between stages. Any group of two or more makes a
*tensor plan*: one MLX group per tensor group, and the pipeline hop between groups goes over
the side channel (worker/side_link.py). A group's first rank is its *head*; the others are
its *members*.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from p2pmesh.core.placement_cost import Share


def parse_stage_list(text: str) -> list[tuple[int, int]]:
    """--stages: a JSON list of [start, end] pairs (checked against the groups by `parse_plan`)."""
    try:
        raw = json.loads(text)
        return [(int(s), int(e)) for s, e in raw]
    except (ValueError, TypeError):
        raise ValueError(f"--stages {text!r} is not a JSON list of [start, end] pairs") from None


def check_layers(ranges: Sequence[tuple[int, int]], what: str = "stage") -> None:
    """Contiguous, non-empty, starting at layer 0."""
    if not ranges or ranges[0][0] != 0:
        raise ValueError(f"--stages {list(ranges)} must start at layer 0")
    for i, (s, e) in enumerate(ranges):
        if s >= e or (i and s != ranges[i - 1][1]):
            raise ValueError(f"--stages {list(ranges)}: {what} {i} [{s}, {e}) is empty or not contiguous with the previous one")


def parse_shares(text: str) -> tuple[Share, ...]:
    """A JSON list of [heads, kv_heads, columns] or {"heads", "kv_heads", "columns"}."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, list):
            raise TypeError("not a list")
        return tuple(Share(int(s["heads"]), int(s["kv_heads"]), int(s["columns"])) if isinstance(s, dict)
                     else Share(*(int(v) for v in s)) for s in raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--shares {text!r} is not a JSON list of [heads, kv_heads, columns]: {e}") from None


@dataclass(frozen=True, slots=True)
class Role:
    """One rank's place in a plan."""

    rank: int
    """The global rank (--rank)."""
    group: int
    index: int
    """Its index in its group (MLX_RANK of a group of two or more)."""
    size: int
    """Ranks in its group."""
    groups: int
    layers: tuple[int, int]

    @property
    def head(self) -> bool:
        return self.index == 0


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[tuple[int, int], ...]
    """One [start, end) per global rank."""
    sizes: tuple[int, ...]
    """Ranks per group, in order."""
    shares: tuple[Share, ...] | None = None
    """One per global rank (--shares), or None: an even split of each group."""

    @property
    def tensor(self) -> bool:
        """Any group of two or more: MLX groups per tensor group, the side channel between."""
        return any(s >= 2 for s in self.sizes)

    def first(self, group: int) -> int:
        """The global rank of the group's head."""
        return sum(self.sizes[:group])

    def role(self, rank: int) -> Role:
        for g, size in enumerate(self.sizes):
            first = self.first(g)
            if first <= rank < first + size:
                return Role(rank, g, rank - first, size, len(self.sizes), self.stages[rank])
        raise ValueError(f"--rank {rank} is not one of the {len(self.stages)} ranks")

    def members(self, group: int) -> tuple[int, ...]:
        """The global ranks of the group other than its head."""
        first = self.first(group)
        return tuple(range(first + 1, first + self.sizes[group]))

    def group_shares(self, group: int) -> tuple[Share, ...] | None:
        if self.shares is None:
            return None
        first = self.first(group)
        return self.shares[first : first + self.sizes[group]]


def parse_plan(stages: Sequence[tuple[int, int]], group_sizes: str | None, shares: str | None) -> Plan:
    """The plan from the parsed --stages and the raw --group-sizes / --shares; ValueError
    with a message that names the option at fault."""
    if group_sizes is None:
        sizes: tuple[int, ...] = (1,) * len(stages)
    else:
        try:
            raw = json.loads(group_sizes)
            if not isinstance(raw, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
                raise TypeError
            sizes = tuple(raw)
        except (ValueError, TypeError):
            raise ValueError(f"--group-sizes {group_sizes!r} is not a JSON list of integers") from None
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--group-sizes {list(sizes)}: every group needs at least one rank")
        if sum(sizes) != len(stages):
            raise ValueError(f"--group-sizes {list(sizes)} add up to {sum(sizes)} ranks; --stages has {len(stages)}")
    ranges = []
    for g, size in enumerate(sizes):
        first = sum(sizes[:g])
        mine = set(stages[first : first + size])
        if len(mine) != 1:
            raise ValueError(f"--stages {list(stages)}: the ranks {first}..{first + size - 1} of group {g} "
                             f"must all hold the same layers, not {sorted(mine)}")
        ranges.append(stages[first])
    check_layers(ranges, "stage" if group_sizes is None else "group")
    parsed = None
    if shares is not None:
        parsed = parse_shares(shares)
        if len(parsed) != len(stages):
            raise ValueError(f"--shares has {len(parsed)} entries; one per rank ({len(stages)}) is needed")
    return Plan(tuple(stages), sizes, parsed)


@dataclass(frozen=True, slots=True)
class SideAddrs:
    """Where this rank listens (a head) and whom it dials."""

    listen: tuple[tuple[str, int], ...] = ()
    next: tuple[str, int] | None = None
    head: tuple[str, int] | None = None


def parse_address(text: str, option: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise ValueError(f"{option} {text!r} is not HOST:PORT")
    return host, int(port)


def side_addrs(plan: Plan, role: Role, listen: str | None, nxt: str | None, head: str | None) -> SideAddrs:
    """The side options this rank needs in a tensor plan, parsed; ValueError naming the
    missing or malformed option."""
    if not role.head:
        if head is None:
            raise ValueError(f"rank {role.rank} is a member of tensor group {role.group}: it needs --side-head HOST:PORT")
        return SideAddrs(head=parse_address(head, "--side-head"))
    try:
        raw = json.loads(listen) if listen is not None else None
        if not isinstance(raw, list) or not raw or not all(isinstance(a, str) for a in raw):
            raise TypeError
    except (ValueError, TypeError):
        raise ValueError(f"rank {role.rank} heads group {role.group}: --side-listen must be a JSON list of "
                         f"\"ip:port\" strings, got {listen!r}") from None
    addrs = tuple(parse_address(a, "--side-listen") for a in raw)
    if len({port for _, port in addrs}) != 1:
        raise ValueError(f"--side-listen {raw}: every address must have the same port")
    if role.groups >= 2 and nxt is None:
        raise ValueError(f"rank {role.rank} heads group {role.group} of {role.groups}: it needs --side-next HOST:PORT")
    return SideAddrs(listen=addrs, next=parse_address(nxt, "--side-next") if role.groups >= 2 and nxt else None)
