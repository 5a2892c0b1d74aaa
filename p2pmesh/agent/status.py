"""The control op `status` (and the HTTP API's /v1/cluster, /v1/models, /health): this agent's
view as JSON, made from a ClusterView snapshot, so it shows only committed state that is on
disk. The JSON keys are a contract (docs/client.md, the CLI's --json)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from p2pmesh.agent.ports import Snapshot
from p2pmesh.core import dataplane, fit
from p2pmesh.core.messages import ClusterState, FetchReport, LoadReport, Measure, PortInfo
from p2pmesh.core.ring_view import ring_json


def status_json(snapshot: Snapshot, state_dir: Path, load: LoadReport | None = None,
                transfers: list[FetchReport] | None = None) -> dict[str, Any]:
    """``load``: the serving head's fresh batch report, if any (the `requests` object);
    ``transfers``: the members' fresh fetch reports (the `transfers` list)."""
    st = snapshot.status
    if st is None:
        return {"node_id": snapshot.node_id, "pid": os.getpid(), "cluster_id": None, "role": "starting",
                "term": 0, "leader": None, "commit_index": 0, "applied_index": 0, "healthy": False,
                "members": [], "ring": None, "placement": None, "transfers": [], "state_dir": str(state_dir)}
    state = snapshot.state
    members = []
    ring: dict[str, Any] | None = None
    placement: dict[str, Any] | None = None
    if state is not None:
        for mem in state.members:
            members.append({
                "node_id": mem.node_id, "voter": mem.voter, "up": mem.up, "addresses": list(mem.addresses),
                "ports": [port_json(p) for p in mem.ports], "data_port": mem.caps.data_port,
                "chip": mem.caps.chip, "memory_bytes": mem.caps.memory_bytes,
                # What it measured it can give the model's layers (--memory-limit caps it), None before
                # it measured the model (or when it cannot load it).
                "offer_bytes": mem.measure.memory_bytes if isinstance(mem.measure, Measure) else None,
                # The planner's time inputs for the model (docs/placement.md): one layer's decode
                # step, and the part of it a tensor rank pays whatever its share.
                "layer_ms": mem.measure.layer_ms if isinstance(mem.measure, Measure) else None,
                "layer_fixed_ms": mem.measure.layer_fixed_ms if isinstance(mem.measure, Measure) else None,
            })
        ring = ring_json(state)
        placement = placement_json(state)
    return {
        "node_id": st.node_id,
        "pid": os.getpid(),
        "cluster_id": st.cluster,
        "role": st.role,
        "term": st.term,
        "leader": st.leader,
        "commit_index": st.commit_index,
        "applied_index": st.applied_index,
        "durable_index": st.durable_index,
        "healthy": st.healthy,
        "members": members,
        "ring": ring,
        "placement": placement,
        "requests": requests_json(state, load),
        "transfers": [transfer_json(t) for t in transfers or ()],
        "requests_resumed": snapshot.requests_resumed,
        "requests_asked_again": snapshot.requests_asked_again,
        "state_dir": str(state_dir),
    }


PUBLIC_KEYS = ("node_id", "cluster_id", "role", "term", "leader", "healthy", "commit_index", "applied_index",
               "members", "ring", "placement", "requests", "transfers")
"""The status keys the HTTP API shows (/v1/cluster, the dashboard's events): local details
(pid, state directory) stay on the control socket."""


def public_status(status: dict[str, Any]) -> dict[str, Any]:
    return {k: status.get(k) for k in PUBLIC_KEYS}


def requests_json(state: ClusterState | None, load: LoadReport | None) -> dict[str, Any] | None:
    """The status `requests` object: the serving head's batch (requests running in it and
    queued for a place, its tokens/s over the last seconds), None when no fresh report of
    the serving epoch's head is at hand (nothing serves, or the head has not said yet)."""
    if state is None or load is None or load.epoch != state.active_epoch or not state.active:
        return None
    return {"active": load.running, "queued": load.queued, "tokens_per_s": load.tokens_per_s,
            "head": load.src, "epoch": load.epoch}


