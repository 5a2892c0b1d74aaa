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
from functools import lru_cache

from p2pmesh.core import fit, physical
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import (
    ActivatePlacement,
    ClusterState,
    RingHop,
    SetPlacement,
    Stage,
)
from p2pmesh.core.placement import (PARALLELISM_CHOICES, Group, ModelSpec, NodeSpec, ParallelismError, PlacementError,
                                     Plan, Share, predict_plan, solve_placement)
from p2pmesh.core.placement import Stage as PlanStage
from p2pmesh.core.ring import Link

RESTARTS_MAX = 5
"""A group that keeps failing with the same stages (a corrupt model file, a port taken) is
restarted at most this many times in a row; then the cluster stops serving and says so."""
SOLVE_MEMO = 64
"""Plans remembered (a change of Macs, measurements or model solves afresh; the batch
bisection asks up to log2(batch) + 1 plans per change)."""


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
    kv_bits: int = 0
    """Its KV cache bits (the placement's; 0: full precision)."""


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
    # Another kv_bits is a new epoch even on the same stages: workers quantize as they start.
    kv_bits = state.model.kv_bits if state.model and wanted else 0
    if (wanted != state.placement or hops != state.placement_hops or batch != state.placement_batch
            or kv_bits != state.placement_kv_bits):
        return SetPlacement(state.placement_epoch + 1, model, wanted, state.ring_epoch, hops, batch=batch, kv_bits=kv_bits)
    newest = max(state.active_epoch, state.placement_epoch)
    if wanted and state.failed_epoch >= newest and state.restarts < RESTARTS_MAX:
        # A worker of the newest epoch died with every Mac still up: the group cannot
        # re-form inside its processes, so start the same stages as a new epoch.
        return SetPlacement(state.placement_epoch + 1, model, wanted, state.ring_epoch, hops, restart=True, batch=batch,
                            kv_bits=kv_bits)
    return None  # already proposed (pending) or serving as it should


def _wanted_stages(state: ClusterState) -> tuple[tuple[Stage, ...], int] | None:
    """The stages (ranks) the cluster should serve with, and the batch their KV cache is
    reserved for; None when it cannot tell yet."""
    model = state.model
    if model is None:
        return (), 1
    nodes = fit.planned_nodes(state)
    if not nodes:
        # Nobody measured it yet; or nobody can load it at all: then serve nothing, rather
        # than keep a placement of another model (core/fit.py says why).
        return ((), 1) if fit.unloadable(state) else None
    links = planned_links(state)
    serving = state.active if state.active else state.placement
    current = committed_plan(serving) if serving else None
    asked = model.parallelism if model.parallelism in PARALLELISM_CHOICES else "auto"
    if asked == "auto" and physical.on_one_host(physical.serving(state)):
        # The cost model gives each member its own compute; agents on one host (loopback)
        # share its cores, so a tensor group there splits work that still runs on the same
        # cores and adds its all-reduces: measured on loopback, 2-rank tensor 32-47 tok/s
        # against one process's 39-41, while the model (rightly, for two Macs with these
        # measured paths) predicts it faster. Auto plans pipelines there; asked, tensor runs.
        asked = "pipeline"

    def plan_for(batch: int, on: tuple[NodeSpec, ...], parallelism: str) -> Plan | None:
        return _solve(fit.model_spec(model, batch), on, links, current, parallelism)

    # The Macs and the plan's shape (one Mac, a pipeline, tensor groups) are chosen for
    # speed, serving one request: concurrency never brings a slower Mac in. Then the KV
    # cache for more requests at once goes where those Macs have room, as many as fit up to
    # the model's batch: a pipeline's layers may be shared out again for it (searched as a
    # pipeline); tensor groups keep their Macs and layers (re-split per batch, cheap), so the
    # costly tensor search runs once per change, not once per batch tried.
    single = plan_for(1, tuple(nodes), asked)
    if single is None and asked != "pipeline":
        # The asked kind cannot be planned here (too few Macs, no tensor plan fits): serve as
        # a pipeline rather than not at all; status shows what was chosen.
        single = plan_for(1, tuple(nodes), "pipeline")
    if single is None:
        return (), 1  # fits nowhere, even serving one request at a time (core/fit.py says why)
    chosen = {n for g in single.layout for n in g.node_ids}
    used = tuple(n for n in nodes if n.node_id in chosen)

    def batch_plan(b: int) -> Plan | None:
        if b == 1:
            return single
        if single.groups:
            return _repredict(fit.model_spec(model, b), used, links, single)
        return plan_for(b, used, "pipeline")

    batch, plan = fit.largest_batch(max(1, model.batch), batch_plan)
    assert plan is not None  # batch 1 is `single`
    return committed_stages(plan), batch


