"""Bridge membership from real `ifconfig` captures (tests/fixtures/thunderbolt, see its
SOURCES.md) and the warning for a bridge that joins two ring cables."""
from __future__ import annotations

from pathlib import Path

from p2pmesh.core.addressing import (
    bridge_warnings,
    parse_ifconfig_bridge_members,
    parse_ifconfig_ipv4,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "thunderbolt"


def _text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_macmini_ifconfig_bridge0_three_members_space_indented() -> None:
    # `ifconfig bridge0` alone, tabs rendered as 8 spaces in the issue it came from.
    text = _text("ifconfig_bridge0_macmini_3_tb_members_mtu9000.txt")
    assert parse_ifconfig_bridge_members(text) == {"bridge0": ["en2", "en3", "en4"]}
    assert parse_ifconfig_ipv4(text) == {"bridge0": ("10.25.0.1/24",)}


def test_intel_mbp_ifconfig_a_bridge0_four_members_and_bridge100() -> None:
    text = _text("ifconfig_intel_macbookpro_bridge0_4_tb_members.txt")
    assert parse_ifconfig_bridge_members(text) == {"bridge0": ["en1", "en2", "en3", "en4"], "bridge100": ["en10"]}
    ipv4 = parse_ifconfig_ipv4(text)
    assert ipv4 == {"lo0": ("127.0.0.1/8",), "bridge100": ("192.168.64.1/24",)}


def test_m1_mbp_ifconfig_a_bridge0_three_members() -> None:
    text = _text("ifconfig_macbookpro16_m1_2021_macos14_4_bridge0_3_tb_members_glpi.txt")
    assert parse_ifconfig_bridge_members(text) == {"bridge0": ["en1", "en2", "en3"]}
    assert parse_ifconfig_ipv4(text)["en0"] == ("192.168.2.46/24",)


def test_two_ring_cables_in_thunderbolt_bridge_warn_with_a_manual_fix() -> None:
    bridges = parse_ifconfig_bridge_members(_text("ifconfig_bridge0_macmini_3_tb_members_mtu9000.txt"))
    [warning] = bridge_warnings(bridges, ["en3", "en2"])
    assert "bridge0" in warning and "en2, en3" in warning
    assert "loop" in warning and "broadcast" in warning
    assert "System Settings > Network > Thunderbolt Bridge" in warning
    assert "sudo ifconfig bridge0 deletem en2; sudo ifconfig bridge0 deletem en3" in warning
    assert "p2pmesh changes nothing" in warning


def test_one_ring_cable_in_a_bridge_or_none_does_not_warn_on_macos() -> None:
    bridges = parse_ifconfig_bridge_members(_text("ifconfig_intel_macbookpro_bridge0_4_tb_members.txt"))
    assert bridge_warnings(bridges, ["en2"]) == []
    assert bridge_warnings(bridges, ["en7", "en8"]) == []
    assert bridge_warnings(bridges, []) == []
    # en10 sits in bridge100 (VM sharing) alone: no loop.
    assert bridge_warnings(bridges, ["en10", "en9"]) == []


def test_linux_bridge_listing_warns_for_any_ring_port() -> None:
    # The driver builds this from /sys/class/net/<bridge>/brif/.
    bridges = {"br0": ["thunderbolt0", "thunderbolt1"], "docker0": ["veth1"]}
    [both] = bridge_warnings(bridges, ["thunderbolt0", "thunderbolt1"], platform="linux")
    assert "br0" in both and "ip link set dev thunderbolt0 nomaster" in both
    [one] = bridge_warnings(bridges, ["thunderbolt1"], platform="linux")
    assert "ignores addresses on bridge ports" in one
    assert bridge_warnings(bridges, ["eth0"], platform="linux") == []


def test_parser_ignores_noise_and_handles_empty_bridges() -> None:
    text = "bridge7: flags=8863<UP> mtu 1500\n\tstatus: inactive\nen0: flags=8863<UP> mtu 1500\n\tmember: bogus\n"
    # en0 is not a bridge but lists a member line: it is reported as holding it.
    assert parse_ifconfig_bridge_members(text) == {"bridge7": [], "en0": ["bogus"]}
    assert parse_ifconfig_bridge_members("") == {}
    assert parse_ifconfig_bridge_members("\tmember: en2 flags=3\n") == {}
