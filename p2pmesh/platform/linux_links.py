"""This host's network ports as PortInfo values, from captured text (pure: text in, values out).

Linux: ``linux_ports(snapshot, ip_json)`` reads a *snapshot* of sysfs plus the output of
``ip -j -4 addr show``. macOS: ``macos_ports(...)`` joins the system_profiler and
networksetup captures (platform/thunderbolt.py) with ``ifconfig`` and ``ibv_devices`` output.
The driver (drivers/linkwatch.py) runs the commands and reads the files; nothing here
touches the world. Every malformed input raises ``CaptureError``, never another exception.

The sysfs snapshot
------------------
A ``dict[str, str]``. Keys are paths relative to the sysfs root (no leading "/", no "." or
".." parts); a key names one of three things:

- ``"class/net/eth0/operstate"``: a regular file; the value is its content as read
  (trailing newline included or not, whitespace around values is ignored);
- ``"class/net/eth0/device@"``: a symlink (``@`` as ``ls -F`` marks one); the value is the
  link's *resolved* target relative to the sysfs root, e.g.
  ``"devices/pci0000:00/0000:00:0d.2/domain0/0-0/0-1/0-1.0"``. Only its last components
  are used, so an absolute path is fine too;
- ``"class/net/wlan0/wireless/"``: a directory that exists (value ignored, "" by
  convention). The driver writes ``"class/net/<name>/"`` for every interface, so an
  interface whose files could not be read still shows up.

Files read: ``class/net/<if>/{operstate,carrier,speed,ifalias,type}``, links
``class/net/<if>/{device,phy80211}@``, directory ``class/net/<if>/wireless/``, and
``bus/thunderbolt/devices/<N-R>/{unique_id,rx_speed,rx_lanes,tx_speed,tx_lanes}`` for host
routers and XDomains. Other keys are ignored. A file the kernel refuses to read (``carrier``
of an interface that is down answers EINVAL) is simply absent.

How each interface is classified (first rule that applies):

1. ``lo``, and any interface whose ``type`` is not 1 (ARPHRD_ETHER), is skipped.
2. **Bench marker**: ``ifalias`` reads ``p2pmesh:thunderbolt domain=<d> peer=<p>
   gbps=<g>`` (see ``bench_alias``): a Thunderbolt cable end, taken verbatim. This is how
   the multi-host test bench turns a veth pair into a cable. An alias starting with
   ``p2pmesh:`` that does not parse is an error, not an ordinary alias.
3. **thunderbolt-net**: the ``device`` link resolves to an XDomain *service*
   ``<N>-<route>.<id>`` whose parent is the XDomain ``<N>-<route>`` under ``domain<N>``.
   (Linux admin-guide/thunderbolt.rst, "Networking over Thunderbolt cable": the
   thunderbolt-net driver creates one interface per link, ``thunderbolt0``...; it binds to
   the XDomain's "network" service, Documentation/ABI/testing/sysfs-bus-thunderbolt
   ``<xdomain>.<service>/key``.) Our domain UUID is the host router's
   ``devices/<N>-0/unique_id`` (drivers/thunderbolt/tb.c allocates every XDomain with
   ``tb->root_switch->uuid`` as the local UUID); the peer's is the XDomain's ``unique_id``
   (xdomain.c prints ``xd->remote_uuid``). The kernel prints UUIDs in lower case and macOS
   in upper case, so both are upper-cased: a Linux host and a Mac then agree on spelling.
   Speed: the XDomain's ``rx_speed``/``tx_speed`` ("20.0 Gb/s", per lane) times
   ``rx_lanes``/``tx_lanes``; the slower direction wins.
4. Any other interface without a ``device`` link is virtual (bridge, docker, veth, tun,
   bond...) and skipped: it is not a cable.
5. Wi-Fi if it has a ``phy80211`` link or a ``wireless/`` directory, else Ethernet; speed
   from ``speed`` in Mb/s (-1 or 0 means unknown).

Carrier: ``carrier`` == "1" when readable, otherwise ``operstate`` == "up". RDMA is always
False on Linux: nothing in p2pmesh uses RDMA from a Linux host (JACCL is a macOS stack).
"""
from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from p2pmesh.core.messages import PortInfo
from p2pmesh.platform.thunderbolt import CaptureError, local_ports, parse_networksetup

