"""Data-plane addressing (core/addressing.py): the same plan on every node, existing pairs
kept, collisions probed, the lower node id on .1, exact commands per platform, nothing but
"add one address" ever planned."""
from __future__ import annotations

import ipaddress
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pmesh.core.addressing import (
    BLOCK_COUNT,
    AddressingError,
    Assignment,
    block_network,
    commands_for,
    home_block,
    local_conflicts,
    parse_ip_addr_ipv4,
    plan_addresses,
    ring_from_status,
    unaddressed_hops,
)
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import RingHop

A, B, C = NodeId("a" * 32), NodeId("b" * 32), NodeId("c" * 32)
LOW, HIGH = ipaddress.IPv4Address("169.254.1.0"), ipaddress.IPv4Address("169.254.254.255")
DARWIN_SHAPE = re.compile(r"ifconfig [a-z0-9]+ inet 169\.254\.\d+\.\d+/30 alias")
LINUX_SHAPE = re.compile(r"ip addr add 169\.254\.\d+\.\d+/30 dev [a-z0-9]+")


def hop(src: str, dst: str, si: str | None, di: str | None, sip: str | None = None, dip: str | None = None,
        kind: str = "thunderbolt") -> RingHop:
    return RingHop(NodeId(src), NodeId(dst), kind, 40.0, None, si, di, sip, dip, False)


def ring3() -> list[RingHop]:
    return [hop(A, B, "en2", "en5"), hop(B, C, "en6", "en2"), hop(C, A, "en3", "en3")]


def cable_of(plan: list[Assignment], node: str, iface: str) -> list[Assignment]:
    mine = next(a for a in plan if a.node_id == node and a.interface == iface)
    return [a for a in plan if a.cable == mine.cable]


def block_index(address: str) -> int:
    return (int(ipaddress.IPv4Address(address)) - int(LOW)) // 4


# ---------------------------------------------------------------------------------------
# The rule


def test_two_node_ring_over_one_cable_gets_one_slash30_lower_id_on_dot1() -> None:
    plan = plan_addresses([hop(B, A, "en5", "en2"), hop(A, B, "en2", "en5")])
    assert len(plan) == 2
    a, b = (next(x for x in plan if x.node_id == n) for n in (A, B))
    assert (a.interface, b.interface, a.prefix, b.prefix) == ("en2", "en5", 30, 30)
    assert a.cable == b.cable == f"{A}/en2--{B}/en5"
    net = block_network(home_block(a.cable))
    assert ipaddress.IPv4Address(a.address) == net.network_address + 1
    assert ipaddress.IPv4Address(b.address) == net.network_address + 2
    assert not a.reused and not b.reused


def test_two_node_ring_over_two_cables_gets_two_blocks() -> None:
    plan = plan_addresses([hop(A, B, "en2", "en5"), hop(B, A, "en6", "en3")])
    assert len(plan) == 4
    assert len({block_index(x.address) for x in plan}) == 2


def test_every_node_computes_the_same_plan_from_its_own_view() -> None:
    hops = ring3()
    expected = plan_addresses(hops)
    rng = random.Random(7)
    for _ in range(20):
        view = list(hops)
        rng.shuffle(view)
        # The ring walked the other way: every hop reversed.
        if rng.random() < 0.5:
            view = [hop(h.dst, h.src, h.dst_interface, h.src_interface) for h in view]
        assert plan_addresses(view) == expected
    # Each node's commands come from the one shared plan and the two ends agree on the /30.
    for node, iface in ((A, "en2"), (B, "en5")):
        ends = cable_of(expected, node, iface)
        assert {block_index(x.address) for x in ends} == {block_index(ends[0].address)}


def test_commands_are_exact_per_platform() -> None:
    plan = plan_addresses([hop(A, B, "en2", "thunderbolt0")])
    a = next(x for x in plan if x.node_id == A)
    b = next(x for x in plan if x.node_id == B)
    assert commands_for(A, plan, "darwin") == [["ifconfig", "en2", "inet", f"{a.address}/30", "alias"]]
    assert commands_for(B, plan, "linux") == [["ip", "addr", "add", f"{b.address}/30", "dev", "thunderbolt0"]]
    assert commands_for(C, plan, "darwin") == []


def test_commands_skip_addresses_already_present() -> None:
    plan = plan_addresses(ring3())
    mine = sorted((x for x in plan if x.node_id == A), key=lambda x: x.interface)
    assert len(commands_for(A, plan, "darwin")) == 2
    present = {mine[0].interface: (f"{mine[0].address}/30", "fe80::1")}
    left = commands_for(A, plan, "darwin", present=present)
    assert left == [["ifconfig", mine[1].interface, "inet", f"{mine[1].address}/30", "alias"]]


