"""IPv4 addresses for the ring's data plane, and the bridge check (pure: values in, plans out).

MLX's ring backend dials IPv4 literals, so every ring hop needs one IPv4 address at each end
in a common subnet. The rule (docs/links.md, "Addressing the data plane"):

- a Thunderbolt cable whose two ends already share a subnet keeps its addresses (no change);
- any other Thunderbolt cable gets a /30 from link-local space (169.254.1.0-169.254.254.255;
  RFC 3927 reserves the .0.x and .255.x blocks), picked from a hash of the cable's identity
  and probed in sorted cable order, so every node computes the same plan from the same ring
  without talking to the others. The end with the lower node id gets .1, the other .2;
- hops over Ethernet or Wi-Fi are never readdressed: they run over the user's own network.

The commands are additive and non-persistent (an alias, gone at reboot): we never disable a
bridge, switch a network location, edit a service or touch DHCP. The I/O lives in
p2pmesh/drivers/netconfig.py; the CLI in p2pmesh/cli/links_cmd.py.
"""
from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import RingHop

PREFIX = 30
_FIRST = int(ipaddress.IPv4Address("169.254.1.0"))
BLOCK_COUNT = 254 * 64
"""/30 blocks in 169.254.1.0-169.254.254.255: 254 /24s of 64 blocks each."""
PLATFORMS = ("darwin", "linux")
ADDRESSED_KINDS = frozenset({"thunderbolt"})
"""Only point-to-point cables are ours to address; Ethernet and Wi-Fi hops run over the
user's network, where an extra address would be a surprise (and could clash)."""
# Interface names become argv items: a leading "-" would turn into an option of ifconfig/ip.
_IFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
_IFCONFIG_HEADER = re.compile(r"([A-Za-z0-9_.-]+): flags=")
_IFCONFIG_MEMBER = re.compile(r"\s+member: (\S+)")
_IFCONFIG_INET = re.compile(r"\s+inet (\d+\.\d+\.\d+\.\d+) netmask (0x[0-9a-fA-F]{8}|\d+\.\d+\.\d+\.\d+)")
_IP_ADDR_LINE = re.compile(r"\d+:\s+(\S+)\s+inet (\d+\.\d+\.\d+\.\d+/\d+)")

End = tuple[str, str]
"""One end of a cable: (node id, interface)."""


class AddressingError(ValueError):
    """The ring (or the status it came from) cannot be addressed as given; the message names
    the hop or the input at fault."""


@dataclass(frozen=True)
class Assignment:
    """One address one node needs on one interface for one ring cable."""

    node_id: str
    interface: str
    address: str
    """Bare IPv4 address, e.g. "169.254.77.1"."""
    prefix: int | None
    """30 for planned addresses; for a reused address its known prefix, or None when the
    status reported only the bare address."""
    cable: str
    """The cable's identity: its two ends, sorted, as "node/iface--node/iface"."""
    reused: bool = False
    """True when the address is already there (nothing to run for it)."""


@dataclass(frozen=True)
class RingView:
    """What `links plan` needs from an agent's status: who we are and the committed ring."""

    node_id: str
    epoch: int
    order: tuple[str, ...]
    hops: tuple[RingHop, ...]


@dataclass(frozen=True)
class _Cable:
    ends: tuple[End, End]  # sorted: the lower node id first
    reported: tuple[str | None, str | None]  # the status's IPv4 for each end
    hop: str  # how to name the first hop that used this cable in an error

    @property
    def ident(self) -> str:
        return "--".join(f"{n}/{i}" for n, i in self.ends)


# ---------------------------------------------------------------------------------------
# Reading the ring out of `p2pmesh status --json`


def ring_from_status(status: Any) -> RingView | None:
    """The ring of a status object (the JSON of `p2pmesh status --json`); None when no ring
    is committed yet. Raises AddressingError naming the first malformed field."""
    if not isinstance(status, dict):
        raise AddressingError("the status is not a JSON object")
    node_id = status.get("node_id")
    if not isinstance(node_id, str) or not node_id:
        raise AddressingError("the status has no node_id")
    ring = status.get("ring")
    if ring is None:
        return None
    if not isinstance(ring, dict):
        raise AddressingError("status.ring is not an object")
    epoch, order, hops = ring.get("epoch"), ring.get("order"), ring.get("hops")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise AddressingError("status.ring.epoch is not an integer")
    if not isinstance(order, list) or not all(isinstance(n, str) and n for n in order):
        raise AddressingError("status.ring.order is not a list of node ids")
    if not isinstance(hops, list):
        raise AddressingError("status.ring.hops is not a list")
    if not order:
        return None
    return RingView(node_id, epoch, tuple(order), tuple(_hop(h, k) for k, h in enumerate(hops)))


