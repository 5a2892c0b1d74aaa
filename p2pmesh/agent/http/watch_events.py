"""The watch's events between two of this agent's status objects, for the dashboard's event
stream (`GET /v1/events`, dashboard.py).

The kinds and sentences are the ones `p2pmesh watch` prints (client/events.py, which diffs
the client's typed statuses). The agent cannot use that module: the client sits above the
agent (docs/architecture.md) and importing it loads the whole client, which imports the
agent. This one reads the status JSON the agent already has; tests/agent/test_dashboard.py
checks that both give the same events for the same statuses.
"""
from __future__ import annotations

from typing import Any

from p2pmesh.core.transfers import fetch_sentence, fetch_step

Json = dict[str, Any]


def watch_events(prev: Json, cur: Json) -> list[Json]:
    """The events between two status objects (status.py's keys) of the same agent, each
    `{"kind", "detail"}` plus `node_id` or `epoch` (and `ready`, `stages`) where they apply."""
    out: list[Json] = []

    def ev(kind: str, detail: str, **fields: Any) -> None:
        out.append({"kind": kind, "detail": detail, **fields})

    c0, c1 = prev.get("cluster_id"), cur.get("cluster_id")
    moved = c0 is not None and c1 is not None and c0 != c1
    if moved:
        ev("cluster_changed", f"this agent is now in cluster {c1} (was {c0})")
    before = {m["node_id"]: m for m in prev.get("members") or ()}
    after = {m["node_id"]: m for m in cur.get("members") or ()}
    for node, m in after.items():
        old = before.get(node)
        if old is None:
            ev("member_joined", f"{node[:8]} joined ({'voter' if m.get('voter') else 'learner'})", node_id=node)
        elif old.get("up") and not m.get("up"):
            ev("member_down", f"{node[:8]} is down (the leader stopped hearing it)", node_id=node)
        elif not old.get("up") and m.get("up"):
            ev("member_up", f"{node[:8]} is up again", node_id=node)
    for node in before.keys() - after.keys():
        ev("member_left", f"{node[:8]} left the cluster", node_id=node)
    leader = cur.get("leader")
    if leader != prev.get("leader"):
        ev("leader_changed", f"the leader is now {leader[:8]}" if leader else "no leader (election under way)", node_id=leader)
    r0, r1 = (None if moved else prev.get("ring")), cur.get("ring")
    if r1 and (not r0 or r1.get("epoch", 0) != r0.get("epoch", 0)):
        order = " -> ".join(n[:8] for n in r1.get("order") or ()) or "empty"
        ev("ring_changed", f"ring epoch {r1.get('epoch', 0)}: {order}", epoch=r1.get("epoch", 0))
    q0, q1 = prev.get("requests"), cur.get("requests")
    if q1 and (not q0 or (q1["active"], q1["queued"]) != (q0["active"], q0["queued"])):
        n = q1["active"]
        ev("requests_changed", f"{n} request{'s' if n != 1 else ''} running, {q1['queued']} queued, "
           f"{float(q1['tokens_per_s']):g} tokens/s", node_id=q1["head"], epoch=q1["epoch"])
    out += _placement_events(None if moved else prev.get("placement"), cur.get("placement"), prev.get("placement"))
    out += _fetch_events(prev.get("transfers") or (), cur.get("transfers") or ())
    return out


def _fetch_events(t0: Any, t1: Any) -> list[Json]:
    before = {t["node_id"]: t for t in t0}
    out: list[Json] = []
    for t in t1:
        old = before.get(t["node_id"])
        if old is None or _step(old) != _step(t):
            out.append({"kind": "fetch_progress", "detail": fetch_sentence(t["node_id"], t["source"], t["bytes_done"],
                                                                           t["bytes_total"], t["mb_s"], t["eta_s"]),
                        **{k: t[k] for k in ("node_id", "source", "bytes_done", "bytes_total", "mb_s", "eta_s")},
                        "hub_files": list(t.get("hub_files") or ())})
    return out


def _step(t: Json) -> tuple[str, int]:
    return fetch_step(str(t["source"]), int(t["bytes_done"]), int(t["bytes_total"]))


def _placement_events(p0: Json | None, p1: Json | None, unmoved: Json | None) -> list[Json]:
    """``p0``: the previous placement (None after a change of cluster, whose epochs count
    from scratch); ``unmoved``: the previous one whatever the cluster, for the model."""
    if not p1:
        return []
    out: list[Json] = []
    if unmoved and p1.get("model") != unmoved.get("model"):
        out.append({"kind": "model_changed", "detail": f"the cluster's model is now {p1['model']}" if p1.get("model")
                    else "the cluster serves no model"})
    seen = _newest_epoch(p0)
    pe, pe0 = p1.get("pending"), (p0 or {}).get("pending")
    if pe:
        stages, ready = len(pe["stages"]), _ready(pe)
        fields = {"epoch": pe["epoch"], "ready": ready, "stages": stages}
        if pe["epoch"] > seen:
            out.append({"kind": "plan_committed", "detail": f"placement epoch {pe['epoch']} committed: {stages} stages, "
                        f"loading", **fields})
        elif pe0 and pe0["epoch"] == pe["epoch"] and ready != _ready(pe0):
            out.append({"kind": "rebalance_progress", "detail": f"placement epoch {pe['epoch']}: {ready} of {stages} "
                        f"stages ready", **fields})
    epoch = p1.get("epoch", 0)
    if not p0 or epoch > p0.get("epoch", 0):
        n = len(p1.get("stages") or ())
        fields = {"epoch": epoch, "ready": n, "stages": n}
        if epoch > seen:  # activated between two looks: never seen pending
            out.append({"kind": "plan_committed", "detail": f"placement epoch {epoch} committed", **fields})
        if p0 or epoch > 0:
            out.append({"kind": "plan_activated", "detail": f"placement epoch {epoch} serves now ({n} stage"
                        f"{'s' if n != 1 else ''})" if n else f"placement epoch {epoch}: nothing to serve", **fields})
    return out


def _newest_epoch(p: Json | None) -> int:
    if not p:
        return 0
    pending = p.get("pending")
    return max(int(p.get("epoch", 0)), int(pending["epoch"]) if pending else 0)


def _ready(pending: Json) -> int:
    """Stage holders whose worker of the pending epoch is ready (PendingPlacement.ready_count)."""
    holders = {s["node_id"] for s in pending["stages"]}
    return sum(1 for n in set(pending.get("ready") or ()) if n in holders)
