"""Rendering the committed ring for MLX: ring hostfile, JACCL device matrix and coordinator."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Capabilities, Member, RingHop
from p2pmesh.core.mlx_hostfile import (
    MlxConfigError,
    epoch_base_port,
    epoch_ports,
    jaccl_coordinator,
    jaccl_devices,
    loopback_hostfile,
    ring_hostfile,
)

A, B, C, D = (NodeId(c * 32) for c in "abcd")


def hop(src: NodeId, dst: NodeId, k: int, *, rdma: bool = False) -> RingHop:
    """Cable k between src and dst: src has 10.0.k.1 on en{k}, dst 10.0.k.2 on en{k+10}."""
    return RingHop(
        src=src,
        dst=dst,
        kind="thunderbolt",
        gbps=40.0,
        rtt_ms=None,
        src_interface=f"en{k}",
        dst_interface=f"en{k + 10}",
        src_ipv4=f"10.0.{k}.1",
        dst_ipv4=f"10.0.{k}.2",
        rdma=rdma,
    )


def ring(order: list[NodeId], *, rdma: bool = False) -> tuple[list[NodeId], list[RingHop]]:
    n = len(order)
    return order, [hop(order[i], order[(i + 1) % n], i, rdma=rdma) for i in range(n)]


def test_two_ranks_listen_on_the_cable_from_their_left_neighbour() -> None:
    order, hops = ring([A, B])
    # rank 0's left neighbour is rank 1: hop 1 (B -> A) ends at A with 10.0.1.2.
    assert ring_hostfile(order, hops, 5000) == [["10.0.1.2:5000"], ["10.0.0.2:5001"]]


def test_two_ranks_over_one_cable() -> None:
    # Both hops name the same cable, seen from either end.
    back = RingHop(B, A, "thunderbolt", 40.0, None, "en10", "en0", "10.0.0.2", "10.0.0.1", False)
    assert ring_hostfile([A, B], [hop(A, B, 0), back], 7000) == [["10.0.0.1:7000"], ["10.0.0.2:7001"]]


def test_three_ranks() -> None:
    order, hops = ring([A, B, C])
    assert ring_hostfile(order, hops, 32323) == [["10.0.2.2:32323"], ["10.0.0.2:32324"], ["10.0.1.2:32325"]]


def test_four_ranks_is_json_in_rank_order() -> None:
    order, hops = ring([C, A, D, B])
    hostfile = ring_hostfile(order, hops, 40000)
    assert hostfile == [["10.0.3.2:40000"], ["10.0.0.2:40001"], ["10.0.1.2:40002"], ["10.0.2.2:40003"]]
    assert json.loads(json.dumps(hostfile)) == hostfile
    assert ring_hostfile(order, hops, 40000) == hostfile  # deterministic


def test_missing_address_names_the_hop_and_node() -> None:
    order, hops = ring([A, B, C])
    hops[1] = replace(hops[1], dst_ipv4=None)
    with pytest.raises(MlxConfigError, match="hop 1 .*no IPv4 address for node c+.*p2pmesh links plan") as e:
        ring_hostfile(order, hops, 5000)
    assert (e.value.hop, e.value.node) == (1, C)


def test_ipv6_is_refused() -> None:
    order, hops = ring([A, B])
    hops[0] = replace(hops[0], dst_ipv4="fe80::1")
    with pytest.raises(MlxConfigError, match="IPv6.*IPv4-only") as e:
        ring_hostfile(order, hops, 5000)
    assert (e.value.hop, e.value.node) == (0, B)


@pytest.mark.parametrize("bad", ["mac-b.local", "10.0.0.300", "0.0.0.0", ""])
def test_non_literal_or_undialable_addresses_are_refused(bad: str) -> None:
    order, hops = ring([A, B])
    hops[0] = replace(hops[0], dst_ipv4=bad)
    with pytest.raises(MlxConfigError, match="hop 0"):
        ring_hostfile(order, hops, 5000)


def test_hops_that_do_not_chain_the_order_are_refused() -> None:
    order, hops = ring([A, B, C])
    hops[2] = hop(C, B, 2)
    with pytest.raises(MlxConfigError, match=r"hop 2 goes c+ -> b+ but the ring order says c+ -> a+") as e:
        ring_hostfile(order, hops, 5000)
    assert e.value.hop == 2
    with pytest.raises(MlxConfigError, match="needs 3 hops, got 2"):
        ring_hostfile(order, hops[:2], 5000)
    with pytest.raises(MlxConfigError, match="appears twice"):
        ring_hostfile([A, B, A], ring([A, B, A])[1], 5000)


def test_one_node_needs_no_group() -> None:
    # A one-entry hostfile makes MLX's ring dial itself and fail after ~31 s: refuse it.
    with pytest.raises(MlxConfigError, match="needs no MLX group"):
        ring_hostfile([A], [], 5000)
    with pytest.raises(MlxConfigError, match="needs no MLX group"):
        loopback_hostfile(1, 5000)


def test_ports_must_fit() -> None:
    order, hops = ring([A, B, C])
    with pytest.raises(MlxConfigError, match="outside"):
        ring_hostfile(order, hops, 65534)
    with pytest.raises(MlxConfigError, match="outside"):
        ring_hostfile(order, hops, 0)


def test_loopback_mixed_with_real_addresses_is_refused() -> None:
    order, hops = ring([A, B, C])
    hops[0] = replace(hops[0], dst_ipv4="127.0.0.1")
    with pytest.raises(MlxConfigError, match="rank 1 .*loopback") as e:
        ring_hostfile(order, hops, 5000)
    assert e.value.node == B


def test_loopback_hostfile() -> None:
    assert loopback_hostfile(3, 32323) == [["127.0.0.1:32323"], ["127.0.0.1:32324"], ["127.0.0.1:32325"]]


def test_all_loopback_hops_render_like_the_loopback_variant() -> None:
    order, hops = ring([A, B, C])
    hops = [replace(h, src_ipv4="127.0.0.1", dst_ipv4="127.0.0.1") for h in hops]
    assert ring_hostfile(order, hops, 6000) == loopback_hostfile(3, 6000)


@pytest.mark.parametrize("n", [3, 4])
def test_jaccl_ring_matrix_names_neighbours_only(n: int) -> None:
    order, hops = ring([A, B, C, D][:n], rdma=True)
    devices = jaccl_devices(order, hops)
    assert devices is not None
    assert len(devices) == n and all(len(row) == n for row in devices)
    for i in range(n):
        right, left = (i + 1) % n, (i - 1) % n
        assert devices[i][i] is None
        assert devices[i][right] == f"rdma_en{i}"  # rank i's end of hop i
        assert devices[i][left] == f"rdma_en{left + 10}"  # rank i's end of hop i-1
        for j in set(range(n)) - {i, left, right}:
            assert devices[i][j] is None


def test_jaccl_four_ranks_exact_matrix() -> None:
    order, hops = ring([A, B, C, D], rdma=True)
    assert jaccl_devices(order, hops) == [
        [None, "rdma_en0", None, "rdma_en13"],
        ["rdma_en10", None, "rdma_en1", None],
        [None, "rdma_en11", None, "rdma_en2"],
        ["rdma_en3", None, "rdma_en12", None],
    ]


def test_jaccl_two_ranks_use_one_cable_for_both_directions() -> None:
    order, hops = ring([A, B], rdma=True)
    # hop 1 is a second cable; JACCL pairs devices by index, so both ends name hop 0's.
    assert jaccl_devices(order, hops) == [[None, "rdma_en0"], ["rdma_en10", None]]


def test_jaccl_is_none_when_a_hop_lacks_rdma_or_an_interface() -> None:
    order, hops = ring([A, B, C], rdma=True)
    no_rdma = list(hops)
    no_rdma[1] = replace(hops[1], rdma=False)
    assert jaccl_devices(order, no_rdma) is None
    no_iface = list(hops)
    no_iface[2] = replace(hops[2], dst_interface=None)
    assert jaccl_devices(order, no_iface) is None
    with pytest.raises(MlxConfigError, match="hop 0 goes"):
        jaccl_devices([B, A, C], hops)


def test_jaccl_coordinator() -> None:
    order, hops = ring([A, B], rdma=True)
    assert jaccl_coordinator(order, hops, 32323) == "10.0.0.1:32323"  # rank 0's end of hop 0
    order3, hops3 = ring([A, B, C], rdma=True)
    with pytest.raises(MlxConfigError, match="rank 0 .*no cable address that all 3 ranks reach") as e:
        jaccl_coordinator(order3, hops3, 32323)
    assert e.value.node == A
    assert jaccl_coordinator(order3, hops3, 32323, rank0_address="192.168.1.20") == "192.168.1.20:32323"
    with pytest.raises(MlxConfigError, match="IPv4-only"):
        jaccl_coordinator(order3, hops3, 32323, rank0_address="::1")
    no_addr = [replace(hops[0], src_ipv4=None), hops[1]]
    with pytest.raises(MlxConfigError, match="hop 0 .*no IPv4 address for node a+"):
        jaccl_coordinator(order, no_addr, 32323)


# --------------------------------------------------------------------------------------
# Each member's own data port (issue 13: Macs started with different --data-port values)


def member(node: NodeId, data_port: int) -> Member:
    return Member(node, 1, True, True, (), Capabilities(1 << 30, "chip", data_port))


def test_each_rank_gets_its_own_members_data_port_plus_the_epoch_offset_and_its_rank() -> None:
    members = [member(A, 47100), member(B, 47150), member(C, 47000)]
    assert epoch_ports([A, B, C], members, 0, 1) == (47100, 47151, 47002)
    assert epoch_ports([B, C, A], members, 6, 1) == (47150 + 96, 47000 + 96 + 1, 47100 + 96 + 2)
    assert epoch_base_port(47100, 6 + 64) == epoch_base_port(47100, 6)  # 64 slots, reused


def test_every_member_renders_the_same_ports_whatever_its_own() -> None:
    """The renderer's own --data-port only stands in for members that advertised none."""
    members = [member(A, 47100), member(B, 47150)]
    assert epoch_ports([A, B], members, 3, 47000) == epoch_ports([A, B], members, 3, 31337)


