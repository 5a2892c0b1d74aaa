"""`p2pmesh doctor`'s link checks (pure): Thunderbolt ports and cables, the cables' IPv4
addresses, bridges over them (macOS's Thunderbolt Bridge) and RDMA, judged from the raw
outputs the driver gathered (MacFacts on a Mac, LinuxFacts on Linux). The framework they
report in (Output, Finding, Check, fold) is platform/doctor.py.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from p2pmesh.core.addressing import bridge_warnings, parse_ifconfig_bridge_members
from p2pmesh.core.messages import PortInfo
from p2pmesh.platform.doctor import ADDRESS_FIX, Check, Finding, NoFacts, Output, fold, guard, need, parse_switch, skipped
from p2pmesh.platform.linux_links import linux_ports, macos_ports, parse_ifconfig, parse_ibv_devices
from p2pmesh.platform.thunderbolt import CaptureError, TbPort, local_ports, parse_networksetup, parse_system_profiler

RDMA_MACOS = (26, 2)  # TN3205: RDMA over Thunderbolt starts with macOS 26.2
SLOW_LINK_GBPS = 40.0
TB5_GBPS = 80.0
RECOVERY_FIX = ("RDMA can only be enabled from Recovery: shut the Mac down, hold the power button until the startup "
                "options appear, choose Options, open Utilities > Terminal, run `rdma_ctl enable`, then restart. "
                "Do it on every Mac of the ring")


@dataclass(frozen=True, slots=True)
class MacFacts:
    """The raw outputs every link check on a Mac reads (each parsed where it is needed)."""

    system_profiler: Output
    networksetup: Output
    ifconfig: Output
    ibv_devices: Output
    rdma_ctl: Output
    os_version: Output


@dataclass(frozen=True, slots=True)
class LinuxFacts:
    """A sysfs snapshot (platform/linux_links.py's format), `ip -j -4 addr show`, and bridges."""

    sysfs: Mapping[str, str] | None
    ip_addr: Output
    thunderbolt_bus: bool
    bridges: Mapping[str, Sequence[str]] | None
    sysfs_error: str | None = None
    bridges_error: str | None = None


LinkFacts = MacFacts | LinuxFacts


def _gbps(value: float | None) -> str:
    return "unknown speed" if value is None else f"{value:g} Gb/s"


# ---------------------------------------------------------------------------------------
# Thunderbolt ports and cables


def check_thunderbolt(facts: LinkFacts) -> Check:
    """Which ports exist, what is cabled to them, whether each Mac-to-Mac cable has an
    interface and a sane speed."""
    if isinstance(facts, LinuxFacts):
        return guard("thunderbolt", _thunderbolt_linux, facts)
    return guard("thunderbolt", _thunderbolt_macos, facts)


def _receptacles(facts: MacFacts) -> tuple[list[TbPort], dict[str, str | None]]:
    """The receptacles, and the enX macOS made for each (None: no "Thunderbolt N" port)."""
    sp = need(facts.system_profiler, "system_profiler SPThunderboltDataType -json")
    ns = need(facts.networksetup, "networksetup -listallhardwareports")
    return parse_system_profiler(sp), {lp.port: lp.interface for lp in local_ports(sp, ns)}


def _describe(p: TbPort, interface: str | None) -> str:
    where = f"port {p.port} ({interface or 'no interface'})"
    if not p.connected:
        return f"{where}: empty, {_gbps(p.max_speed_gbps)} capable"
    model = p.peer_model if p.peer_model != p.peer_name else None  # docks repeat their name as the model
    what = " ".join(x for x in ("a Mac:" if p.peer_kind == "mac" else "a device:", p.peer_name, model) if x)
    return f"{where}: {what}, at {_gbps(p.speed_gbps)}"


def _thunderbolt_macos(facts: MacFacts) -> Check:
    ports, iface = _receptacles(facts)
    details = [_describe(p, iface.get(p.port)) for p in ports]
    if not ports:
        return fold("thunderbolt", [Finding("warn", "system_profiler lists no Thunderbolt port on this Mac")], details)
    macs = [p for p in ports if p.connected and p.peer_kind == "mac"]
    findings: list[Finding] = []
    if not macs:
        others = [f"port {p.port} has {p.peer_name or 'a device'}" for p in ports if p.connected]
        findings.append(Finding(
            "warn", "no Mac is cabled directly to this one" + (f" ({'; '.join(others)}, not a Mac)" if others else ""),
            "connect the Macs port to port with Thunderbolt cables; p2pmesh pairs only direct cables, not "
            "ones through a dock or hub (a single Mac still works on its own)"))
    for p in macs:
        name = iface.get(p.port)
        if name is None:
            findings.append(Finding(
                "warn", f"port {p.port} is cabled to a Mac but macOS made no network interface for it",
                f"run `sudo networksetup -detectnewhardware`, then look for a 'Thunderbolt {p.port}' service in "
                "System Settings > Network"))
        if p.speed_gbps is not None and p.speed_gbps < SLOW_LINK_GBPS:
            findings.append(Finding(
                "warn", f"port {p.port} reaches its Mac at only {p.speed_gbps:g} Gb/s",
                "use a Thunderbolt 4 or 5 cable (40 or 80 Gb/s); USB-C charging cables and long passive cables "
                "fall back to 20 Gb/s or less"))
        findings.append(Finding("ok", f"port {p.port} ({name or '?'}) to {p.peer_name or 'a Mac'} at {_gbps(p.speed_gbps)}"))
    return fold("thunderbolt", findings, details)


def _thunderbolt_linux(facts: LinuxFacts) -> Check:
    tb = [p for p in _ports(facts) if p.kind == "thunderbolt"]
    details = [f"{p.interface}: {'up' if p.up else 'down'}, peer {p.peer_domain_uuid or 'none'}, {_gbps(p.gbps)}" for p in tb]
    if not tb:
        if not facts.thunderbolt_bus:
            return skipped("thunderbolt", "no Thunderbolt bus on this machine (/sys/bus/thunderbolt is missing)")
        return fold("thunderbolt", [Finding(
            "warn", "a Thunderbolt bus exists but there is no thunderbolt-net interface",
            "load the driver with `sudo modprobe thunderbolt-net`, then cable a Mac (Linux names the interface "
            "thunderbolt0)")])
    cabled = [p for p in tb if p.up and p.peer_domain_uuid]
    if not cabled:
        return fold("thunderbolt", [Finding("warn", f"no host is cabled to {', '.join(p.interface for p in tb)}",
                                            "connect the hosts port to port with Thunderbolt cables")], details)
    return fold("thunderbolt", [Finding("ok", f"{p.interface} cabled to a host at {_gbps(p.gbps)}") for p in cabled], details)


def _ports(facts: LinkFacts) -> list[PortInfo]:
    """This machine's ports, as the agent's link watcher computes them."""
    if isinstance(facts, LinuxFacts):
        if facts.sysfs is None:
            raise NoFacts(Finding("fail", f"cannot read sysfs: {facts.sysfs_error}"))
        return linux_ports(dict(facts.sysfs), need(facts.ip_addr, "ip -j -4 addr show"))
    return macos_ports(need(facts.system_profiler, "system_profiler SPThunderboltDataType -json"),
                       need(facts.networksetup, "networksetup -listallhardwareports"),
                       need(facts.ifconfig, "ifconfig"), facts.ibv_devices.text)


def _cabled(ports: Iterable[PortInfo]) -> list[PortInfo]:
    """Thunderbolt ports with a carrier and a peer host's domain UUID: the ring's cables."""
    return [p for p in ports if p.kind == "thunderbolt" and p.up and p.peer_domain_uuid]


def usable_interfaces(facts: LinkFacts) -> list[str]:
    """The ports that are up (what `p2pmesh doctor` probes mDNS on by default); [] when the
    facts cannot be read, so the driver falls back to every interface with an address."""
    try:
        return [p.interface for p in _ports(facts) if p.up]
    except (NoFacts, CaptureError):
        return []


# ---------------------------------------------------------------------------------------
# IPv4 addresses on the cables


def check_addresses(facts: LinkFacts) -> Check:
    """Every cable to another host needs an IPv4 address of its own (MLX's ring dials IPv4
    literals and JACCL needs one for its GID), in a subnet no other cable shares."""
    return guard("addresses", _addresses, facts)


def _addresses(facts: LinkFacts) -> Check:
    cabled = _cabled(_ports(facts))
    if not cabled:
        return skipped("addresses", "no Thunderbolt cable to another host, so no address to check")
    # A bridged port's address sits on the bridge: say so, the bridge check has that fix.
    bridged = ({m: b for b, ms in parse_ifconfig_bridge_members(facts.ifconfig.text or "").items() for m in ms}
               if isinstance(facts, MacFacts) else {m: b for b, ms in (facts.bridges or {}).items() for m in ms})
    findings: list[Finding] = []
    details = [f"{p.interface}: {', '.join(p.ipv4) or 'no IPv4'}" for p in cabled]
    for p in cabled:
        if not p.ipv4:
            why = f" (it is a member of {bridged[p.interface]}: see the bridge check)" if p.interface in bridged else ""
            findings.append(Finding("warn", f"{p.interface} (cabled to another host) has no IPv4 address{why}", ADDRESS_FIX))
    nets = [(p.interface, ipaddress.IPv4Interface(a).network) for p in cabled for a in p.ipv4]
    for i, (a, na) in enumerate(nets):
        for b, nb in nets[i + 1:]:
            if a != b and na.overlaps(nb):
                findings.append(Finding(
                    "warn", f"{a} and {b} share the subnet {max(na, nb, key=lambda n: n.num_addresses)}: traffic for "
                    "one cable's peer may leave through the other cable",
                    "give each cable its own /30: " + ADDRESS_FIX))
    if not findings:
        findings.append(Finding("ok", "every cable has its own IPv4 subnet"))
    return fold("addresses", findings, details)


# ---------------------------------------------------------------------------------------
# Bridges (macOS's Thunderbolt Bridge)


def check_bridge(facts: LinkFacts) -> Check:
    """A bridge holding cabled Thunderbolt ports: two of them make a loop with no loop
    protection (fail); one keeps the cable's address on the bridge, where MLX cannot use it."""
    return guard("bridge", _bridge_linux if isinstance(facts, LinuxFacts) else _bridge_macos, facts)


def _bridge_macos(facts: MacFacts) -> Check:
    text = need(facts.ifconfig, "ifconfig")
    bridges = parse_ifconfig_bridge_members(text)
    status = {name: e.status for name, e in parse_ifconfig(text).items()}
    ns = need(facts.networksetup, "networksetup -listallhardwareports")
    labels = {h.device: h.name for h in parse_networksetup(ns) if h.device in bridges}
    tb = {p.interface: p for p in _ports(facts) if p.kind == "thunderbolt"}
    if not tb:
        return skipped("bridge", "no Thunderbolt port with a network interface, so no bridge to check")
    cabled = {p.interface for p in _cabled(tb.values())}
    findings: list[Finding] = []
    details = []
    for bridge, members in sorted(bridges.items()):
        label = f"{bridge} ({labels[bridge]})" if bridge in labels else bridge
        ours = sorted(set(members) & set(tb))
        if ours:
            details.append(f"{label}, {status.get(bridge) or 'status unknown'}: members {', '.join(members)}")
        hit = sorted(set(ours) & cabled)
        fix = ("open System Settings > Network > Thunderbolt Bridge and make the service inactive (or remove "
               f"{', '.join(hit)} from it); until the next reboot instead: "
               + "; ".join(f"`sudo ifconfig {bridge} deletem {i}`" for i in hit) + ". p2pmesh never changes this itself")
        if len(hit) >= 2:
            findings.append(Finding("fail", f"{label} bridges the cabled ports {', '.join(hit)}: with the other Macs "
                                    "bridged too, the ring's cables form a loop that can flood every network", fix))
            details += bridge_warnings({bridge: members}, hit, platform="darwin")
        elif hit:
            findings.append(Finding("warn", f"{hit[0]} (cabled to a Mac) is a member of {label}: its address lives on "
                                    "the bridge, where MLX's ring cannot use it, and JACCL fails while it is active", fix))
        elif ours:
            details.append(f"{label} holds no cabled port yet; once two cabled ports share it, it forms a loop")
    if not findings:
        findings.append(Finding("ok", "no bridge holds a cabled Thunderbolt port"))
    return fold("bridge", findings, details)


def _bridge_linux(facts: LinuxFacts) -> Check:
    if facts.bridges is None:
        raise NoFacts(Finding("skip", f"cannot list bridges: {facts.bridges_error}"))
    tb = [p for p in _ports(facts) if p.kind == "thunderbolt"]
    if not tb:
        return skipped("bridge", "no Thunderbolt interface, so no bridge to check")
    cabled = {p.interface for p in _cabled(tb)}
    findings = []
    for bridge, members in sorted(facts.bridges.items()):
        for warning in bridge_warnings({bridge: list(members)}, [p.interface for p in tb], platform="linux"):
            hit = sorted(cabled & set(members))
            fix = "; ".join(f"`sudo ip link set dev {i} nomaster`" for i in sorted(set(members) & {p.interface for p in tb}))
            findings.append(Finding("fail" if len(hit) >= 2 else "warn", warning.split(". p2pmesh")[0], fix))
    if not findings:
        findings.append(Finding("ok", "no bridge holds a Thunderbolt interface"))
    return fold("bridge", findings)


# ---------------------------------------------------------------------------------------
# RDMA


def parse_macos_version(text: str) -> tuple[int, ...]:
    """`sw_vers -productVersion` ("26.2", "15.6.1") -> (26, 2). CaptureError otherwise."""
    m = re.fullmatch(r"\s*([0-9]{1,3}(?:\.[0-9]{1,3}){0,2})\s*", text)
    if m is None:
        raise CaptureError(f"sw_vers printed {text.strip()[:40]!r}, not a version number")
    return tuple(int(x) for x in m.group(1).split("."))


def parse_rdma_ctl(text: str) -> bool | None:
    """`rdma_ctl status`: True when it says enabled, False when disabled, None otherwise."""
    return parse_switch(text, "disabled", "enabled")


def check_rdma(facts: LinkFacts) -> Check:
    """RDMA over Thunderbolt (JACCL): macOS 26.2+, Thunderbolt 5, enabled in Recovery, an
    rdma_enX device for every cabled port. Optional (the ring backend runs over TCP), so at
    worst a warning."""
    if isinstance(facts, LinuxFacts):
        return skipped("rdma", "RDMA over Thunderbolt (JACCL) is a macOS feature; Linux hosts use MLX's ring backend over TCP")
    return guard("rdma", _rdma, facts)


def _rdma(facts: MacFacts) -> Check:
    if facts.os_version.text is not None:
        version = parse_macos_version(facts.os_version.text)
        if version < RDMA_MACOS:
            return fold("rdma", [Finding("skip", f"RDMA needs macOS 26.2 or later; this Mac runs {'.'.join(map(str, version))} "
                                         "(the ring backend over TCP works meanwhile)",
                                         "update every Mac of the ring to the same macOS 26.2+ build to use RDMA")])
    try:
        ports, _ = _receptacles(facts)
    except (NoFacts, CaptureError):
        ports = []  # the thunderbolt check reports it; RDMA can still be judged without speeds
    speeds = [s for p in ports for s in (p.max_speed_gbps, p.speed_gbps) if s is not None]
    if speeds and max(speeds) < TB5_GBPS:
        return skipped("rdma", f"RDMA needs Thunderbolt 5; this Mac's ports reach {max(speeds):g} Gb/s at most")
    enabled = parse_rdma_ctl(facts.rdma_ctl.text) if facts.rdma_ctl.text is not None else None
    devices = parse_ibv_devices(facts.ibv_devices.text) if facts.ibv_devices.text is not None else None
    if enabled is False:
        return fold("rdma", [Finding("warn", "RDMA is disabled (rdma_ctl status)", RECOVERY_FIX)])
    if devices is None:
        if facts.rdma_ctl.missing and facts.ibv_devices.missing:
            return skipped("rdma", "neither rdma_ctl nor ibv_devices is installed (both come with macOS 26.2)")
        return fold("rdma", [Finding("warn", f"cannot list RDMA devices: {facts.ibv_devices.error}",
                                     "run `ibv_devices` yourself to see the error")])
    if not devices:
        return fold("rdma", [Finding("warn", "no RDMA device: ibv_devices lists no rdma_enX",
                                     "if you ran `rdma_ctl enable` in Recovery, restart once more; otherwise: " + RECOVERY_FIX)])
    findings = []
    try:
        cabled = [p.interface for p in _cabled(_ports(facts))]
    except (NoFacts, CaptureError):
        cabled = []
    for iface in cabled:
        if iface not in devices:
            findings.append(Finding("warn", f"{iface} is cabled to a Mac but has no RDMA device (rdma_{iface})",
                                    "both ends need Thunderbolt 5 ports and RDMA enabled: run `p2pmesh doctor` on the other Mac"))
    findings.append(Finding("ok", "RDMA devices: " + ", ".join(f"rdma_{d}" for d in sorted(devices))))
    return fold("rdma", findings)
