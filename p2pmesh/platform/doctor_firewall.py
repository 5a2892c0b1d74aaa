"""`p2pmesh doctor`'s firewall check (pure): is anything on this machine dropping what the
agent needs (7741/tcp peers, 5353/udp mDNS, 47000+/tcp data plane)?

macOS: the Application Firewall, read from `socketfilterfw` (global state, block-all,
stealth mode, and whether the firewall blocks this Python). Linux: the INPUT rules of
`iptables-save` or `nft list ruleset`, read heuristically (jumps between chains are not
followed), so the check says which ports a rule drops, never that all is well for certain.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from p2pmesh.platform.doctor import TEXT_CHARS_MAX, Check, Finding, Output, fold, guard, need, parse_switch, skipped

FIREWALL_TOOL = "/usr/libexec/ApplicationFirewall/socketfilterfw"


def parse_firewall_state(text: str) -> int | None:
    """`socketfilterfw --getglobalstate`: "Firewall is enabled. (State = 1)" -> 1 (0 off,
    1 on, 2 on for essential services only, i.e. blocking all); None if unrecognised."""
    m = re.search(r"State\s*=\s*([0-9])", text)
    if m is not None:
        return int(m.group(1))
    return {True: 1, False: 0, None: None}[parse_on_off(text)]


def parse_on_off(text: str) -> bool | None:
    """--getblockall / --getstealthmode across macOS versions ("Firewall has block all state
    set to enabled.", "Block all DISABLED!", "Firewall stealth mode is on",
    "Stealth mode disabled") -> True/False; None when it says neither."""
    return parse_switch(text, "disabled|off", "enabled|on")


def parse_app_blocked(text: str, path: str = "") -> bool | None:
    """`socketfilterfw --getappblocked PATH`: True blocked, False permitted, None when the
    app is not in the firewall's list (macOS then asks at the first incoming connection).
    The path is cut out first, so a directory named "blocked" cannot sway the verdict."""
    low = (text.replace(path, " ") if path else text).lower()
    if "not blocked" in low or "permitted" in low or "allowed" in low:
        return False
    if "blocked" in low:
        return True
    return None


def firewall_app_path(executable: str) -> str:
    """The path the Application Firewall knows a Python by: a framework build runs as
    .../Python.framework/Versions/X/Resources/Python.app, not as the bin/python3 symlink."""
    m = re.match(r"(.*/Python\.framework/Versions/[^/]+)/", executable)
    return f"{m.group(1)}/Resources/Python.app" if m else executable


@dataclass(frozen=True, slots=True)
class MacFirewallFacts:
    """socketfilterfw's four answers, and the path the firewall knows this Python by."""

    global_state: Output
    block_all: Output
    stealth: Output
    app_blocked: Output
    app_path: str


def check_firewall_macos(facts: MacFirewallFacts) -> Check:
    """Off is fine; "block all" or a blocked Python fails; on without Python listed warns."""
    return guard("firewall", _firewall_macos, facts)


def _firewall_macos(facts: MacFirewallFacts) -> Check:
    state = parse_firewall_state(need(facts.global_state, "socketfilterfw --getglobalstate"))
    if state is None:
        return fold("firewall", [Finding("warn", f"unrecognised firewall state {facts.global_state.text!r}"[:160],
                                         f"run `{FIREWALL_TOOL} --getglobalstate` yourself")])
    if state == 0:
        return fold("firewall", [Finding("ok", "the Application Firewall is off")])
    app = shlex.quote(facts.app_path)
    details = []
    stealth = parse_on_off(facts.stealth.text) if facts.stealth.text else None
    if stealth:
        details.append("stealth mode is on: pings and probes of closed ports go unanswered (p2pmesh needs neither)")
    block_all = parse_on_off(facts.block_all.text) if facts.block_all.text else None
    if state == 2 or block_all:
        return fold("firewall", [Finding(
            "fail", "the firewall blocks all incoming connections: peers cannot connect and mDNS answers are dropped",
            "System Settings > Network > Firewall > Options: turn off 'Block all incoming connections'")], details)
    blocked = parse_app_blocked(facts.app_blocked.text, facts.app_path) if facts.app_blocked.text else None
    allow = f"`sudo {FIREWALL_TOOL} --add {app}` then `sudo {FIREWALL_TOOL} --unblockapp {app}`"
    if blocked:
        finding = Finding("fail", f"the firewall blocks incoming connections to {facts.app_path}",
                          f"allow incoming connections for python in the Application Firewall: {allow} (or System "
                          "Settings > Network > Firewall > Options)")
    elif blocked is None:
        finding = Finding("warn", f"the firewall is on and {facts.app_path} is not in its list: macOS asks at the first "
                          "incoming connection, and on a headless Mac or over SSH nobody answers",
                          f"allow incoming connections for python in the Application Firewall: {allow}")
    else:
        finding = Finding("ok", f"the firewall is on and lets {facts.app_path} accept connections")
    return fold("firewall", [finding], details)