def _hop(h: Any, k: int) -> RingHop:
    where = f"status.ring.hops[{k}]"
    if not isinstance(h, dict):
        raise AddressingError(f"{where} is not an object")

    def text(key: str, *, optional: bool) -> str | None:
        v = h.get(key)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v:
            raise AddressingError(f"{where}.{key} must be a non-empty string{' or null' if optional else ''}")
        return v

    def number(key: str) -> float | None:
        v = h.get(key)
        if v is None:
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise AddressingError(f"{where}.{key} must be a number or null")
        return float(v)

    src, dst, kind = text("from", optional=False), text("to", optional=False), text("kind", optional=False)
    assert src is not None and dst is not None and kind is not None
    return RingHop(
        src=NodeId(src), dst=NodeId(dst), kind=kind, gbps=number("gbps") or 0.0, rtt_ms=number("rtt_ms"),
        src_interface=text("from_interface", optional=True), dst_interface=text("to_interface", optional=True),
        src_ipv4=text("from_ipv4", optional=True), dst_ipv4=text("to_ipv4", optional=True),
        rdma=bool(h.get("rdma", False)),
    )


# ---------------------------------------------------------------------------------------
# The plan


def home_block(cable: str) -> int:
    """The index (0..BLOCK_COUNT-1) of the /30 a cable tries first: a stable hash of its
    identity, so the same cable keeps its subnet across epochs and re-plans."""
    digest = hashlib.sha256(cable.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % BLOCK_COUNT


def block_network(index: int) -> ipaddress.IPv4Network:
    """The /30 with that index."""
    if not 0 <= index < BLOCK_COUNT:
        raise AddressingError(f"block index {index} is outside 0..{BLOCK_COUNT - 1}")
    return ipaddress.IPv4Network((_FIRST + 4 * index, PREFIX))


def _block_of(ip: ipaddress.IPv4Address) -> int | None:
    offset = int(ip) - _FIRST
    return offset // 4 if 0 <= offset < 4 * BLOCK_COUNT else None


def _hop_name(hop: RingHop) -> str:
    return f"hop {hop.src}->{hop.dst} ({hop.kind})"


def _parse_ipv4(text: str, what: str) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        raise AddressingError(f"{what}: {text!r} is not an IPv4 address") from None


def _cables(hops: Sequence[RingHop]) -> list[_Cable]:
    """The ring's Thunderbolt cables, each once (a 2-node ring crosses its cable twice)."""
    by_ident: dict[str, _Cable] = {}
    owner: dict[End, str] = {}
    for hop in hops:
        name = _hop_name(hop)
        if hop.src == hop.dst:
            raise AddressingError(f"{name}: both ends are the same node")
        for ip in (hop.src_ipv4, hop.dst_ipv4):
            if ip is not None:
                _parse_ipv4(ip, name)
        if hop.kind not in ADDRESSED_KINDS:
            continue
        pair: list[End] = []
        for node, iface in ((hop.src, hop.src_interface), (hop.dst, hop.dst_interface)):
            if iface is None:
                raise AddressingError(f"{name}: no interface is known at {node}'s end, so it cannot be addressed")
            if not _IFACE.fullmatch(iface):
                raise AddressingError(f"{name}: {iface!r} at {node}'s end is not an interface name")
            pair.append((node, iface))
        a, b = pair
        flip = b < a
        ends = (b, a) if flip else (a, b)
        reported = (hop.dst_ipv4, hop.src_ipv4) if flip else (hop.src_ipv4, hop.dst_ipv4)
        cable = _Cable(ends, reported, name)
        known = by_ident.get(cable.ident)
        if known is not None:
            # The same cable seen from the other direction (a 2-node ring): merge what the two
            # hops report, picking the smaller address if they disagree so hop order never matters.
            both = [sorted(x for x in (k, r) if x is not None) for k, r in zip(known.reported, reported)]
            merged = (both[0][0] if both[0] else None, both[1][0] if both[1] else None)
            by_ident[cable.ident] = _Cable(known.ends, merged, min(known.hop, name))
            continue
        for end in ends:
            other = owner.get(end)
            if other is not None:
                raise AddressingError(f"{name}: {end[1]} on {end[0]} is already the end of cable {other}")
            owner[end] = cable.ident
        by_ident[cable.ident] = cable
    return [by_ident[k] for k in sorted(by_ident)]


Known = dict[End, list[tuple[ipaddress.IPv4Address, ipaddress.IPv4Network | None]]]


def _known_addresses(cables: list[_Cable], existing: Mapping[End, Iterable[str]] | None) -> Known:
    """Every IPv4 address we know of, per end: the caller's (with prefix when given) and the
    ones the status reported on ring hops (bare)."""
    known: Known = {}
    for end, texts in sorted((existing or {}).items()):
        for text in sorted(texts):
            if ":" in text:
                continue  # IPv6: not our business
            try:
                iface = ipaddress.IPv4Interface(text)
            except ValueError:
                raise AddressingError(f"existing address {text!r} of {end[1]} on {end[0]} is not IPv4") from None
            net = iface.network if "/" in text else None
            known.setdefault(end, []).append((iface.ip, net))
    for cable in cables:
        for end, text in zip(cable.ends, cable.reported):
            if text is None:
                continue
            ip = ipaddress.IPv4Address(text)
            if all(ip != k for k, _ in known.get(end, [])):
                known.setdefault(end, []).append((ip, None))
    return known


def _ambiguous(node: str, own_iface: str, peer: ipaddress.IPv4Address,
               net: ipaddress.IPv4Network | None, known: Known) -> bool:
    """Would traffic from ``node`` to ``peer`` possibly leave through another interface?
    (Exo-style setups give every Thunderbolt port a 169.254/16: reusing those would make the
    ring's packets pick a port at random.)"""
    for (n, iface), addrs in known.items():
        if n != node or iface == own_iface:
            continue
        for ip, other in addrs:
            if ip == peer:
                return True
            if other is not None and peer in other and (net is None or other.prefixlen >= net.prefixlen):
                return True
    return False


def _reuse(cable: _Cable, known: Known) -> tuple[Assignment, Assignment] | None:
    """The pair of existing addresses this cable can keep, if any: two different addresses,
    each inside the other end's subnet where that is known, routed unambiguously at both
    nodes. The bare pair the status reported for the hop is trusted (the agent reports the
    pair it found on the link); any other pair needs both prefixes to prove a common subnet."""
    (na, ia), (nb, ib) = cable.ends
    nets: list[dict[ipaddress.IPv4Address, ipaddress.IPv4Network | None]] = [{}, {}]
    for side, end in enumerate(cable.ends):
        for ip, net in known.get(end, []):
            if nets[side].get(ip) is None:
                nets[side][ip] = net
    pairs: list[tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]] = []
    if cable.reported[0] is not None and cable.reported[1] is not None:
        pairs.append((ipaddress.IPv4Address(cable.reported[0]), ipaddress.IPv4Address(cable.reported[1])))
    pairs += sorted((x, y) for x, nx in nets[0].items() for y, ny in nets[1].items() if nx and ny)
    for a, b in pairs:
        net_a, net_b = nets[0].get(a), nets[1].get(b)
        if a == b or (net_a is not None and b not in net_a) or (net_b is not None and a not in net_b):
            continue
        if _ambiguous(na, ia, b, net_a, known) or _ambiguous(nb, ib, a, net_b, known):
            continue
        return (
            Assignment(na, ia, str(a), net_a.prefixlen if net_a else None, cable.ident, reused=True),
            Assignment(nb, ib, str(b), net_b.prefixlen if net_b else None, cable.ident, reused=True),
        )
    return None