def test_a_member_without_an_advertised_port_gets_the_renderers() -> None:
    """0: an agent from before data ports were advertised (and one missing from the state)."""
    assert epoch_ports([A, B, C], [member(A, 0), member(B, 47150)], 1, 40000) == (40016, 47167, 40018)


def test_the_hostfile_uses_the_given_ports() -> None:
    order, hops = ring([A, B, C])
    members = [member(A, 47100), member(B, 47150), member(C, 47000)]
    ports = epoch_ports(order, members, 2, 47000)
    assert ring_hostfile(order, hops, 47000, ports=ports) == [
        ["10.0.2.2:47132"], ["10.0.0.2:47183"], ["10.0.1.2:47034"]
    ]


def test_bad_ports_are_refused_naming_the_rank_and_node() -> None:
    order, hops = ring([A, B])
    with pytest.raises(MlxConfigError, match="needs 2 ports"):
        ring_hostfile(order, hops, 47000, ports=[47000])
    with pytest.raises(MlxConfigError, match=f"rank 1 \\(node {B}\\): port 70000") as e:
        ring_hostfile(order, hops, 47000, ports=[47000, 70000])
    assert e.value.node == B


def test_two_ranks_on_one_address_and_port_are_refused() -> None:
    """Possible only by mistake (two Macs' data ports one rank apart, on one address)."""
    both = [RingHop(A, B, "loopback", 1.0, None, None, None, "127.0.0.1", "127.0.0.1", False),
            RingHop(B, A, "loopback", 1.0, None, None, None, "127.0.0.1", "127.0.0.1", False)]
    with pytest.raises(MlxConfigError, match="like rank 1"):
        ring_hostfile([A, B], both, 47000, ports=[47001, 47001])