# Bounds: a real host has tens of interfaces and a few hundred sysfs files; anything far
# above is hostile or broken, and refusing it keeps time and memory bounded.
SNAPSHOT_KEYS_MAX = 16384
SYSFS_VALUE_MAX = 4096  # sysfs attributes are at most one page
KEY_CHARS_MAX = 512
INTERFACES_MAX = 512
IP_JSON_CHARS_MAX = 2_000_000
ADDRS_PER_IF_MAX = 256
IPV4_PUBLISHED_MAX = 16  # validate.ports_problem accepts at most 16 addresses per port
IFCONFIG_CHARS_MAX = 2_000_000
IBV_CHARS_MAX = 200_000
GBPS_MAX = 1e6  # validate.ports_problem's bound: 0 < gbps < 1e6
LANE_GBPS_MAX = 1000.0
SPEED_MBPS_MAX = 10_000_000

MARKER_PREFIX = "p2pmesh:"
_MARKER = re.compile(r"p2pmesh:thunderbolt domain=(\S+) peer=(\S+) gbps=(\S+)")
_LAN_MARKER = re.compile(r"p2pmesh:ethernet gbps=(\S+)")
# A bench UUID is a token, not necessarily RFC 4122: the bench owns both ends.
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# Linux dev_valid_name(): 1..15 chars, no "/", ":" or whitespace, not "." or "..".
_IFNAME = re.compile(r"[^/:\s]{1,15}")
_SERVICE = re.compile(r"([0-9]+)-([0-9a-f]+)\.([0-9]+)")
_TB_SPEED = re.compile(r"([0-9]+(?:\.[0-9]+)?) Gb/s")
_OPERSTATES = {"unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up"}
ARPHRD_ETHER = "1"


# ---------------------------------------------------------------------------------------
# bench marker


def bench_alias(domain: str, peer: str, gbps: float) -> str:
    """The ifalias text that marks an interface as a Thunderbolt cable end on the test bench.

    ``domain`` is this host's UUID, ``peer`` the other end's; both are tokens of letters,
    digits and ``._:-`` (a UUID fits) and are published verbatim. Raises ValueError on a
    value the parser would refuse, so the bench cannot write a marker we cannot read.
    """
    for label, token in (("domain", domain), ("peer", peer)):
        if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
            raise ValueError(f"bench {label} {token!r} must match {_TOKEN.pattern}")
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not _sane_gbps(float(gbps)):
        raise ValueError(f"bench gbps {gbps!r} must be a number in (0, {GBPS_MAX:g})")
    return f"{MARKER_PREFIX}thunderbolt domain={domain} peer={peer} gbps={float(gbps)!r}"


@dataclass(frozen=True, slots=True)
class BenchMarker:
    """What a bench marker says: the port's kind, this end's UUID and the other end's
    (Thunderbolt only), the nominal speed."""

    domain: str | None
    peer: str | None
    gbps: float
    kind: str = "thunderbolt"


def bench_lan_alias(gbps: float) -> str:
    """The ifalias text that marks a bench veth as an Ethernet port (the hosts' shared LAN
    switch: veths are virtual, so without a marker they are skipped like any bridge)."""
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not _sane_gbps(float(gbps)):
        raise ValueError(f"bench gbps {gbps!r} must be a number in (0, {GBPS_MAX:g})")
    return f"{MARKER_PREFIX}ethernet gbps={float(gbps)!r}"


def parse_bench_alias(alias: str) -> BenchMarker | None:
    """The marker in an ifalias, None for an ordinary alias; CaptureError if it starts with
    ``p2pmesh:`` but does not parse (a typo there must not silently lose a cable)."""
    text = alias.strip()
    if not text.startswith(MARKER_PREFIX):
        return None
    lan = _LAN_MARKER.fullmatch(text)
    if lan is not None:
        gbps = _float(lan.group(1), "marker gbps")
        if not _sane_gbps(gbps):
            raise CaptureError(f"marker gbps {lan.group(1)!r} is out of range")
        return BenchMarker(None, None, gbps, "ethernet")
    m = _MARKER.fullmatch(text)
    if m is None:
        raise CaptureError(f"ifalias {text[:80]!r} starts with {MARKER_PREFIX!r} but is not a p2pmesh marker")
    domain, peer, gbps_text = m.groups()
    for label, token in (("domain", domain), ("peer", peer)):
        if _TOKEN.fullmatch(token) is None:
            raise CaptureError(f"marker {label} {token[:80]!r} is not a valid token")
    gbps = _float(gbps_text, "marker gbps")
    if not _sane_gbps(gbps):
        raise CaptureError(f"marker gbps {gbps_text!r} is out of range")
    return BenchMarker(domain, peer, gbps)