def _sticky_block(cable: _Cable, known: Known, owners: dict[int, set[End]], taken: set[int]) -> int | None:
    """A block one of the cable's ends already holds at its planned position (.1 for the
    lower node id, .2 for the other), e.g. from a half-applied earlier plan: keeping it
    avoids leaving a stale alias behind. The lowest such block, for determinism."""
    found = []
    for side, end in enumerate(cable.ends):
        for ip, _ in known.get(end, []):
            index = _block_of(ip)
            if (index is not None and int(ip) % 4 == side + 1 and index not in taken
                    and owners.get(index, set()) <= set(cable.ends)):
                found.append(index)
    return min(found) if found else None


def plan_addresses(hops: Sequence[RingHop], existing: Mapping[End, Iterable[str]] | None = None) -> list[Assignment]:
    """The addresses of the whole ring: two Assignments per Thunderbolt cable, sorted by
    (cable, node id). ``existing`` maps (node id, interface) to the IPv4 addresses already
    there ("10.0.0.1/24"; bare means prefix unknown); it must be the same on every node (the
    cluster's view, never one Mac's local one) or the nodes' plans would differ.

    The result depends only on the set of cables and addresses, not on the hops' order or
    direction. Raises AddressingError naming the hop at fault."""
    cables = _cables(hops)
    known = _known_addresses(cables, existing)
    out: list[Assignment] = []
    fresh: list[_Cable] = []
    for cable in cables:
        pair = _reuse(cable, known)
        if pair is None:
            fresh.append(cable)
        else:
            out += pair
    # Blocks already holding someone's address, and whose: a cable may sit on a block only
    # its own ends use (its own earlier addresses), never on anyone else's.
    owners: dict[int, set[End]] = {}
    for end, addrs in known.items():
        for ip, _ in addrs:
            index = _block_of(ip)
            if index is not None:
                owners.setdefault(index, set()).add(end)
    taken: set[int] = set()
    for cable in fresh:
        sticky = _sticky_block(cable, known, owners, taken)
        index = home_block(cable.ident) if sticky is None else sticky
        for _ in range(BLOCK_COUNT):  # linear probing: at most one lap
            if index not in taken and owners.get(index, set()) <= set(cable.ends):
                break
            index = (index + 1) % BLOCK_COUNT
        else:
            raise AddressingError(f"{cable.hop}: no free /30 left in 169.254.1.0-169.254.254.255")
        taken.add(index)
        hosts = list(block_network(index).hosts())
        (na, ia), (nb, ib) = cable.ends
        out.append(Assignment(na, ia, str(hosts[0]), PREFIX, cable.ident))
        out.append(Assignment(nb, ib, str(hosts[1]), PREFIX, cable.ident))
    return sorted(out, key=lambda x: (x.cable, x.node_id))