def test_unknown_platform_is_refused() -> None:
    with pytest.raises(AddressingError, match="windows"):
        commands_for(A, plan_addresses(ring3()), "windows")


# ---------------------------------------------------------------------------------------
# Existing addresses


def test_a_reported_pair_is_kept_and_nothing_runs() -> None:
    plan = plan_addresses([hop(A, B, "en2", "en5", "10.9.0.1", "10.9.0.2")])
    assert [(x.node_id, x.address, x.prefix, x.reused) for x in plan] == [(A, "10.9.0.1", None, True), (B, "10.9.0.2", None, True)]
    assert commands_for(A, plan, "darwin") == commands_for(B, plan, "linux") == []


def test_the_reverse_hop_fills_in_what_one_direction_lacks() -> None:
    plan = plan_addresses([hop(A, B, "en2", "en5", "10.9.0.1", None), hop(B, A, "en5", "en2", "10.9.0.2", None)])
    assert {x.address for x in plan} == {"10.9.0.1", "10.9.0.2"} and all(x.reused for x in plan)
    # Two views that disagree about one end still give one plan, whatever the hop order.
    hops = [hop(A, B, "en2", "en5", "10.9.0.9", "10.9.0.2"), hop(B, A, "en5", "en2", None, "10.9.0.1")]
    assert plan_addresses(hops) == plan_addresses(hops[::-1]) == plan


def test_existing_addresses_in_one_subnet_are_kept_with_their_prefix() -> None:
    existing = {(A, "en2"): ("10.9.0.1/24",), (B, "en5"): ("10.9.0.77/24", "fe80::2/64")}
    plan = plan_addresses([hop(A, B, "en2", "en5")], existing)
    assert [(x.address, x.prefix, x.reused) for x in plan] == [("10.9.0.1", 24, True), ("10.9.0.77", 24, True)]


def test_existing_addresses_in_different_subnets_get_a_new_block() -> None:
    existing = {(A, "en2"): ("10.9.0.1/24",), (B, "en5"): ("10.8.0.2/24",)}
    plan = plan_addresses([hop(A, B, "en2", "en5")], existing)
    assert all(not x.reused and x.prefix == 30 for x in plan)
    assert all(LOW <= ipaddress.IPv4Address(x.address) <= HIGH for x in plan)


def test_bare_existing_addresses_do_not_prove_a_common_subnet() -> None:
    plan = plan_addresses([hop(A, B, "en2", "en5")], {(A, "en2"): ("10.9.0.1",), (B, "en5"): ("10.9.0.2",)})
    assert all(not x.reused for x in plan)


def test_a_link_local_slash16_on_two_ports_is_not_reused() -> None:
    # Exo-style: every Thunderbolt service on DHCP self-assigns a 169.254/16. With two ring
    # ports in the same /16 the kernel may send the ring's packets out of the wrong one.
    existing = {
        (A, "en2"): ("169.254.10.10/16",), (B, "en5"): ("169.254.20.20/16",),
        (A, "en3"): ("169.254.30.30/16",), (C, "en3"): ("169.254.40.40/16",),
    }
    hops = [hop(A, B, "en2", "en5", "169.254.10.10", "169.254.20.20"), hop(B, C, "en6", "en2"),
            hop(C, A, "en3", "en3", "169.254.40.40", "169.254.30.30")]
    plan = plan_addresses(hops, existing)
    for iface in ("en2", "en3"):
        assert all(not x.reused and x.prefix == 30 for x in cable_of(plan, A, iface))


def test_blocks_holding_addresses_of_other_interfaces_are_skipped() -> None:
    hops = [hop(A, B, "en2", "en5")]
    home = home_block(f"{A}/en2--{B}/en5")
    taken = block_network(home).network_address + 2
    plan = plan_addresses(hops, {(C, "en0"): (f"{taken}/16",)})
    assert {block_index(x.address) for x in plan} == {(home + 1) % BLOCK_COUNT}
    # The cable's own earlier address in its home block does not push it away.
    plan = plan_addresses(hops, {(B, "en5"): (f"{taken}/30",)})
    assert {block_index(x.address) for x in plan} == {home}