# ---------------------------------------------------------------------------------------
# Linux


@dataclass(frozen=True, slots=True)
class _Sysfs:
    net: dict[str, dict[str, str]]  # interface -> attribute ("operstate", "device@", "wireless/") -> value
    tb: dict[str, dict[str, str]]  # thunderbolt device ("0-0", "0-1") -> attribute -> value


def linux_ports(snapshot: dict[str, str], ip_json: str) -> list[PortInfo]:
    """Every cable-capable port of this Linux host (see the module docstring for the rules),
    sorted by interface name."""
    fs = _index(snapshot)
    addrs = parse_ip_addr_json(ip_json)
    ports = []
    for name in sorted(fs.net, key=_natural):
        port = _linux_port(name, fs, addrs.get(name, ()))
        if port is not None:
            ports.append(port)
    return ports


def _index(snapshot: Any) -> _Sysfs:
    if not isinstance(snapshot, dict):
        raise CaptureError(f"sysfs snapshot must be a dict, not {type(snapshot).__name__}")
    if len(snapshot) > SNAPSHOT_KEYS_MAX:
        raise CaptureError(f"sysfs snapshot has {len(snapshot)} entries (at most {SNAPSHOT_KEYS_MAX})")
    net: dict[str, dict[str, str]] = {}
    tb: dict[str, dict[str, str]] = {}
    for key, value in snapshot.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CaptureError(f"sysfs snapshot entries must map str to str, not {type(key).__name__} to {type(value).__name__}")
        if len(key) > KEY_CHARS_MAX or len(value) > SYSFS_VALUE_MAX:
            raise CaptureError(f"sysfs snapshot entry {key[:80]!r} is too long")
        is_dir = key.endswith("/")
        parts = key[:-1].split("/") if is_dir else key.split("/")
        if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CaptureError(f"sysfs snapshot key {key[:80]!r} is not a clean relative path")
        if parts[:2] == ["class", "net"] and len(parts) >= 3:
            name = parts[2]
            if _IFNAME.fullmatch(name) is None:
                raise CaptureError(f"interface name {name[:40]!r} is not a valid Linux interface name")
            attrs = net.setdefault(name, {})
            if len(net) > INTERFACES_MAX:
                raise CaptureError(f"sysfs snapshot has more than {INTERFACES_MAX} interfaces")
            rest = parts[3:]
            if rest and rest[0] == "wireless":
                attrs["wireless/"] = ""
            elif len(rest) == 1:
                attrs[rest[0] + ("/" if is_dir else "")] = value
        elif parts[:3] == ["bus", "thunderbolt", "devices"] and len(parts) == 5 and not is_dir:
            tb.setdefault(parts[3], {})[parts[4]] = value
    return _Sysfs(net, tb)


def _linux_port(name: str, fs: _Sysfs, ipv4: tuple[str, ...]) -> PortInfo | None:
    attrs = fs.net[name]
    if name == "lo":
        return None
    up = _carrier(name, attrs)
    marker = parse_bench_alias(attrs["ifalias"]) if "ifalias" in attrs else None
    if marker is not None:
        return PortInfo(name, marker.kind, marker.domain, marker.peer, up, marker.gbps, ipv4, False)
    kind_type = attrs.get("type")
    if kind_type is not None and kind_type.strip() != ARPHRD_ETHER:
        return None  # loopback, tunnels, InfiniBand, CAN...: never a cable we pair
    device = attrs.get("device@")
    if device is None:
        return None  # virtual: bridge, docker, veth, tun...
    found = _xdomain_of(device)
    if found is not None:
        domain_no, xdomain = found
        host = fs.tb.get(f"{domain_no}-0", {})
        peer = fs.tb.get(xdomain, {})
        return PortInfo(
            name,
            "thunderbolt",
            _uuid(host.get("unique_id"), f"host router {domain_no}-0"),
            _uuid(peer.get("unique_id"), f"XDomain {xdomain}"),
            up,
            _xdomain_gbps(xdomain, peer),
            ipv4,
            False,
        )
    wifi = "phy80211@" in attrs or "wireless/" in attrs
    return PortInfo(name, "wifi" if wifi else "ethernet", None, None, up, _net_gbps(name, attrs.get("speed")), ipv4, False)