def planned_links(state: ClusterState) -> tuple[Link, ...]:
    """The links between the serving members as the planner costs them: kind, Gb/s (a
    network path's as measured: physical.Cable.planned_gbps), the probed round trip, and
    RDMA where both ends of a Thunderbolt cable have it (a tensor group's all-reduce then
    costs JACCL's latency, not TCP's)."""
    return tuple(Link(c.a, c.b, c.kind, c.planned_gbps, c.rtt_ms,
                      rdma=bool(c.a_port and c.b_port and c.a_port.rdma and c.b_port.rdma))
                 for c in physical.cables(state, physical.serving(state)))


def predicted_tpot_ms(state: ClusterState) -> float | None:
    """The planner's predicted time per token of the serving placement (what
    scripts/bench_cluster.py sets against a measurement); None when it cannot tell (nothing
    serves, or a member of it has not measured the model)."""
    if state.model is None or not state.active:
        return None
    nodes = fit.planned_nodes(state)
    by_id = {n.node_id for n in nodes}
    if any(s.node_id not in by_id for s in state.active):
        return None
    plan = _repredict(fit.model_spec(state.model, max(1, state.active_batch)), tuple(nodes), planned_links(state),
                      committed_plan(state.active))
    return None if plan is None else round(plan.tpot_ms, 3)


@lru_cache(maxsize=SOLVE_MEMO)
def _solve(spec: ModelSpec, nodes: tuple[NodeSpec, ...], links: tuple[Link, ...], current: Plan | None,
           parallelism: str) -> Plan | None:
    """solve_placement on hashable inputs, memoized: the leader negotiates on every committed
    change and most leave the planner's inputs as they were, while a tensor search costs tens
    to hundreds of milliseconds (docs/placement.md, "Solve time"). Pure: the same inputs give
    the same plan, cached or not. None when nothing of that parallelism fits."""
    try:
        return solve_placement(spec, nodes, links, current=current, margin=PLACEMENT_MARGIN, parallelism=parallelism)
    except (PlacementError, ParallelismError):
        return None


@lru_cache(maxsize=SOLVE_MEMO)
def _repredict(spec: ModelSpec, nodes: tuple[NodeSpec, ...], links: tuple[Link, ...], plan: Plan) -> Plan | None:
    """The same groups re-split for another batch's KV cache; None when they no longer fit."""
    try:
        return predict_plan(spec, nodes, links, plan)
    except ValueError:
        return None


def committed_stages(plan: Plan) -> tuple[Stage, ...]:
    """A plan as committed: one Stage per rank, group-major; a tensor rank carries its share."""
    out = []
    for g in plan.layout:
        if len(g.node_ids) == 1:
            out.append(Stage(NodeId(g.node_ids[0]), g.start, g.end))
            continue
        for node, share in zip(g.node_ids, g.shares):
            out.append(Stage(NodeId(node), g.start, g.end, share.heads, share.kv_heads, share.columns))
    return tuple(out)