def test_a_half_applied_cable_keeps_the_block_its_end_already_holds() -> None:
    home = home_block(f"{A}/en2--{B}/en5")
    other = (home + 123) % BLOCK_COUNT
    dot1 = str(block_network(other).network_address + 1)
    plan = plan_addresses([hop(A, B, "en2", "en5", dot1, None)])
    assert [(x.node_id, block_index(x.address)) for x in plan] == [(A, other), (B, other)]
    assert commands_for(A, plan, "linux", present={"en2": (f"{dot1}/30",)}) == []
    assert len(commands_for(B, plan, "linux")) == 1


def test_colliding_cables_are_probed_in_sorted_cable_order() -> None:
    seen: dict[int, int] = {}
    pair = None
    for i in range(5000):  # birthday bound over 16256 blocks: a collision comes in ~160
        block = home_block(f"{A}/p{i}--{B}/q{i}")
        if block in seen:
            pair = (seen[block], i)
            break
        seen[block] = i
    assert pair is not None
    i, j = pair
    hops = [hop(A, B, f"p{i}", f"q{i}"), hop(B, A, f"q{j}", f"p{j}")]
    plan = plan_addresses(hops)
    first, second = sorted([f"{A}/p{i}--{B}/q{i}", f"{A}/p{j}--{B}/q{j}"])
    home = home_block(first)
    assert {block_index(x.address) for x in plan if x.cable == first} == {home}
    assert {block_index(x.address) for x in plan if x.cable == second} == {(home + 1) % BLOCK_COUNT}
    assert plan_addresses(list(reversed(hops))) == plan


# ---------------------------------------------------------------------------------------
# Errors name the hop


def test_a_thunderbolt_hop_without_an_interface_is_refused_naming_it() -> None:
    with pytest.raises(AddressingError, match=f"hop {A}->{B}.*no interface.*{B}"):
        plan_addresses([hop(A, B, "en2", None)])


@pytest.mark.parametrize("bad, match", [
    (hop(A, A, "en2", "en3"), "same node"),
    (hop(A, B, "-down", "en5"), "not an interface name"),
    (hop(A, B, "en2", "en5", "169.254.300.1", None), "not an IPv4"),
])
def test_malformed_hops_are_refused(bad: RingHop, match: str) -> None:
    with pytest.raises(AddressingError, match=match):
        plan_addresses([bad])


def test_one_interface_on_two_cables_is_refused() -> None:
    with pytest.raises(AddressingError, match="en2 on .* already the end of cable"):
        plan_addresses([hop(A, B, "en2", "en5"), hop(C, A, "en3", "en2")])


def test_wifi_and_ethernet_hops_are_never_readdressed_only_warned() -> None:
    hops = [hop(A, B, "en2", "en5"), hop(B, A, "en0", "en0", kind="wifi")]
    plan = plan_addresses(hops)
    assert {x.interface for x in plan} == {"en2", "en5"}
    assert len(unaddressed_hops(hops)) == 1 and "wifi" in unaddressed_hops(hops)[0]
    assert unaddressed_hops([hop(A, B, None, None, "10.0.0.1", "10.0.0.2", kind="ethernet")]) == []
    # A Wi-Fi hop needs no interface: nothing is planned on it.
    assert plan_addresses([hop(A, B, None, None, kind="wifi")]) == []


def test_local_conflicts_name_the_clash() -> None:
    plan = plan_addresses([hop(A, B, "en2", "en5")])
    peer = next(x for x in plan if x.node_id == B)
    mine = next(x for x in plan if x.node_id == A)
    assert local_conflicts(A, plan, {"en2": (f"{mine.address}/30",)}) == []
    msgs = local_conflicts(A, plan, {"en0": (f"{peer.address}/16",), "en7": (f"{mine.address}/30",)})
    assert len(msgs) == 2 and "never leave this Mac" in msgs[0] and "en7" in msgs[1]


# ---------------------------------------------------------------------------------------
# Status and ip output parsing


def _status_hop(**over: object) -> dict[str, object]:
    h: dict[str, object] = {"from": A, "to": B, "kind": "thunderbolt", "gbps": 40, "rtt_ms": 0.3,
                            "from_interface": "en2", "to_interface": "en5", "from_ipv4": None, "to_ipv4": None,
                            "rdma": True}
    h.update(over)
    return h


def test_ring_from_status_reads_the_agents_status() -> None:
    view = ring_from_status({"node_id": A, "ring": {"epoch": 5, "order": [A, B], "hops": [_status_hop()]}})
    assert view is not None
    assert (view.node_id, view.epoch, view.order) == (A, 5, (A, B))
    assert view.hops == (RingHop(A, B, "thunderbolt", 40.0, 0.3, "en2", "en5", None, None, True),)
    assert ring_from_status({"node_id": A}) is None
    assert ring_from_status({"node_id": A, "ring": None}) is None
    assert ring_from_status({"node_id": A, "ring": {"epoch": 0, "order": [], "hops": []}}) is None


