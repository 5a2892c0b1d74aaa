"""What one rank of an epoch with tensor groups is told (issue 16), from the committed state.

A placement with tensor groups (core/dataplane.groups: consecutive ranks with the same
layers) runs one MLX group per tensor group, since MLX's ring backend cannot split a group;
between groups, and from a group's head to its members, the activation or token travels over
the workers' own TCP side channel (worker/side_link.py). This module renders, for one
global rank, the worker's options of that contract (docs/inference.md, "Tensor groups"):

- ``--group-sizes``: the size of every group, group-major; ``--shares``: each rank's
  [heads, kv_heads, columns];
- ``--side-listen``: a group's head listens on every address it is reached at (from the
  previous group's head and from its own members), on its side port;
- ``--side-next``: a head's next group's head (the last's: the first's), when there are two
  groups or more; ``--side-head``: a member's own head;
- the rank's MLX group: its group's node order, its index in it, the group ring's hops and
  each group rank's port (core/mlx_hostfile.py renders the hostfile or JACCL's files).

Ports: a rank's MLX port is its member's epoch port as for a pipeline (epoch_ports, by global
rank); a head's side port is its member's data port + SIDE_PORT_OFFSET + the epoch's slot, above
every epoch's MLX ports (data port + 64 x 16), so neither collides with an active or a
pending epoch's. A pure pipeline gets None: it runs exactly as before (one ring of all).

Pure and deterministic; the agent (agent/tasks/workers.py) writes the files and starts the
process.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from p2pmesh.core.dataplane import groups
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Member, RingHop, Stage
from p2pmesh.core.mlx_hostfile import (EPOCH_PORT_SLOTS, EPOCH_PORT_STRIDE, PORT_MAX, MlxConfigError, epoch_ports,
                                       ipv4_of)

SIDE_PORT_OFFSET = EPOCH_PORT_SLOTS * EPOCH_PORT_STRIDE
"""A head's side channel listens above every epoch's MLX ports on its member's data port."""


@dataclass(frozen=True, slots=True)
class RankLaunch:
    """One rank's place in an epoch with tensor groups."""

    order: tuple[NodeId, ...]
    """Its group's members in rank order (one: no MLX group at all)."""
    index: int
    """Its rank in its group (MLX_RANK)."""
    hops: tuple[RingHop, ...]
    """Its group's ring: hop j from order[j] to order[(j + 1) % size] (empty for one)."""
    ports: tuple[int, ...]
    """Each group rank's MLX port."""
    args: tuple[str, ...]
    """The worker options of the side channel and the groups."""


def side_port(node: NodeId, members: Sequence[Member], epoch: int, fallback: int) -> int:
    """The port a head's side channel listens on in ``epoch`` (module comment)."""
    member = next((m for m in members if m.node_id == node), None)
    base = member.caps.data_port if member is not None and member.caps.data_port > 0 else fallback
    port = base + SIDE_PORT_OFFSET + epoch % EPOCH_PORT_SLOTS
    if not 1 <= port <= PORT_MAX:
        raise MlxConfigError(f"node {node}: side port {port} is outside 1..{PORT_MAX}", node=node)
    return port


def rank_launch(stages: Sequence[Stage], rank: int, hops: Sequence[RingHop], members: Sequence[Member], epoch: int,
                fallback: int) -> RankLaunch | None:
    """Global rank ``rank``'s launch (module comment); None for a pure pipeline.
    MlxConfigError when the committed hops lack a pair or an address it needs."""
    stages = tuple(stages)
    gs = groups(stages)
    if all(len(g) == 1 for g in gs):
        return None
    by_pair = {(h.src, h.dst): h for h in hops}
    node = [s.node_id for s in stages]

    def hop(src: int, dst: int) -> RingHop:
        h = by_pair.get((node[src], node[dst]))
        if h is None:
            raise MlxConfigError(f"the epoch has no hop {node[src]} -> {node[dst]} (rank {src} -> rank {dst})", node=node[src])
        return h

    def reach(src: int, dst: int) -> str:
        """dst's side address as src reaches it."""
        h = hop(src, dst)
        return f"{ipv4_of(h.dst_ipv4, h, node[dst])}:{side_port(node[dst], members, epoch, fallback)}"

    mine = next(g for g in gs if rank in g)
    at = gs.index(mine)
    head = mine[0]
    args = ["--group-sizes", json.dumps([len(g) for g in gs]),
            "--shares", json.dumps([[s.heads, s.kv_heads, s.columns] for s in stages])]
    if rank == head:
        came = ([gs[at - 1][0]] if len(gs) > 1 else []) + list(mine[1:])
        listen = list(dict.fromkeys(reach(src, head) for src in came))
        args += ["--side-listen", json.dumps(listen)]
        if len(gs) > 1:
            args += ["--side-next", reach(head, gs[(at + 1) % len(gs)][0])]
    else:
        args += ["--side-head", reach(rank, head)]
    all_ports = epoch_ports(node, members, epoch, fallback)
    ring = tuple(hop(r, mine[(j + 1) % len(mine)]) for j, r in enumerate(mine)) if len(mine) > 1 else ()
    return RankLaunch(tuple(node[r] for r in mine), mine.index(rank), ring, tuple(all_ports[r] for r in mine), tuple(args))
