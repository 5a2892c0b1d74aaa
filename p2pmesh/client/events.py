"""Cluster events from two successive statuses of the same agent (what `watch` yields)."""
from __future__ import annotations

from typing import Any

from p2pmesh.core.transfers import fetch_sentence, fetch_step
from p2pmesh.client.values import Event, EventKind, Status, newest_epoch


def diff(prev: Status, cur: Status) -> list[Event]:
    """The cluster events between two statuses of the same agent."""
    out: list[Event] = []

    def ev(kind: EventKind, detail: str, **kw: Any) -> None:
        out.append(Event(kind, detail, status=cur, **kw))

    moved = cur.cluster_id != prev.cluster_id and prev.cluster_id is not None and cur.cluster_id is not None
    if moved:
        ev(EventKind.CLUSTER_CHANGED, f"this agent is now in cluster {cur.cluster_id} (was {prev.cluster_id})")
    before = {m.node_id: m for m in prev.members}
    after = {m.node_id: m for m in cur.members}
    for node, m in after.items():
        old = before.get(node)
        if old is None:
            ev(EventKind.MEMBER_JOINED, f"{node[:8]} joined ({'voter' if m.voter else 'learner'})", node_id=node)
        elif old.up and not m.up:
            ev(EventKind.MEMBER_DOWN, f"{node[:8]} is down (the leader stopped hearing it)", node_id=node)
        elif not old.up and m.up:
            ev(EventKind.MEMBER_UP, f"{node[:8]} is up again", node_id=node)
    for node in before.keys() - after.keys():
        ev(EventKind.MEMBER_LEFT, f"{node[:8]} left the cluster", node_id=node)
    if cur.leader != prev.leader:
        ev(EventKind.LEADER_CHANGED, f"the leader is now {cur.leader[:8]}" if cur.leader else "no leader (election under way)",
           node_id=cur.leader)
    # Another cluster numbers its ring and placement epochs from scratch: compare its
    # epochs with nothing rather than with the old cluster's.
    r0, r1 = (None if moved else prev.ring), cur.ring
    if r1 is not None and (r0 is None or r1.epoch != r0.epoch):
        order = " -> ".join(n[:8] for n in r1.order) or "empty"
        ev(EventKind.RING_CHANGED, f"ring epoch {r1.epoch}: {order}", epoch=r1.epoch)
    q0, q1 = prev.requests, cur.requests
    if q1 is not None and (q0 is None or (q1.active, q1.queued) != (q0.active, q0.queued)):
        ev(EventKind.REQUESTS_CHANGED, f"{q1.active} request{'s' if q1.active != 1 else ''} running, {q1.queued} queued, "
           f"{q1.tokens_per_s:g} tokens/s", node_id=q1.head, epoch=q1.epoch)
    before_t = {t.node_id: t for t in prev.transfers}
    for t in cur.transfers:
        old = before_t.get(t.node_id)
        if old is None or fetch_step(old.source, old.bytes_done, old.bytes_total) != fetch_step(t.source, t.bytes_done, t.bytes_total):
            ev(EventKind.FETCH_PROGRESS, fetch_sentence(t.node_id, t.source, t.bytes_done, t.bytes_total, t.mb_s, t.eta_s),
               node_id=t.node_id, transfer=t)
    p0, p1 = prev.placement, cur.placement
    if p1 is None:
        return out
    if p0 is not None and p1.model != p0.model:
        ev(EventKind.MODEL_CHANGED, f"the cluster's model is now {p1.model}" if p1.model else "the cluster serves no model")
    if moved:
        p0 = None
    seen = newest_epoch(p0)
    pending0 = p0.pending if p0 is not None else None
    if p1.pending is not None:
        pe = p1.pending
        if pe.epoch > seen:
            ev(EventKind.PLAN_COMMITTED, f"placement epoch {pe.epoch} committed: {len(pe.stages)} stages, loading",
               epoch=pe.epoch, ready=pe.ready_count, stages=len(pe.stages))
        elif pending0 is not None and pending0.epoch == pe.epoch and pe.ready_count != pending0.ready_count:
            ev(EventKind.REBALANCE_PROGRESS, f"placement epoch {pe.epoch}: {pe.ready_count} of {len(pe.stages)} stages ready",
               epoch=pe.epoch, ready=pe.ready_count, stages=len(pe.stages))
    if p0 is None or p1.epoch > p0.epoch:
        if p1.epoch > seen:  # activated between two polls: we never saw it pending
            ev(EventKind.PLAN_COMMITTED, f"placement epoch {p1.epoch} committed", epoch=p1.epoch,
               ready=len(p1.stages), stages=len(p1.stages))
        if p0 is not None or p1.epoch > 0:
            n = len(p1.stages)
            ev(EventKind.PLAN_ACTIVATED, f"placement epoch {p1.epoch} serves now ({n} stage{'s' if n != 1 else ''})"
               if n else f"placement epoch {p1.epoch}: nothing to serve", epoch=p1.epoch, ready=n, stages=n)
    return out


