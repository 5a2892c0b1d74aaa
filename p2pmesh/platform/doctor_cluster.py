"""`p2pmesh doctor`'s checks of what this Mac sees of its cluster (pure): the mDNS round
trip on each interface and the p2pmesh agents heard advertising (core/advert.py parses their
TXT records), and the running agent's status (leader, members up or down, the ring and its
addresses, core/addressing.py). The vocabulary (Finding, Check) is doctor.py's.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from p2pmesh.core.addressing import AddressingError, ring_from_status, unaddressed_hops
from p2pmesh.core.advert import compatible, parse_txt
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.wire import PROTOCOL_VERSION
from p2pmesh.platform.doctor import ADDRESS_FIX, REPORT_FIX, Check, Finding, Status, fold


# ---------------------------------------------------------------------------------------
# mDNS


@dataclass(frozen=True, slots=True)
class MdnsProbe:
    """One interface's round trip: our throwaway service registered and browsed back."""

    interface: str
    addresses: tuple[str, ...]
    seen_ms: int | None  # None: not seen within the window
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SeenAdvert:
    """A p2pmesh agent's advertisement heard while probing (TXT as zeroconf gives it)."""

    name: str
    interface: str
    properties: Mapping[bytes, bytes | None]


def check_mdns(probes: Sequence[MdnsProbe], adverts: Sequence[SeenAdvert], *, window_ms: int, platform: str,
               own_node_id: str | None = None, fingerprint: str | None = None,
               members: Iterable[str] | None = None, over_ssh: bool = False, notes: Sequence[str] = ()) -> Check:
    """Per interface: could we register a DNS-SD service and browse it back in time? That
    proves zeroconf can bind, join the group and send there (not that other hosts hear it).
    Then the p2pmesh agents heard: different protocol or cluster key, or not yet members."""
    if not probes:
        return fold("mdns", [Finding("warn", "no interface with an address to test",
                                     "connect a network or a cable, or name an interface with --interface")], notes)
    failed = [p for p in probes if p.seen_ms is None]
    level: Status = "fail" if len(failed) == len(probes) else "warn"
    fix = ("check the interface is up with an address and that no firewall drops UDP 5353; meanwhile start the "
           "agent with `--peer HOST:7741` for each other Mac (static peers need no multicast)")
    if platform == "darwin":
        fix = ("allow Local Network access for the app that runs p2pmesh (System Settings > Privacy & Security > "
               "Local Network)" + (", and note that processes started over SSH may lack it" if over_ssh else "")
               + "; " + fix)
    findings = [Finding(level, f"{p.interface}: {p.error or f'our test service was not seen within {window_ms} ms'}", fix)
                for p in failed]
    details = [f"{p.interface} ({', '.join(p.addresses)}): seen after {p.seen_ms} ms" for p in probes if p.seen_ms is not None]
    details += notes
    ok = [p.interface for p in probes if p.seen_ms is not None]
    if ok:
        findings.append(Finding("ok", f"multicast DNS round trip works on {', '.join(ok)}"))
    findings += _advert_findings(adverts, own_node_id, fingerprint, members, details)
    return fold("mdns", findings, details)


def _advert_findings(adverts: Sequence[SeenAdvert], own: str | None, fingerprint: str | None,
                     members: Iterable[str] | None, details: list[str]) -> list[Finding]:
    member_ids = set(members) if members is not None else None
    out = []
    for a in adverts:
        try:
            peer = parse_txt(dict(a.properties))
        except RemoteProtocolError as e:
            out.append(Finding("warn", f"{a.name} on {a.interface} sent an unreadable advertisement ({e})",
                               "run the same p2pmesh version on every Mac"))
            continue
        if peer.node_id == own:
            continue
        details.append(f"agent {peer.node_id[:8]} on {a.interface}: protocol {peer.protocol}, chip {peer.chip or '?'}")
        why = compatible(peer, fingerprint or peer.cluster_fingerprint)
        if why is not None:
            fix = ("install the same p2pmesh version on every Mac" if peer.protocol != PROTOCOL_VERSION else
                   "install this cluster's key there: `p2pmesh key show` here, `p2pmesh key set KEY` there, then "
                   "restart its agent")
            out.append(Finding("warn", f"agent {peer.node_id[:8]} on {a.interface} {why}", fix))
        elif member_ids is not None and peer.node_id not in member_ids:
            out.append(Finding("warn", f"agent {peer.node_id[:8]} advertises on {a.interface} but is not a member of "
                               "this cluster", "it normally joins within seconds; if it stays out, run "
                               "`p2pmesh doctor` on that Mac (firewall, agent)"))
    return out