def transfer_json(report: FetchReport) -> dict[str, Any]:
    """One `transfers` entry: a Mac copying ("peer") or downloading ("hub") its stage's
    missing files: bytes arrived and in all, MB/s over the last seconds, seconds left at
    that rate (None while unknown), the files ("model: file") downloading from the hub now.
    Shown while its reports are fresh (core/transfers.py)."""
    return {"node_id": report.src, "source": report.source, "bytes_done": report.bytes_done,
            "bytes_total": report.bytes_total, "mb_s": report.mb_s, "eta_s": report.eta_s,
            "hub_files": list(report.hub_files)}


def placement_json(state: ClusterState) -> dict[str, Any]:
    """The status `placement` object: the serving epoch's stages (and a pending one)."""
    def stages(ss: Any) -> list[dict[str, Any]]:
        return [{"node_id": s.node_id, "layers": [s.start, s.end]} for s in ss]

    up = {m.node_id for m in state.members if m.up}
    out: dict[str, Any] = {
        "epoch": state.active_epoch,
        "model": state.model.name if state.model else None,
        "stages": stages(state.active),
        **groups_json(state.active),
        "serving": bool(state.active) and all(s.node_id in up for s in state.active),
        # Requests served at once: KV cache is reserved for `batch`; it is below `batch_asked`
        # only where memory did not allow more (the placement serves fewer rather than refuse).
        "batch": state.active_batch,
        "batch_asked": state.model.batch if state.model else 1,
        "parallelism_asked": state.model.parallelism if state.model else "auto",
        # The serving epoch's KV cache bits: 4 or 8 (load --kv-bits), null at full precision.
        "kv_bits": state.active_kv_bits or None,
        # The planner's predicted time per token of this placement (None when it cannot tell).
        "tpot_ms": _predicted(state),
        # What one layer's weights take (the dashboard's memory bars: a stage holds
        # layers x layer_bytes of its Mac's memory_bytes); None without a model.
        "layer_bytes": state.model.layer_bytes if state.model else None,
    }
    if state.placement_epoch > state.active_epoch:
        out["pending"] = {"epoch": state.placement_epoch, "stages": stages(state.placement), **groups_json(state.placement),
                          "ready": list(state.ready),
                          "fetched": list(state.fetched), "batch": state.placement_batch,
                          "kv_bits": state.placement_kv_bits or None}
    problem = _placement_problem(state)
    if problem is not None:
        out["problem"] = problem.to_json()
    out["restarts"] = state.restarts
    if state.fault is not None:
        f = state.fault
        out["fault"] = {"code": f.code, "node_id": f.node_id, "address": f.address, "port": f.port,
                        "reporter": f.reporter, "epoch": f.epoch, "message": f.message}
    return out


def groups_json(stages: Any) -> dict[str, Any]:
    """`parallelism` ("single", "pipeline", "tensor", "hybrid"; null for no placement) and
    `groups`, as `plan solve --json` prints them: each group's node_ids and layers [start,
    end), and a tensor group's shares (heads, kv_heads, columns per node)."""
    if not stages:
        return {"parallelism": None, "groups": []}
    plan = dataplane.committed_plan(tuple(stages))
    return {"parallelism": plan.parallelism, "groups": [g.to_json() for g in plan.layout]}


def _per_state(fn: Any) -> Any:
    """``fn(state)`` computed once per committed state (clients poll status; the state is an
    immutable value, replaced on every change)."""
    memo: list[Any] = [None, None]

    def once(state: ClusterState) -> Any:
        if memo[0] is not state:
            memo[:] = [state, fn(state)]
        return memo[1]
    return once


_placement_problem = _per_state(fit.problem)
"""core/fit.py's verdict on the committed state."""
_predicted = _per_state(dataplane.predicted_tpot_ms)
"""The planner's predicted time per token of the serving placement."""


def port_json(p: PortInfo) -> dict[str, Any]:
    return {"interface": p.interface, "kind": p.kind, "domain_uuid": p.domain_uuid, "peer_domain_uuid": p.peer_domain_uuid,
            "up": p.up, "gbps": p.gbps, "ipv4": list(p.ipv4), "rdma": p.rdma}
