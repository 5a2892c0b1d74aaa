"""`p2pmesh doctor`'s judgement (pure): facts about this machine in, one Check per topic out.

Theory of operation. The driver (p2pmesh/cli/doctor_cmd.py) runs bounded commands, reads a few
files and probes mDNS; it hands what it got to the ``check_*`` functions of the doctor
modules, raw command output wrapped in ``Output`` (the text, or why there is none). A check
turns its facts into ``Finding``s, one observation each with a one-line summary and, when
something is wrong, a concrete fix, and folds them into one ``Check``. Statuses rank skip <
ok < warn < fail and a check is as bad as its worst finding; only ``fail`` makes `p2pmesh
doctor` exit 1. A missing tool is a ``skip`` with the reason; malformed output is a finding
naming the command, never an exception.

This module is that vocabulary and the report (folding, JSON, text). The checks, one
concept a module:
- doctor_links.py: Thunderbolt, addresses, bridges, RDMA (parsing reuses thunderbolt.py,
  linux_links.py and core/addressing.py);
- doctor_firewall.py: the packet filter (pf, the application firewall, nftables, iptables);
- doctor_host.py: this machine's runtime: MLX (the probe's JSON) and memory (vm_stat,
  sysctl, /proc/meminfo);
- doctor_cluster.py: what this Mac sees of its cluster: mDNS (our round trip and the
  agents' adverts, core/advert.py) and the running agent's status.

Deliberately not here: running anything, reading the clock, choosing which interfaces to
probe, or changing anything on the machine (every fix is a suggestion for the user).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from p2pmesh.platform.thunderbolt import CaptureError

Status = Literal["ok", "warn", "fail", "skip"]
_RANK: dict[str, int] = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}
CHECK_NAMES = ("thunderbolt", "addresses", "bridge", "rdma", "firewall", "mdns", "mlx", "memory", "agent")

TEXT_CHARS_MAX = 4_000_000  # any single output we judge; real ones are a few KB
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
