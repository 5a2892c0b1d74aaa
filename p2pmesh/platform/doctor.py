"""`p2pmesh doctor`'s judgement (pure): facts about this machine in, one Check per topic out.

Theory of operation. The driver (p2pmesh/cli/doctor_cmd.py) runs bounded commands, reads a few
files and probes mDNS; it hands what it got to the ``check_*`` functions here, raw command
output wrapped in ``Output`` (the text, or why there is none). A check turns its facts into
``Finding``s, one observation each with a one-line summary and, when something is wrong, a
concrete fix, and folds them into one ``Check``. Statuses rank skip < ok < warn < fail and a
check is as bad as its worst finding; only ``fail`` makes `p2pmesh doctor` exit 1.

The link checks (Thunderbolt, addresses, bridges, RDMA) are in core/doctor_links.py and the
firewall's in core/doctor_firewall.py; this module holds the framework and the mDNS, MLX,
memory and agent checks. Parsing reuses core/thunderbolt.py, core/linux_links.py,
core/addressing.py and core/advert.py. The parsers
added here cover vm_stat, sysctl, /proc/meminfo, sw_vers, rdma_ctl and the MLX probe's JSON. A
missing tool is a ``skip`` with the reason; malformed output is a finding naming the command,
never an exception.

Deliberately not here: running anything, reading the clock, choosing which interfaces to
probe, or changing anything on the machine (every fix is a suggestion for the user).
"""
from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from p2pmesh.core.addressing import (
    AddressingError,
    ring_from_status,
    unaddressed_hops,
)
from p2pmesh.core.advert import compatible, parse_txt
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.platform.thunderbolt import CaptureError
from p2pmesh.core.wire import PROTOCOL_VERSION

Status = Literal["ok", "warn", "fail", "skip"]
_RANK: dict[str, int] = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}
CHECK_NAMES = ("thunderbolt", "addresses", "bridge", "rdma", "firewall", "mdns", "mlx", "memory", "agent")

TEXT_CHARS_MAX = 4_000_000  # any single output we judge; real ones are a few KB
GIB = 1024**3
MEMORY_LOW_FRACTION = 0.15
MEMORY_LOW_BYTES = 2 * GIB
OS_RESERVE_BYTES = 4 * GIB  # what a raised GPU wired limit must leave to macOS
REPORT_FIX = "please report it with the command's output attached"
ADDRESS_FIX = ("with the agent running and the ring committed, `p2pmesh links plan` shows the commands and "
               "`sudo p2pmesh links apply` runs them (undone at reboot); or start the agent with --configure-links")


@dataclass(frozen=True, slots=True)
class Output:
    """What one command (or file) gave: its text, or why there is none."""

    text: str | None
    error: str | None = None
    missing: bool = False
    """The tool is not installed: checks that need it are skipped, not failed."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation of a check."""

    status: Status
    summary: str
    fix: str | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """The verdict on one topic: the worst of its findings."""

    name: str
    status: Status
    summary: str
    fix: str | None = None
    details: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status, "summary": self.summary}
        if self.fix:
            out["fix"] = self.fix
        if self.details:
            out["details"] = list(self.details)
        return out


class NoFacts(Exception):
    """A fact a check needs is unavailable; carries the finding that says so."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.summary)
        self.finding = finding


def fold(name: str, findings: Sequence[Finding], details: Iterable[str] = ()) -> Check:
    """One Check from findings: the worst status; the summaries and fixes of the findings
    that matter at that level (warnings and failures together, since both need fixing)."""
    assert findings, "every check makes at least one finding"
    worst = max((f.status for f in findings), key=_RANK.__getitem__)
    wanted = {"warn", "fail"} if worst in ("warn", "fail") else {worst}
    keep = [f for f in findings if f.status in wanted]
    fixes = list(dict.fromkeys(f.fix for f in keep if f.fix))
    return Check(name, worst, "; ".join(dict.fromkeys(f.summary for f in keep)), "\n".join(fixes) or None,
                 tuple(details))


def skipped(name: str, reason: str) -> Check:
    """A check that does not apply here (or was left out), with the reason."""
    return Check(name, "skip", reason)


def exit_code(checks: Iterable[Check]) -> int:
    """0 unless a check failed (warnings do not fail the run)."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def report_json(checks: Sequence[Check]) -> dict[str, Any]:
    return {"ok": exit_code(checks) == 0, "checks": [c.to_json() for c in checks]}


_MARK = {"ok": " ok ", "warn": "warn", "fail": "FAIL", "skip": "skip"}