def _carrier(name: str, attrs: dict[str, str]) -> bool:
    carrier = attrs.get("carrier")
    if carrier is not None:
        value = carrier.strip()
        if value not in ("0", "1"):
            raise CaptureError(f"{name}: carrier {value[:20]!r} is neither 0 nor 1")
        return value == "1"
    operstate = attrs.get("operstate")
    if operstate is None:
        return False
    state = operstate.strip()
    if state not in _OPERSTATES:
        raise CaptureError(f"{name}: unknown operstate {state[:20]!r}")
    return state == "up"


def _xdomain_of(device_target: str) -> tuple[str, str] | None:
    """(N, "N-R") when the link target is an XDomain service ``.../domainN/.../N-R/N-R.S``."""
    parts = [p for p in device_target.strip().split("/") if p]
    if len(parts) < 3:
        return None
    m = _SERVICE.fullmatch(parts[-1])
    if m is None:
        return None
    xdomain = f"{m.group(1)}-{m.group(2)}"
    if parts[-2] != xdomain or f"domain{m.group(1)}" not in parts[:-2] or m.group(2) == "0":
        return None
    return m.group(1), xdomain


def _uuid(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if _UUID.fullmatch(text) is None:
        raise CaptureError(f"{where} unique_id {text[:60]!r} is not a UUID")
    return text.upper()


def _xdomain_gbps(xdomain: str, attrs: dict[str, str]) -> float | None:
    rates = []
    for direction in ("rx", "tx"):
        speed_text = attrs.get(f"{direction}_speed")
        if speed_text is None:
            continue
        m = _TB_SPEED.fullmatch(speed_text.strip())
        if m is None:
            raise CaptureError(f"XDomain {xdomain} {direction}_speed {speed_text.strip()[:30]!r} is not 'N Gb/s'")
        per_lane = _float(m.group(1), f"XDomain {xdomain} {direction}_speed")
        if not 0 < per_lane <= LANE_GBPS_MAX:
            raise CaptureError(f"XDomain {xdomain} {direction}_speed {per_lane} Gb/s is out of range")
        lanes_text = attrs.get(f"{direction}_lanes")
        lanes = 1
        if lanes_text is not None:
            if lanes_text.strip() not in ("1", "2", "3", "4"):
                raise CaptureError(f"XDomain {xdomain} {direction}_lanes {lanes_text.strip()[:10]!r} is not 1-4")
            lanes = int(lanes_text.strip())
        rates.append(per_lane * lanes)
    return min(rates) if rates else None


def _net_gbps(name: str, speed: str | None) -> float | None:
    if speed is None:
        return None
    text = speed.strip()
    if re.fullmatch(r"-?[0-9]{1,12}", text) is None:
        raise CaptureError(f"{name}: speed {text[:20]!r} is not an integer")
    mbps = int(text)
    if mbps in (-1, 0):
        return None  # SPEED_UNKNOWN, or no link
    if not 0 < mbps <= SPEED_MBPS_MAX:
        raise CaptureError(f"{name}: speed {mbps} Mb/s is out of range")
    return mbps / 1000.0


def parse_ip_addr_json(text: str) -> dict[str, tuple[str, ...]]:
    """``ip -j -4 addr show`` -> interface name -> ("a.b.c.d/prefix", ...), in ip's order.

    Entries may be ``{}`` (some iproute2 versions print one per interface the ``-4`` filter
    dropped); non-IPv4 addr_info entries are skipped. At most 16 addresses are kept per
    interface, the number the cluster accepts per port.
    """
    if not isinstance(text, str):
        raise CaptureError(f"ip -j output must be text, not {type(text).__name__}")
    if len(text) > IP_JSON_CHARS_MAX:
        raise CaptureError(f"ip -j output is {len(text)} characters (at most {IP_JSON_CHARS_MAX})")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CaptureError(f"ip -j output is not valid JSON: {str(e)[:100]}") from None
    if not isinstance(doc, list):
        raise CaptureError(f"ip -j output must be a JSON list, not {type(doc).__name__}")
    if len(doc) > INTERFACES_MAX * 2:
        raise CaptureError(f"ip -j output lists {len(doc)} interfaces (at most {INTERFACES_MAX * 2})")
    out: dict[str, tuple[str, ...]] = {}
    for i, entry in enumerate(doc):
        if not isinstance(entry, dict):
            raise CaptureError(f"ip -j entry {i} must be an object")
        if not entry:
            continue
        name = entry.get("ifname")
        if not isinstance(name, str) or _IFNAME.fullmatch(name) is None:
            raise CaptureError(f"ip -j entry {i} has no valid ifname")
        infos = entry.get("addr_info", [])
        if not isinstance(infos, list) or len(infos) > ADDRS_PER_IF_MAX:
            raise CaptureError(f"ip -j entry {name!r}: addr_info must be a list of at most {ADDRS_PER_IF_MAX}")
        found: list[str] = list(out.get(name, ()))
        for info in infos:
            if not isinstance(info, dict):
                raise CaptureError(f"ip -j entry {name!r}: addr_info items must be objects")
            if info.get("family") != "inet":
                continue
            found.append(_cidr(info.get("local"), info.get("prefixlen"), f"ip -j entry {name!r}"))
        out[name] = tuple(dict.fromkeys(found))[:IPV4_PUBLISHED_MAX]
    return out


def _cidr(local: Any, prefix: Any, where: str) -> str:
    if not isinstance(local, str):
        raise CaptureError(f"{where}: inet address must be a string")
    try:
        addr = ipaddress.IPv4Address(local)
    except ValueError:
        raise CaptureError(f"{where}: {local[:40]!r} is not an IPv4 address") from None
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 0 <= prefix <= 32:
        raise CaptureError(f"{where}: prefixlen {str(prefix)[:20]!r} is not 0-32")
    return f"{addr}/{prefix}"


# ---------------------------------------------------------------------------------------
# macOS


@dataclass(frozen=True, slots=True)
class IfconfigEntry:
    """One interface of ``ifconfig`` output, reduced to what a port needs."""

    name: str
    ipv4: tuple[str, ...]  # "a.b.c.d/prefix", in printed order
    status: str | None  # "active" / "inactive"; None when ifconfig prints no status line
    media_gbps: float | None  # from the media line, "(1000baseT <full-duplex>)" -> 1.0


_IFC_HEADER = re.compile(r"([A-Za-z][A-Za-z0-9_.-]{0,31}): flags=[0-9a-fA-F]+<[^>]*>.*")
_IFC_INET = re.compile(
    r"inet ([0-9.]{7,15})(?: --> [0-9.]{7,15})? netmask (0x[0-9a-fA-F]{1,8}|[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3})(?: .*)?"
)
_IFC_STATUS = re.compile(r"status: (\S+)")
# The active medium is the last one on the line: "autoselect (1000baseT <full-duplex>)".
_IFC_MEDIA_SPEED = re.compile(r"([0-9]{1,6})(G?)[bB]ase")
IFCONFIG_INTERFACES_MAX = 1024


def parse_ifconfig(text: str) -> dict[str, IfconfigEntry]:
    """Parse macOS ``ifconfig`` (or ``ifconfig -a``, or ``ifconfig <if>``) output.

    An interface starts at a line ``name: flags=...<...> mtu N`` in column 0; indented lines
    that follow belong to it. Netmasks may be hex (macOS) or dotted; they must be
    contiguous. Lines we do not need (ether, inet6, options, bridge members) are skipped.
    """
    if not isinstance(text, str):
        raise CaptureError(f"ifconfig capture must be text, not {type(text).__name__}")
    if len(text) > IFCONFIG_CHARS_MAX:
        raise CaptureError(f"ifconfig capture is {len(text)} characters (at most {IFCONFIG_CHARS_MAX})")
    if not text.strip():
        raise CaptureError("ifconfig capture is empty")
    entries: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if not raw[0].isspace():
            m = _IFC_HEADER.fullmatch(raw.rstrip())
            if m is None:
                raise CaptureError(f"ifconfig line {lineno} is not an interface header: {raw[:60]!r}")
            name = m.group(1)
            if name in entries:
                raise CaptureError(f"ifconfig lists {name!r} twice")
            if len(entries) >= IFCONFIG_INTERFACES_MAX:
                raise CaptureError(f"ifconfig lists more than {IFCONFIG_INTERFACES_MAX} interfaces")
            current = {"ipv4": [], "status": None, "media_gbps": None}
            entries[name] = current
            continue
        if current is None:
            raise CaptureError(f"ifconfig line {lineno} is indented but follows no interface header")
        line = " ".join(raw.split())  # tabs and runs of spaces vary between macOS versions
        if line.startswith("inet "):
            m = _IFC_INET.fullmatch(line)
            if m is None:
                raise CaptureError(f"ifconfig line {lineno}: unrecognised inet line {line[:60]!r}")
            prefix = _prefix_of(m.group(2), lineno)
            if len(current["ipv4"]) >= ADDRS_PER_IF_MAX:
                raise CaptureError(f"ifconfig line {lineno}: more than {ADDRS_PER_IF_MAX} addresses")
            current["ipv4"].append(_cidr(m.group(1), prefix, f"ifconfig line {lineno}"))
        elif line.startswith("status:"):
            m = _IFC_STATUS.fullmatch(line)
            if m is None or m.group(1) not in ("active", "inactive"):
                raise CaptureError(f"ifconfig line {lineno}: unknown status {line[:40]!r}")
            current["status"] = m.group(1)
        elif line.startswith("media:"):
            speeds = _IFC_MEDIA_SPEED.findall(line)
            if speeds:
                digits, giga = speeds[-1]
                gbps = float(digits) if giga else int(digits) / 1000.0
                current["media_gbps"] = gbps if _sane_gbps(gbps) else None
    if not entries:
        raise CaptureError("ifconfig capture has no interface header")
    return {
        name: IfconfigEntry(name, tuple(dict.fromkeys(e["ipv4"])), e["status"], e["media_gbps"])
        for name, e in entries.items()
    }


def _prefix_of(mask: str, lineno: int) -> int:
    if mask.startswith("0x"):
        value = int(mask, 16)
    else:
        octets = [int(o) for o in mask.split(".")]
        if any(o > 255 for o in octets):
            raise CaptureError(f"ifconfig line {lineno}: netmask {mask!r} is not a netmask")
        value = (octets[0] << 24) | (octets[1] << 16) | (octets[2] << 8) | octets[3]
    prefix = value.bit_count()
    if value != ((1 << 32) - 1) ^ ((1 << (32 - prefix)) - 1):
        raise CaptureError(f"ifconfig line {lineno}: netmask {mask!r} is not contiguous")
    return prefix


_IBV_DEVICE = re.compile(r"rdma_(en[0-9]{1,4})")


def parse_ibv_devices(text: str) -> frozenset[str]:
    """``ibv_devices`` -> the interfaces (``en2``) that have an RDMA device (``rdma_en2``).

    The output is a two-line header ("device  node GUID", dashes) and one line per device;
    with RDMA disabled only the header (or nothing) is printed.
    """
    if not isinstance(text, str):
        raise CaptureError(f"ibv_devices output must be text, not {type(text).__name__}")
    if len(text) > IBV_CHARS_MAX:
        raise CaptureError(f"ibv_devices output is {len(text)} characters (at most {IBV_CHARS_MAX})")
    found: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        if not words or words[0] == "device" or set(words[0]) == {"-"}:
            continue
        if len(words) > 2 or re.fullmatch(r"[A-Za-z0-9_]{1,64}", words[0]) is None:
            raise CaptureError(f"ibv_devices line {lineno} is not 'device [GUID]': {raw[:60]!r}")
        m = _IBV_DEVICE.fullmatch(words[0])
        if m is not None:
            found.add(m.group(1))
    return frozenset(found)


_SKIPPED_HW_PORTS = re.compile(r"Thunderbolt Bridge|Bluetooth PAN|iPhone USB.*|iPad USB.*|Thunderbolt [0-9]+")
_WIFI_HW_PORTS = ("Wi-Fi", "AirPort")
_ETHERNET_HW_PORT = re.compile(r".*(Ethernet|LAN).*", re.IGNORECASE)


def macos_ports(
    sp_json_text: str,
    networksetup_text: str,
    ifconfig_text: str,
    ibv_devices_text: str | None,
) -> list[PortInfo]:
    """This Mac's ports: one per Thunderbolt receptacle that has an interface, plus the
    Wi-Fi and Ethernet hardware ports networksetup lists.

    - Thunderbolt: platform/thunderbolt.local_ports joins system_profiler and networksetup;
      up = a cable is connected, gbps = the negotiated speed, UUIDs as system_profiler
      prints them. A receptacle networksetup names no interface for is left out (a port
      without an interface cannot carry traffic or be addressed).
    - Other hardware ports: "Wi-Fi"/"AirPort" -> wifi; a name containing "Ethernet" or
      "LAN" (built-in, USB and dock NICs) -> ethernet; "Thunderbolt Bridge", Bluetooth PAN
      and iPhone USB are skipped. up = ifconfig "status: active"; gbps from ifconfig's
      media line when it states one.
    - ipv4: the interface's own inet addresses. An address on bridge0 is not attributed to
      its member ports: one bridge spans several cables, so it cannot name one.
    - rdma: ``ibv_devices`` lists ``rdma_<interface>``; None (tool missing) means False.
    """
    tb = local_ports(sp_json_text, networksetup_text)
    hw = parse_networksetup(networksetup_text)
    ifc = parse_ifconfig(ifconfig_text)
    rdma = parse_ibv_devices(ibv_devices_text) if ibv_devices_text is not None else frozenset()
    ports: dict[str, PortInfo] = {}
    for lp in tb:
        if lp.interface is None or lp.interface in ports:
            continue
        gbps = lp.speed_gbps if lp.speed_gbps is not None and _sane_gbps(lp.speed_gbps) else None
        ports[lp.interface] = PortInfo(
            lp.interface,
            "thunderbolt",
            lp.domain_uuid,
            lp.peer_domain_uuid,
            lp.connected,
            gbps,
            _ipv4_of(ifc, lp.interface),
            lp.interface in rdma,
        )
    for h in hw:
        if h.device in ports or _SKIPPED_HW_PORTS.fullmatch(h.name):
            continue
        if h.name in _WIFI_HW_PORTS:
            kind = "wifi"
        elif _ETHERNET_HW_PORT.fullmatch(h.name):
            kind = "ethernet"
        else:
            continue
        entry = ifc.get(h.device)
        ports[h.device] = PortInfo(
            h.device,
            kind,
            None,
            None,
            entry is not None and entry.status == "active",
            entry.media_gbps if entry is not None and kind == "ethernet" else None,
            _ipv4_of(ifc, h.device),
            h.device in rdma,
        )
    return [ports[name] for name in sorted(ports, key=_natural)]


def _ipv4_of(ifc: dict[str, IfconfigEntry], name: str) -> tuple[str, ...]:
    entry = ifc.get(name)
    return entry.ipv4[:IPV4_PUBLISHED_MAX] if entry is not None else ()


# ---------------------------------------------------------------------------------------
# helpers


def _float(text: str, where: str) -> float:
    # Whatever repr() prints for a float: up to 17 significant digits, after at most three
    # leading zeros in the fraction (repr switches to an exponent below 1e-4).
    if re.fullmatch(r"[0-9]{1,17}(?:\.[0-9]{1,20})?(?:[eE][+-]?[0-9]{1,3})?", text) is None:
        raise CaptureError(f"{where} {text[:30]!r} is not a number")
    return float(text)


def _sane_gbps(gbps: float) -> bool:
    return math.isfinite(gbps) and 0 < gbps < GBPS_MAX


def _natural(name: str) -> tuple[str, int, str]:
    """en2 < en10; names without a numeric suffix sort by text."""
    m = re.fullmatch(r"(.*?)([0-9]{1,9})", name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)