def groups(stages: tuple[Stage, ...]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each group of committed stages: consecutive stages with the same
    [start, end) (a pipeline never has two such stages, so each of its stages is a group)."""
    out: list[tuple[int, ...]] = []
    for rank, s in enumerate(stages):
        if out and (stages[out[-1][0]].start, stages[out[-1][0]].end) == (s.start, s.end):
            out[-1] = (*out[-1], rank)
        else:
            out.append((rank,))
    return tuple(out)


def parallelism(stages: tuple[Stage, ...]) -> str:
    """"single", "pipeline", "tensor" or "hybrid" (core/placement.Plan.parallelism); "" for none."""
    if not stages:
        return ""
    gs = groups(stages)
    wide = any(len(g) > 1 for g in gs)
    if len(gs) == 1:
        return "tensor" if wide else "single"
    return "hybrid" if wide else "pipeline"


def committed_plan(stages: tuple[Stage, ...]) -> Plan:
    """The planner's view of committed stages (hysteresis keeps it while it is good)."""
    layout = []
    for g in groups(stages):
        first = stages[g[0]]
        shares = tuple(Share(stages[r].heads, stages[r].kv_heads, stages[r].columns) for r in g) if len(g) > 1 else ()
        layout.append(Group(tuple(stages[r].node_id for r in g), first.start, first.end, shares))
    plan_stages = tuple(PlanStage(g.node_ids[0], g.start, g.end) for g in layout)
    wide = any(len(g.node_ids) > 1 for g in layout)
    return Plan(plan_stages, 0.0, 0.0, tuple(layout) if wide else ())


def _address_identity(h: RingHop) -> RingHop:
    return RingHop(h.src, h.dst, h.kind, 0.0, None, h.src_interface, h.dst_interface, h.src_ipv4, h.dst_ipv4, h.rdma)


def pipeline_hops(state: ClusterState, stages: tuple[Stage, ...]) -> tuple[RingHop, ...]:
    """The hops the epoch's workers use, with the addresses the MLX ring backend and the
    side channel between groups will use: the cable between the pair when there is one, else
    the LAN or control-plane path (core/physical.py describes hops the same way for the ring).

    A pipeline: from each stage to the next (the last back to the first). With tensor
    groups (``hop_pairs``): each group's own ring, each member to its group's head, and each
    head to the next group's head (the last to the first)."""
    nodes = [s.node_id for s in stages]
    if len(nodes) < 2:
        return ()
    by_id = {m.node_id: m for m in state.members}
    links = physical.cables(state, [by_id[n] for n in nodes if n in by_id])
    out = []
    for src, dst in hop_pairs(stages):
        hop = physical.describe_hop(src, dst, links, by_id)
        if hop is None:
            continue
        out.append(_address_identity(hop))
    return tuple(out)


def hop_pairs(stages: tuple[Stage, ...]) -> list[tuple[NodeId, NodeId]]:
    """(src, dst) of every hop an epoch needs, each once, in a fixed order (pipeline_hops)."""
    gs = groups(stages)
    if all(len(g) == 1 for g in gs):
        n = len(stages)
        return [(stages[i].node_id, stages[(i + 1) % n].node_id) for i in range(n)] if n > 1 else []
    pairs: list[tuple[NodeId, NodeId]] = []
    for g in gs:
        if len(g) > 1:
            pairs += [(stages[r].node_id, stages[g[(j + 1) % len(g)]].node_id) for j, r in enumerate(g)]
            pairs += [(stages[r].node_id, stages[g[0]].node_id) for r in g[1:]]
    heads = [stages[g[0]].node_id for g in gs]
    if len(heads) > 1:
        pairs += [(h, heads[(i + 1) % len(heads)]) for i, h in enumerate(heads)]
    return list(dict.fromkeys(pairs))


def wanted_workers(state: ClusterState, me: NodeId) -> list[WantedWorker]:
    """The workers this node should be running: its stage of the active epoch and of a
    pending one (the pending one is loading while the active one serves), the pending one
    only once every stage's files are fetched (``all_fetched``)."""
    out = []
    pending = state.placement if all_fetched(state) else ()
    for epoch, stages, batch, kv_bits in ((state.active_epoch, state.active, state.active_batch, state.active_kv_bits),
                                          (state.placement_epoch, pending, state.placement_batch, state.placement_kv_bits)):
        for rank, s in enumerate(stages):
            if s.node_id == me and not any(w.epoch == epoch for w in out):
                model = state.model.name if state.model else ""
                out.append(WantedWorker(epoch, model, stages, rank, batch, kv_bits))
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
