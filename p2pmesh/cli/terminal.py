"""What the CLI shows people: the committed cluster state (the same JSON `--json` prints)
rendered with rich: members, the ring drawn with its cables and speeds, the placement, and
progress bars for loading and rebalancing.

Colour is decoration, never information: everything coloured is also said in words, and
rich drops the styles when stdout is not a terminal (a pipe, a file) or NO_COLOR is set.
"""
from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from p2pmesh.core.transfers import fetch_sentence

SHORT_ID = 8
TB_STYLE, SLOW_STYLE, DOWN_STYLE, OK_STYLE, DIM = "green", "yellow", "bold red", "green", "dim"


def console(stream: TextIO | None = None) -> Console:
    """A console for `stream` (stdout by default): styled on a terminal, plain in a pipe."""
    # markup=False: text from the cluster (model names, generated text) may hold [brackets].
    return Console(file=stream or sys.stdout, highlight=False, soft_wrap=True, emoji=False, markup=False)


def short(node: str | None, me: str | None = None) -> str:
    if not node:
        return "none"
    return node[:SHORT_ID] + (" (this Mac)" if node == me else "")


def speed(gbps: float | None) -> str:
    return f" {gbps:g} Gb/s" if gbps else ""


def header(status: dict[str, Any]) -> Text:
    t = Text()
    t.append(f"node {short(status['node_id'])}", style="bold")
    t.append(f"  role {status['role']}  cluster {status.get('cluster_id') or '-'}  term {status['term']}  ")
    t.append(f"leader {short(status.get('leader'))}")
    if not status.get("healthy", True):
        t.append("  NO QUORUM (waiting for a leader)", style=DOWN_STYLE)
    return t


def members_table(status: dict[str, Any]) -> Table:
    """One row per member: id, role, up or DOWN, addresses, ports."""
    me, leader = status["node_id"], status.get("leader")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for col in ("member", "role", "state", "addresses", "ports"):
        table.add_column(col)
    for m in status["members"]:
        role = "leader" if m["node_id"] == leader else ("voter" if m["voter"] else "learner (catching up)")
        state = Text("up", style=OK_STYLE) if m["up"] else Text("DOWN", style=DOWN_STYLE)
        ports = ", ".join(f"{p['interface']} {p['kind']}{speed(p.get('gbps'))}" + ("" if p.get("up", True) else " (down)")
                          for p in m.get("ports", []))
        table.add_row(short(m["node_id"], me), role, state, " ".join(m["addresses"]), ports or "-")
    return table


def ring_text(ring: dict[str, Any] | None, me: str | None = None) -> Text:
    """The committed ring as a cycle of Macs joined by their cables: Thunderbolt hops as
    double lines, slow hops (Ethernet, Wi-Fi, routed) as single lines, marked in words."""
    order: list[str] = (ring or {}).get("order") or []
    if not order:
        return Text("ring: none committed yet")
    assert ring is not None
    n = len(order)
    t = Text(f"ring epoch {ring['epoch']}: {n} node{'s' if n != 1 else ''}", style="bold")
    if n == 1:
        t.append(f"\n  {short(order[0], me)} (alone: no data-plane hops)", style="")
        return t
    for h in ring.get("hops", []):
        tb = h["kind"] == "thunderbolt"
        t.append(f"\n  {short(h['from'], me)} ")
        t.append("════════" if tb else "────────", style=TB_STYLE if tb else SLOW_STYLE)
        t.append(f" {short(h['to'], me)}  {h['kind']}{speed(h.get('gbps'))}")
        if h.get("rtt_ms") is not None:
            t.append(f", {h['rtt_ms']:g} ms")
        if h.get("rdma"):
            t.append(", RDMA")
        if h.get("from_interface"):
            t.append(f" [{h['from_interface']} -> {h['to_interface']}]", style=DIM)
        if not tb:
            t.append("   <- slow hop", style=SLOW_STYLE)
    t.append(f"\n  back to {short(order[0], me)}; bottleneck {ring.get('bottleneck_gbps') or 0:g} Gb/s")
    return t


def batch_words(batch: int, asked: int) -> str:
    """How many requests the placement serves at once, and why fewer than asked."""
    words = f"{batch} request{'s' if batch != 1 else ''} at once"
    return words if batch >= asked else f"{words} ({asked} asked: memory holds the KV cache of {batch} only)"


