"""The data plane's lifecycle, decided from the committed state alone.

Leader side (``negotiate``): which placement epoch the cluster should move to. A new
placement is proposed *pending* (SetPlacement) when the model, the ring or the members'
measurements call for one; the planner's hysteresis keeps the serving plan unless it no
longer fits or a new one is better by its margin. Its workers load while the active epoch
keeps serving; once every stage's member reported its worker ready (WorkerReady), the
leader commits ActivatePlacement, the one entry that switches serving (make before break).

Member side (``wanted_workers``): which worker processes this node should run now: one for
the active epoch and one for a pending epoch, each with its rank and layer range. The agent
reconciles its processes with this set; ``pipeline_hops`` gives the addresses for the
epoch's MLX hostfile.
"""
from __future__ import annotations

from dataclasses import dataclass

from p2pmesh.core import fit, physical
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import (
    ActivatePlacement,
    ClusterState,
    RingHop,
    SetPlacement,
    Stage,
)
from p2pmesh.core.placement import NodeSpec, Plan, PlacementError, solve_placement
from p2pmesh.core.placement import Stage as PlanStage
from p2pmesh.core.ring import Link

RESTARTS_MAX = 5
"""A group that keeps failing with the same stages (a corrupt model file, a port taken) is
restarted at most this many times in a row; then the cluster stops serving and says so."""
PLACEMENT_MARGIN = 0.15
"""A serving plan is replaced only when a new one is at least 15% faster (or it no longer
fits): moving layers costs loading time, and measurements are noisy."""


@dataclass(frozen=True, slots=True)
class WantedWorker:
    epoch: int
    model: str
    stages: tuple[Stage, ...]
    rank: int
    batch: int = 1
    """Requests the epoch's head serves at once (its placement's KV reservation)."""


def negotiate(state: ClusterState) -> SetPlacement | ActivatePlacement | None:
    """What the leader should propose about placement now, if anything."""
    pending = state.placement_epoch > state.active_epoch
    if pending and state.placement and all(s.node_id in state.ready for s in state.placement):
        return ActivatePlacement(state.placement_epoch)
    found = _wanted_stages(state)
    if found is None:
        return None
    wanted, batch = found
    hops = pipeline_hops(state, wanted)
    model = state.model.name if state.model else ""
    if wanted != state.placement or hops != state.placement_hops or batch != state.placement_batch:
        return SetPlacement(state.placement_epoch + 1, model, wanted, state.ring_epoch, hops, batch=batch)
    newest = max(state.active_epoch, state.placement_epoch)
    if wanted and state.failed_epoch >= newest and state.restarts < RESTARTS_MAX:
        # A worker of the newest epoch died with every Mac still up: the group cannot
        # re-form inside its processes, so start the same stages as a new epoch.
        return SetPlacement(state.placement_epoch + 1, model, wanted, state.ring_epoch, hops, restart=True, batch=batch)
    return None  # already proposed (pending) or serving as it should


def _wanted_stages(state: ClusterState) -> tuple[tuple[Stage, ...], int] | None:
    """The stages the cluster should serve with, and the batch their KV cache is reserved
    for; None when it cannot tell yet."""
    model = state.model
    if model is None:
        return (), 1
    nodes = fit.planned_nodes(state)
    if not nodes:
        # Nobody measured it yet; or nobody can load it at all: then serve nothing, rather
        # than keep a placement of another model (core/fit.py says why).
        return ((), 1) if fit.unloadable(state) else None
    links = [Link(c.a, c.b, c.kind, c.gbps, c.rtt_ms) for c in physical.cables(state, physical.serving(state))]
    serving = state.active if state.active else state.placement
    current = Plan(tuple(PlanStage(s.node_id, s.start, s.end) for s in serving), 0.0) if serving else None

    def plan_for(batch: int, on: list[NodeSpec]) -> Plan | None:
        try:
            return solve_placement(fit.model_spec(model, batch), on, links, current=current, margin=PLACEMENT_MARGIN)
        except PlacementError:
            return None

    # The Macs are chosen for speed, serving one request: concurrency never brings a slower
    # Mac in. Then the KV cache for more requests at once goes where those Macs have room
    # (their layers may be shared out again for it), as many as fit up to the model's batch.
    single = plan_for(1, nodes)
    if single is None:
        return (), 1  # fits nowhere, even serving one request at a time (core/fit.py says why)
    chosen = {s.node_id for s in single.stages}
    used = [n for n in nodes if n.node_id in chosen]
    batch, plan = fit.largest_batch(max(1, model.batch), lambda b: single if b == 1 else plan_for(b, used))
    assert plan is not None  # batch 1 is `single`
    return tuple(Stage(NodeId(s.node_id), s.start, s.end) for s in plan.stages), batch


def _address_identity(h: RingHop) -> RingHop:
    return RingHop(h.src, h.dst, h.kind, 0.0, None, h.src_interface, h.dst_interface, h.src_ipv4, h.dst_ipv4, h.rdma)


def pipeline_hops(state: ClusterState, stages: tuple[Stage, ...]) -> tuple[RingHop, ...]:
    """The hop from each stage to the next (the last back to the first) with the addresses
    the MLX ring backend will use: the cable between them when there is one, else the LAN
    or control-plane path (core/physical.py describes hops the same way for the ring)."""
    nodes = [s.node_id for s in stages]
    if len(nodes) < 2:
        return ()
    by_id = {m.node_id: m for m in state.members}
    links = physical.cables(state, [by_id[n] for n in nodes if n in by_id])
    out = []
    for i, src in enumerate(nodes):
        dst = nodes[(i + 1) % len(nodes)]
        hop = physical.describe_hop(src, dst, links, by_id)
        if hop is None:
            continue
        out.append(_address_identity(hop))
    return tuple(out)


def wanted_workers(state: ClusterState, me: NodeId) -> list[WantedWorker]:
    """The workers this node should be running: its stage of the active epoch and of a
    pending one (the pending one is loading while the active one serves), the pending one
    only once every stage's files are fetched (``all_fetched``)."""
    out = []
    pending = state.placement if all_fetched(state) else ()
    for epoch, stages, batch in ((state.active_epoch, state.active, state.active_batch),
                                 (state.placement_epoch, pending, state.placement_batch)):
        for rank, s in enumerate(stages):
            if s.node_id == me and not any(w.epoch == epoch for w in out):
                model = state.model.name if state.model else ""
                out.append(WantedWorker(epoch, model, stages, rank, batch))
    return out


def all_fetched(state: ClusterState) -> bool:
    """Every stage's member of the placement has its model files on disk: its workers may
    start. MLX's ring connect gives up after about 30 s, so a group must not start forming
    while one Mac is still downloading its layers."""
    return all(s.node_id in state.fetched for s in state.placement)


def fetch_wanted(state: ClusterState, me: NodeId) -> tuple[int, str, int, int] | None:
    """(epoch, model, start, end) of the stage whose files this node should fetch now: its
    stage of a pending placement it has not reported fetched."""
    if state.placement_epoch <= state.active_epoch or me in state.fetched or state.model is None:
        return None
    for s in state.placement:
        if s.node_id == me:
            return state.placement_epoch, state.model.name, s.start, s.end
    return None


def head(state: ClusterState) -> NodeId | None:
    """The member whose worker takes requests now (rank 0 of the active epoch)."""
    return state.active[0].node_id if state.active else None