def render_text(checks: Sequence[Check]) -> str:
    """The human report: one line per check, then its fix and details, then a tally."""
    lines = []
    pad = " " * 20  # under the summary: "[xxxx] " and a 12-wide name column
    for c in checks:
        lines.append(f"[{_MARK[c.status]}] {c.name:<12} {c.summary}")
        for i, fix in enumerate((c.fix or "").splitlines()):
            lines.append(f"{pad}{'fix: ' if i == 0 else '     '}{fix}")
        lines += [f"{pad}- {d}" for d in c.details]
    counts = {s: sum(1 for c in checks if c.status == s) for s in _RANK}
    lines.append(f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


def need(out: Output, what: str) -> str:
    """The text of an output, or NoFacts: skip when the tool is missing, fail when it broke."""
    if out.text is not None:
        if len(out.text) > TEXT_CHARS_MAX:
            raise NoFacts(Finding("fail", f"{what} printed more than {TEXT_CHARS_MAX} characters"))
        return out.text
    if out.missing:
        raise NoFacts(Finding("skip", out.error or f"{what} is not installed"))
    raise NoFacts(Finding("fail", f"cannot run {what}: {out.error or 'no output'}",
                           f"run `{what}` yourself to see the error"))


def parse_switch(text: str, off: str, on: str) -> bool | None:
    """A tool's word for a switch: False when ``off`` (a regex alternation of whole words)
    appears, else True when ``on`` does, else None (off is looked for first: a text that
    names both reads as off)."""
    low = text.lower()
    if re.search(rf"\b({off})\b", low):
        return False
    if re.search(rf"\b({on})\b", low):
        return True
    return None


def guard(name: str, body: Any, *args: Any) -> Check:
    """Run one check body, turning unavailable facts and malformed captures into findings."""
    try:
        result: Check = body(*args)
        return result
    except NoFacts as e:
        return fold(name, [e.finding])
    except CaptureError as e:
        return fold(name, [Finding("fail", f"unexpected command output: {e}", f"this is a p2pmesh bug: {REPORT_FIX}")])


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
# MLX


def check_mlx(probe: Output, platform: str) -> Check:
    """The MLX probe's JSON (version, device, Metal, a 2x2 matmul, ring backend, mlx-lm)."""
    return guard("mlx", _mlx, probe, platform)


def _mlx(probe: Output, platform: str) -> Check:
    text = need(probe, "the MLX probe")
    try:
        facts = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return fold("mlx", [Finding("fail", f"the MLX probe printed {text.strip()[-120:]!r}", REPORT_FIX)])
    if not isinstance(facts, dict):
        return fold("mlx", [Finding("fail", "the MLX probe printed no JSON object", REPORT_FIX)])
    python = str(facts.get("python", "python"))
    pip = f"`{shlex.quote(python)} -m pip install " + ("mlx mlx-lm`" if platform == "darwin" else "'mlx[cpu]' mlx-lm`")
    details = [f"python: {python} ({facts.get('machine', '?')})"]
    if facts.get("import_error"):
        return fold("mlx", [Finding("fail", f"MLX cannot be imported: {facts['import_error']}"[:300], pip)], details)
    findings = []
    if platform == "darwin" and facts.get("machine") != "arm64":
        findings.append(Finding("fail", f"Python runs as {facts.get('machine')} (Rosetta): MLX needs a native arm64 Python",
                                "install an arm64 Python (python.org, or Homebrew in /opt/homebrew) and p2pmesh in it"))
    if platform == "darwin" and facts.get("metal") is not True:
        findings.append(Finding("fail", "MLX cannot use the GPU (Metal is unavailable)",
                                "MLX needs Apple silicon and macOS 14 or later; reinstall with " + pip))
    if facts.get("matmul") != [[7.0, 10.0], [15.0, 22.0]]:
        findings.append(Finding("fail", f"a 2x2 matmul gave {facts.get('matmul')!r}", "reinstall MLX: " + pip))
    if facts.get("ring") is not True:
        findings.append(Finding("fail", "MLX's ring backend is unavailable (p2pmesh's pipeline runs on it)", "reinstall MLX: " + pip))
    if not facts.get("mlx_lm"):
        findings.append(Finding("fail", "mlx-lm is not installed (the workers load models with it)", pip))
    if facts.get("working_set_bytes"):
        details.append(f"Metal recommended working set: {int(facts['working_set_bytes']) / GIB:.1f} GiB "
                       "(what p2pmesh offers for layers by default)")
    if platform == "darwin":
        details.append(f"JACCL (RDMA) backend available: {bool(facts.get('jaccl'))}")
    details.append(f"mlx-lm {facts.get('mlx_lm') or 'missing'}")
    findings.append(Finding("ok", f"MLX {facts.get('version')} on {facts.get('device')}: matmul and ring backend work"))
    return fold("mlx", findings, details)


# ---------------------------------------------------------------------------------------
# Memory


def parse_vm_stat(text: str) -> dict[str, int]:
    """`vm_stat` -> {"page size": bytes, "pages free": n, "pages inactive": n, ...}."""
    m = re.search(r"page size of ([0-9]{1,9}) bytes", text)
    if m is None:
        raise CaptureError("vm_stat output has no 'page size of N bytes' header")
    out = {"page size": int(m.group(1))}
    for line in text.splitlines()[1:]:
        kv = re.fullmatch(r'\s*"?([A-Za-z][A-Za-z -]*?)"?:\s+([0-9]{1,20})\.?\s*', line)
        if kv is not None:
            out[kv.group(1).lower()] = int(kv.group(2))
    if "pages free" not in out:
        raise CaptureError("vm_stat output has no 'Pages free' line")
    return out


def parse_sysctl_int(text: str, name: str) -> int:
    """`sysctl NAME` ("hw.memsize: 68719476736") or `sysctl -n NAME` -> the integer."""
    m = re.fullmatch(rf"\s*(?:{re.escape(name)}\s*[:=]\s*)?([0-9]{{1,20}})\s*", text)
    if m is None:
        raise CaptureError(f"sysctl {name} printed {text.strip()[:60]!r}, not an integer")
    return int(m.group(1))


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo -> (MemTotal, MemAvailable) in bytes."""
    values = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(MemTotal|MemAvailable):\s+([0-9]{1,20}) kB\s*", line)
        if m is not None:
            values[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in values or "MemAvailable" not in values:
        raise CaptureError("/proc/meminfo has no MemTotal or MemAvailable line")
    return values["MemTotal"], values["MemAvailable"]


def check_memory_macos(vm_stat: Output, memsize: Output, wired_limit: Output) -> Check:
    """Available = free + inactive + speculative pages (what macOS hands out without
    swapping); plus the GPU wired limit (iogpu.wired_limit_mb, 0 = macOS's default)."""
    return guard("memory", _memory_macos, vm_stat, memsize, wired_limit)


def _memory_macos(vm_stat: Output, memsize: Output, wired_limit: Output) -> Check:
    vm = parse_vm_stat(need(vm_stat, "vm_stat"))
    total = parse_sysctl_int(need(memsize, "sysctl hw.memsize"), "hw.memsize")
    available = vm["page size"] * sum(vm.get(k, 0) for k in ("pages free", "pages inactive", "pages speculative"))
    findings = [_memory_level(total, min(available, total), "quit memory-hungry apps (Activity Monitor > Memory)")]
    details = []
    try:
        limit_mb = parse_sysctl_int(wired_limit.text, "iogpu.wired_limit_mb") if wired_limit.text is not None else None
    except CaptureError:
        limit_mb = None  # optional: the memory figures above still stand
    if limit_mb is None:
        details.append("GPU wired limit: unknown (no iogpu.wired_limit_mb on this macOS)")
    elif limit_mb == 0:
        details.append("GPU wired limit: macOS's default (iogpu.wired_limit_mb=0); `sudo sysctl "
                       "iogpu.wired_limit_mb=N` raises it until reboot")
    else:
        details.append(f"GPU wired limit: {limit_mb} MiB (iogpu.wired_limit_mb)")
        if limit_mb * 1024 * 1024 > total - OS_RESERVE_BYTES:
            suggest = max(total // (1024 * 1024) - 8192, total // (2 * 1024 * 1024))
            findings.append(Finding(
                "warn", f"iogpu.wired_limit_mb={limit_mb} leaves less than {OS_RESERVE_BYTES // GIB} GiB to macOS: "
                "the Mac may stall under a large model",
                f"lower it: `sudo sysctl iogpu.wired_limit_mb={suggest}` (until reboot; 0 restores the default)"))
    return fold("memory", findings, details)


def check_memory_linux(meminfo: Output) -> Check:
    def body() -> Check:
        total, available = parse_meminfo(need(meminfo, "/proc/meminfo"))
        return fold("memory", [_memory_level(total, available, "stop memory-hungry processes")])

    return guard("memory", body)


def _memory_level(total: int, available: int, quit_apps: str) -> Finding:
    said = f"{available / GIB:.1f} GiB of {total / GIB:.1f} GiB available"
    if available < MEMORY_LOW_BYTES or available < MEMORY_LOW_FRACTION * total:
        return Finding("warn", f"memory is tight: {said}",
                       f"{quit_apps} before loading a model; `p2pmesh agent --memory-limit BYTES` caps what this "
                       "machine offers for layers")
    return Finding("ok", said)


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