# ---------------------------------------------------------------------------------------
# The running agent


def check_agent(status: Mapping[str, Any] | None, error: str | None, *, socket: str) -> Check:
    """The local agent's view: leader, members up or down, the ring and its addresses.
    Protocol versions are compared when the status carries them. Without a status, `error`
    says why it could not be read (None: no agent runs at `socket`, which the finding says)."""
    if status is None:
        return fold("agent", [Finding("skip", f"no agent answers at {socket}",
                                      "start one with `p2pmesh agent` (pass --state-dir or --socket if it keeps its "
                                      "state elsewhere)")], [error] if error else [])
    members = [m for m in status.get("members") or [] if isinstance(m, dict)]
    node_id, leader = str(status.get("node_id", "?")), status.get("leader")
    down = [str(m.get("node_id", "?")) for m in members if not m.get("up", True)]
    findings: list[Finding] = []
    if not status.get("healthy"):
        findings.append(Finding("warn", f"no working leader (this agent is {status.get('role', '?')})",
                                "a cluster needs a majority of its voters up: run `p2pmesh status` on the other Macs"))
    if down:
        findings.append(Finding("warn", f"member(s) down: {', '.join(d[:8] for d in down)}",
                                "on each: is the agent running, is the cable or network up? (`p2pmesh doctor` there)"))
    for m in members:
        if isinstance(m.get("protocol"), int) and m["protocol"] != PROTOCOL_VERSION:
            findings.append(Finding("warn", f"member {str(m.get('node_id'))[:8]} speaks protocol {m['protocol']}, "
                                    f"this one {PROTOCOL_VERSION}", "install the same p2pmesh version on every Mac"))
    findings += _ring_findings(status, len(members))
    ring = status.get("ring") or {}
    order = (ring.get("order") or []) if isinstance(ring, dict) else []
    summary = (f"{status.get('role', '?')} in cluster {str(status.get('cluster_id'))[:8]}: {len(members) - len(down)} of "
               f"{len(members)} member(s) up, leader {str(leader)[:8] if leader else 'none'}, "
               + (f"ring of {len(order)} (epoch {ring.get('epoch')})" if order else "no ring"))
    findings.append(Finding("ok", summary))
    details = [f"node {node_id}"] + [f"member {m.get('node_id')}: {'up' if m.get('up', True) else 'DOWN'}" for m in members]
    check = fold("agent", findings, details)
    # With a warning the summary names only the problems; keep the overview in the details.
    return check if check.status == "ok" else replace(check, details=(summary, *check.details))


def _ring_findings(status: Mapping[str, Any], members: int) -> list[Finding]:
    try:
        view = ring_from_status(dict(status))
    except AddressingError as e:
        return [Finding("warn", f"the status's ring is malformed: {e}", REPORT_FIX)]
    if view is None:
        if members >= 2:
            return [Finding("warn", "no ring is committed yet",
                            "cable the Macs in a ring (each to two others, or two Macs to each other) and wait a few "
                            "seconds; `p2pmesh links` shows what this Mac sees")]
        return []
    out = []
    for hop in view.hops:
        if hop.kind == "thunderbolt" and (hop.src_ipv4 is None or hop.dst_ipv4 is None):
            out.append(Finding("warn", f"ring hop {hop.src[:8]}->{hop.dst[:8]} over Thunderbolt has no IPv4 pair",
                               ADDRESS_FIX))
    out += [Finding("warn", w) for w in unaddressed_hops(view.hops)]
    return out