def placement_text(placement: dict[str, Any] | None, me: str | None = None) -> Text:
    """The model's layers on the ring: the serving epoch's stages and a loading one."""
    if not placement or not placement.get("model"):
        return Text("model: none (load one with `p2pmesh load PATH|HF-ID`)")
    t = Text(f"model {placement['model']}", style="bold")
    serving = placement.get("serving")
    t.append(f"  epoch {placement.get('epoch', 0)}  ")
    t.append("serving" if serving else "not serving", style=OK_STYLE if serving else SLOW_STYLE)
    if placement.get("stages"):
        batch, asked = int(placement.get("batch") or 1), int(placement.get("batch_asked") or 1)
        t.append(f"  {batch_words(batch, asked)}", style=SLOW_STYLE if batch < asked else "")
    if placement.get("kv_bits"):
        t.append(f"  KV cache {placement['kv_bits']}-bit")
    kind = placement.get("parallelism")
    if kind in ("tensor", "hybrid"):
        # Groups of Macs sharing every layer of their range (a Mac alone in a hybrid: a stage).
        t.append(f"\n  {kind}" + ("" if placement.get("parallelism_asked") in (None, "auto", kind)
                                   else f" ({placement.get('parallelism_asked')} asked)"))
        for i, g in enumerate(placement.get("groups", [])):
            start, end = g["layers"]
            names = ", ".join(short(n, me) for n in g["node_ids"])
            t.append(f"\n  group {i}: {names} layers {start}-{end - 1} ({end - start})")
    else:
        if kind and placement.get("parallelism_asked") not in (None, "auto", "pipeline"):
            t.append(f"\n  {kind} ({placement.get('parallelism_asked')} asked: it could not be planned here)",
                     style=SLOW_STYLE)
        for i, s in enumerate(placement.get("stages", [])):
            start, end = s["layers"]
            t.append(f"\n  stage {i}: {short(s['node_id'], me)} layers {start}-{end - 1} ({end - start})")
    pending = placement.get("pending")
    if pending:
        ready, total = len(set(pending.get("ready", []))), len(pending.get("stages", []))
        t.append(f"\n  loading epoch {pending['epoch']}: {ready} of {total} workers ready", style=SLOW_STYLE)
    problem = placement.get("problem")
    if problem:
        t.append(f"\n  {problem.get('code')}: {problem.get('message')}", style=SLOW_STYLE)
    fault = placement.get("fault")
    if fault:
        t.append("\n  " + fault_line(fault, me), style=DOWN_STYLE)
        t.append(f" (restarted {placement.get('restarts', 0)} time(s); see docs/troubleshooting.md)")
    return t


FAULT_WORDS = {
    "ring_peer_unreachable": "cannot reach {node}'s worker at {at}",
    "ring_port_in_use": "{node}'s data port {at} is taken by another program",
    "ring_address_unavailable": "{node} has no address {at}",
    "ring_bind_failed": "{node} cannot listen on {at}",
}


def fault_line(fault: dict[str, Any], me: str | None = None) -> str:
    """Why an epoch's workers could not form their ring, in words (the code is kept too)."""
    words = FAULT_WORDS.get(fault.get("code", ""), "{node} at {at}: the ring failed")
    where = words.format(node=f"node {short(fault.get('node_id'), me)}", at=f"{fault.get('address')}:{fault.get('port')}")
    return f"epoch {fault.get('epoch')}: worker on {short(fault.get('reporter'), me)}: {where} [{fault.get('code')}]"


def status_view(status: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = [header(status), members_table(status)]
    if status.get("ring"):
        parts.append(ring_text(status["ring"], status["node_id"]))
    parts.append(placement_text(status.get("placement"), status["node_id"]))
    requests = status.get("requests")
    if requests:
        parts.append(Text(f"requests: {requests['active']} running, {requests['queued']} queued, "
                          f"{requests['tokens_per_s']:g} tokens/s (head {short(requests['head'], status['node_id'])})"))
    for t in status.get("transfers") or ():
        parts.append(Text(fetch_sentence(t["node_id"], t["source"], t["bytes_done"], t["bytes_total"], t["mb_s"], t["eta_s"])))
    if status.get("requests_resumed"):
        parts.append(Text(f"requests resumed on a new epoch so far: {status['requests_resumed']}"))
    return Group(*parts)