@pytest.mark.parametrize("status, match", [
    ([], "not a JSON object"),
    ({"ring": None}, "node_id"),
    ({"node_id": A, "ring": {"epoch": "1", "order": [A], "hops": []}}, "epoch"),
    ({"node_id": A, "ring": {"epoch": 1, "order": [A, 3], "hops": []}}, "order"),
    ({"node_id": A, "ring": {"epoch": 1, "order": [A], "hops": [_status_hop(to_interface=7)]}}, r"hops\[0\]\.to_interface"),
    ({"node_id": A, "ring": {"epoch": 1, "order": [A], "hops": [_status_hop(gbps="fast")]}}, "gbps"),
])
def test_malformed_status_is_refused_naming_the_field(status: object, match: str) -> None:
    with pytest.raises(AddressingError, match=match):
        ring_from_status(status)


def test_parse_ip_addr_ipv4() -> None:
    text = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "7: tb0a0    inet 169.254.9.1/30 scope global tb0a0\\       valid_lft forever preferred_lft forever\n"
        "7: tb0a0    inet 10.77.0.1/30 scope global tb0a0\\       valid_lft forever preferred_lft forever\n"
    )
    assert parse_ip_addr_ipv4(text) == {"lo": ("127.0.0.1/8",), "tb0a0": ("169.254.9.1/30", "10.77.0.1/30")}


# ---------------------------------------------------------------------------------------
# Properties over random rings


@st.composite
def rings(draw: st.DrawFn) -> tuple[list[RingHop], dict[tuple[str, str], tuple[str, ...]]]:
    n = draw(st.integers(2, 16))
    ids = draw(st.lists(st.text("0123456789abcdef", min_size=32, max_size=32), min_size=n, max_size=n, unique=True))
    order = draw(st.permutations(ids))
    hops = []
    for k, src in enumerate(order):
        dst = order[(k + 1) % n]
        # Port numbers by position: each node's two ring ports differ (a 2-ring gets two cables).
        hop_ = hop(src, dst, f"en{2 * k + 2}", f"en{2 * ((k + 1) % n) + 3}")
        if draw(st.booleans()):
            hop_ = hop(dst, src, hop_.dst_interface, hop_.src_interface)
        hops.append(hop_)
    hops = draw(st.permutations(hops))
    # Someone else's addresses on other interfaces (en0, never a ring port) to steer around.
    existing = {}
    for node in draw(st.lists(st.sampled_from(ids), max_size=4, unique=True)):
        ip = ipaddress.IPv4Address(int(LOW) + draw(st.integers(0, 4 * BLOCK_COUNT - 1)))
        existing[(node, "en0")] = (f"{ip}/16",)
    return list(hops), existing


@settings(max_examples=200, deadline=None)
@given(rings())
def test_any_ring_gets_unique_link_local_slash30s(ring: tuple[list[RingHop], dict[tuple[str, str], tuple[str, ...]]]) -> None:
    hops, existing = ring
    plan = plan_addresses(hops, existing)
    cables = {x.cable for x in plan}
    assert len(cables) == len(hops) and len(plan) == 2 * len(hops)
    blocks = set()
    avoid = {ipaddress.IPv4Interface(t).ip for ts in existing.values() for t in ts}
    for cable in cables:
        low, high = sorted((x for x in plan if x.cable == cable), key=lambda x: x.node_id)
        net = ipaddress.IPv4Network(f"{low.address}/30", strict=False)
        assert LOW <= net.network_address and net.broadcast_address <= HIGH
        assert (ipaddress.IPv4Address(low.address), ipaddress.IPv4Address(high.address)) == tuple(net.hosts())
        assert low.prefix == high.prefix == 30 and not low.reused
        assert not any(ip in net for ip in avoid)
        blocks.add(net)
    assert len(blocks) == len(cables)  # /30s of one size: distinct means non-overlapping
    # Every node: its commands only add its own planned addresses, in the two allowed shapes.
    nodes = {x.node_id for x in plan}
    total = 0
    for node in nodes:
        for platform, shape in (("darwin", DARWIN_SHAPE), ("linux", LINUX_SHAPE)):
            cmds = commands_for(node, plan, platform)
            assert all(shape.fullmatch(" ".join(c)) for c in cmds)
        total += len(commands_for(node, plan, "darwin"))
    assert total == len(plan)
    # The same plan from any node's ordering of the ring.
    assert plan_addresses(list(reversed(hops)), existing) == plan