def unaddressed_hops(hops: Sequence[RingHop]) -> list[str]:
    """Warnings for hops p2pmesh will not address (not Thunderbolt) that lack an IPv4 pair."""
    out = []
    for hop in hops:
        if hop.kind not in ADDRESSED_KINDS and (hop.src_ipv4 is None or hop.dst_ipv4 is None):
            out.append(f"{_hop_name(hop)} has no IPv4 address pair; p2pmesh addresses only Thunderbolt "
                       f"cables, so give both Macs an IPv4 address on that network yourself")
    return out


# ---------------------------------------------------------------------------------------
# Commands


def commands_for(node_id: str, assignments: Iterable[Assignment], platform: str, *,
                 present: Mapping[str, Iterable[str]] | None = None) -> list[list[str]]:
    """The exact argv lists ``node_id`` runs for its planned (not reused) addresses, sorted
    by interface. ``present`` (interface -> addresses already on it, bare or with prefix,
    from this Mac) drops the ones already applied, so running twice changes nothing.

    macOS: ``ifconfig IF inet A/30 alias``; "alias" adds beside the existing addresses
    instead of replacing the primary one, and ifconfig changes are not saved in the network
    preferences: a reboot undoes them. That is the safe choice: a wrong plan costs a restart,
    never a broken network location or service. Linux: ``ip addr add A/30 dev IF``, equally
    runtime-only."""
    if platform not in PLATFORMS:
        raise AddressingError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    have = {iface: {t.split("/", 1)[0] for t in texts} for iface, texts in (present or {}).items()}
    out = []
    for a in sorted(assignments, key=lambda x: (x.interface, x.address)):
        if a.node_id != node_id or a.reused or a.address in have.get(a.interface, set()):
            continue
        if not _IFACE.fullmatch(a.interface):
            raise AddressingError(f"{a.interface!r} (cable {a.cable}) is not an interface name")
        cidr = f"{_parse_ipv4(a.address, a.cable)}/{a.prefix}"
        if platform == "darwin":
            out.append(["ifconfig", a.interface, "inet", cidr, "alias"])
        else:
            out.append(["ip", "addr", "add", cidr, "dev", a.interface])
    return out