# ---------------------------------------------------------------------------------------
# Firewall: Linux packet filters (a heuristic reading of iptables-save / nft list ruleset)


@dataclass(frozen=True, slots=True)
class PortRule:
    """One rule that matches destination ports and decides: accept or drop."""

    protocol: str  # "tcp", "udp" or "any"
    ports: tuple[tuple[int, int], ...]  # inclusive ranges
    verdict: Literal["accept", "drop"]
    text: str


@dataclass(frozen=True, slots=True)
class InputFilter:
    """What a ruleset does to incoming packets, as far as the agent's ports are concerned."""

    source: str
    rules: tuple[PortRule, ...]
    default_drop: bool  # an input policy of drop, or a catch-all drop/reject rule


_VERDICTS = {"ACCEPT": "accept", "DROP": "drop", "REJECT": "drop", "accept": "accept", "drop": "drop", "reject": "drop"}


def _port_ranges(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in re.split(r"[,\s]+", text.strip("{} ")):
        if not part:
            continue
        m = re.fullmatch(r"([0-9]{1,5})(?:[:-]([0-9]{1,5}))?", part)
        if m is None:
            return ()  # a named service or a set we cannot read: no claim about it
        lo = int(m.group(1))
        out.append((lo, int(m.group(2) or lo)))
    return tuple(out)


def parse_iptables_save(text: str) -> InputFilter:
    """The filter table of `iptables-save`: the INPUT policy and every rule with --dport(s).
    Chains are not followed; a rule in any chain but OUTPUT/FORWARD counts as it reads."""
    rules, default_drop, table = [], False, None
    for line in text[:TEXT_CHARS_MAX].splitlines():
        line = line.strip()
        if line.startswith("*"):
            table = line[1:]
        elif table != "filter":
            continue
        elif line.startswith(":INPUT ") and line.split()[1] in ("DROP", "REJECT"):
            default_drop = True
        elif line.startswith("-A ") and "!" not in line:
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            chain = words[1] if len(words) > 1 else ""
            target = words[words.index("-j") + 1] if "-j" in words[:-1] else ""
            if chain in ("OUTPUT", "FORWARD") or target not in _VERDICTS:
                continue
            verdict = _VERDICTS[target]
            ports = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--dport", "--dports", "--destination-port")), None)
            if ports is not None:
                proto = words[words.index("-p") + 1] if "-p" in words[:-1] else "any"
                ranges = _port_ranges(ports)
                if ranges:
                    rules.append(PortRule(proto, ranges, verdict, line))  # type: ignore[arg-type]
            elif chain == "INPUT" and verdict == "drop" and _catch_all(words):
                default_drop = True
    return InputFilter("iptables-save", tuple(rules), default_drop)


def _catch_all(words: list[str]) -> bool:
    """`-A INPUT -j DROP` (optionally with a comment or --reject-with): matches everything."""
    rest = list(words[2:])
    for option in ("--comment", "--reject-with", "-j"):
        if option in rest[:-1]:
            i = rest.index(option)
            del rest[i:i + 2]
    return all(w in ("-m", "comment") for w in rest)


_NFT_PORTS = re.compile(r"\b(tcp|udp|th) dport (\{[^}]*\}|[0-9]{1,5}(?:-[0-9]{1,5})?)")
_NFT_VERDICT = re.compile(r"\b(accept|drop|reject)\b")


def parse_nft_ruleset(text: str) -> InputFilter:
    """`nft list ruleset`: base chains hooked on input (their policy and a final catch-all
    drop/reject) and every dport rule outside output/forward chains."""
    rules, default_drop = [], False
    hook: str | None = None
    for raw in text[:TEXT_CHARS_MAX].splitlines():
        line = raw.strip()
        if line.startswith(("table ", "set ", "map ", "flowtable ")):
            hook = None  # not a chain: its lines are no rules
            continue
        if line.startswith("chain "):
            hook = ""  # a regular chain until a "type ... hook" line says otherwise
            continue
        m = re.search(r"\bhook (\w+)", line)
        if line.startswith("type ") and m is not None:
            hook = m.group(1)
            if hook == "input" and re.search(r"policy (drop|reject)", line):
                default_drop = True
            continue
        if hook is None or hook in ("output", "forward", "postrouting", "prerouting") or line in ("}", ""):
            continue
        verdicts = _NFT_VERDICT.findall(line)
        ports = _NFT_PORTS.search(line)
        if ports is not None and verdicts and "!=" not in line:
            ranges = _port_ranges(ports.group(2))
            if ranges:
                proto = "any" if ports.group(1) == "th" else ports.group(1)
                rules.append(PortRule(proto, ranges, _VERDICTS[verdicts[-1]], line))  # type: ignore[arg-type]
        elif hook == "input" and re.fullmatch(r"(counter( packets \d+ bytes \d+)? )?(drop|reject( with .*)?)", line):
            default_drop = True
    return InputFilter("nft", tuple(rules), default_drop)


def port_verdict(f: InputFilter, protocol: str, port: int) -> Literal["accept", "drop", "default-drop", "open"]:
    """The first rule that matches the port decides (rules are read in order, as the kernel
    does within a chain); with none, the default."""
    for rule in f.rules:
        if rule.protocol in (protocol, "any") and any(lo <= port <= hi for lo, hi in rule.ports):
            return rule.verdict
    return "default-drop" if f.default_drop else "open"


def check_firewall_linux(sources: Sequence[tuple[str, Output]], ports: Sequence[tuple[str, int, str]], *,
                         root: bool) -> Check:
    """``sources``: ("nft" | "iptables-save", output); ``ports``: (protocol, port, what for)."""
    if all(out.missing for _, out in sources):
        return skipped("firewall", "neither nft nor iptables-save is installed, so there are no packet filter rules to read")
    filters = []
    errors = []
    for name, out in sources:
        if out.text is not None:
            filters.append(parse_nft_ruleset(out.text) if name == "nft" else parse_iptables_save(out.text))
        elif not out.missing:
            errors.append(f"{name}: {out.error}")
    if not filters:
        return fold("firewall", [Finding("skip", f"cannot read the packet filter rules ({'; '.join(errors)})",
                                         None if root else "reading them needs root: run `sudo p2pmesh doctor`")])
    findings = []
    for proto, port, what in ports:
        verdicts = {f.source: port_verdict(f, proto, port) for f in filters}
        droppers = " and ".join(src for src, v in verdicts.items() if v == "drop")
        allow = (f"allow {port}/{proto}, e.g. `sudo nft add rule inet filter input {proto} dport {port} accept`, "
                 f"`sudo iptables -I INPUT -p {proto} --dport {port} -j ACCEPT` or `sudo ufw allow {port}/{proto}`")
        if droppers:
            findings.append(Finding("fail", f"a rule in {droppers} drops {port}/{proto} ({what})", allow))
        elif "default-drop" in verdicts.values() and "accept" not in verdicts.values():
            findings.append(Finding("warn", f"incoming {port}/{proto} ({what}) falls through to a drop policy", allow))
        else:
            findings.append(Finding("ok", f"{port}/{proto} ({what}) is not dropped"))
    return fold("firewall", findings, [f"read: {', '.join(f.source for f in filters)}", *errors])