def local_conflicts(node_id: str, assignments: Iterable[Assignment],
                    local: Mapping[str, Iterable[str]]) -> list[str]:
    """Problems with this Mac's own addresses (``local``: interface -> addresses) that would
    make the plan misroute: a planned address, or its peer's, already used by another local
    interface. The plan is shared by all nodes, so we report rather than re-plan."""
    mine = [a for a in assignments if a.node_id == node_id]
    peers = {a.cable: a for a in assignments if a.node_id != node_id}
    out = []
    for a in sorted(mine, key=lambda x: x.interface):
        for iface, texts in sorted(local.items()):
            if iface == a.interface:
                continue
            addrs = {t.split("/", 1)[0] for t in texts}
            peer = peers.get(a.cable)
            if a.address in addrs:
                out.append(f"{a.address} planned for {a.interface} is already this Mac's address on {iface}")
            if peer is not None and peer.address in addrs:
                out.append(f"the peer address {peer.address} on cable {a.cable} is this Mac's own address on "
                           f"{iface}: traffic to it would never leave this Mac")
    return out


# ---------------------------------------------------------------------------------------
# Bridges and local addresses


def _ifconfig_blocks(text: str) -> list[tuple[str, list[str]]]:
    """macOS ``ifconfig`` output as (interface, the lines below its header), in order; lines
    before the first header belong to no interface and are dropped."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        header = _IFCONFIG_HEADER.match(line)
        if header:
            blocks.append((header.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    return blocks


def parse_ifconfig_bridge_members(text: str) -> dict[str, list[str]]:
    """Bridges and their member interfaces from macOS ``ifconfig`` or ``ifconfig bridgeN``
    output. An interface counts as a bridge when it lists members or is named bridgeN."""
    bridges: dict[str, list[str]] = {}
    for iface, lines in _ifconfig_blocks(text):
        if re.fullmatch(r"bridge[0-9]+", iface):
            bridges.setdefault(iface, [])
        for line in lines:
            member = _IFCONFIG_MEMBER.match(line)
            if member:
                members = bridges.setdefault(iface, [])
                if member.group(1) not in members:
                    members.append(member.group(1))
    return bridges


def parse_ifconfig_ipv4(text: str) -> dict[str, tuple[str, ...]]:
    """Interface -> IPv4 addresses with prefix ("10.25.0.1/24") from macOS ``ifconfig``."""
    found: dict[str, list[str]] = {}
    for iface, lines in _ifconfig_blocks(text):
        for line in lines:
            inet = _IFCONFIG_INET.match(line)
            if inet:
                mask = inet.group(2)
                bits = int(mask, 16).bit_count() if mask.startswith("0x") else ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
                found.setdefault(iface, []).append(f"{inet.group(1)}/{bits}")
    return {k: tuple(v) for k, v in found.items()}


def parse_ip_addr_ipv4(text: str) -> dict[str, tuple[str, ...]]:
    """Interface -> IPv4 addresses with prefix from Linux ``ip -4 -o addr show``."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _IP_ADDR_LINE.match(line)
        if m:
            found.setdefault(m.group(1).split("@", 1)[0], []).append(m.group(2))
    return {k: tuple(v) for k, v in found.items()}


def bridge_warnings(bridges: Mapping[str, Iterable[str]], ring_interfaces: Iterable[str], *,
                    platform: str = "darwin") -> list[str]:
    """Warnings for bridges holding this Mac's ring interfaces. Two ring ports in one bridge
    (macOS's "Thunderbolt Bridge", bridge0, holds every Thunderbolt port by default) join the
    ring's cables into a loop with no loop protection: one broadcast circles forever and can
    flood every Mac's network. We only warn: the user decides, and the fix is suggested,
    never applied. On Linux a bridge port's own address is ignored, so one is enough."""
    ring = set(ring_interfaces)
    out = []
    for bridge in sorted(bridges):
        caught = sorted(ring.intersection(bridges[bridge]))
        if len(caught) < (1 if platform == "linux" else 2):
            continue
        ports = ", ".join(caught)
        if platform == "linux":
            fix = "; ".join(f"sudo ip link set dev {i} nomaster" for i in caught)
            out.append(f"{bridge} bridges the ring interface(s) {ports}: Linux ignores addresses on bridge ports, "
                       f"and bridging two ring cables forms a loop that can flood the network. p2pmesh changes "
                       f"nothing here; to fix it yourself: {fix}")
            continue
        fix = "; ".join(f"sudo ifconfig {bridge} deletem {i}" for i in caught)
        out.append(f"{bridge} joins the ring interfaces {ports} in one bridge: when the other Macs bridge theirs "
                   f"too, the ring's cables form a loop with no loop protection and one broadcast can circle "
                   f"forever, flooding every Mac's network (Wi-Fi and LAN included). p2pmesh changes nothing "
                   f"here. To fix it yourself: System Settings > Network > Thunderbolt Bridge, make the service "
                   f"inactive or remove {ports} from it; or, until the next reboot: {fix}")
    return out
