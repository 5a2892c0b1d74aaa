"""Thunderbolt capture parsers against every real capture in tests/fixtures/thunderbolt.

Each expectation restates a fact from that folder's SOURCES.md (port count, which ports are
connected, Mac peer vs dock, speeds, peer domain UUIDs); the hostile-input tests pin that only
CaptureError ever escapes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pmesh.cli import links_cmd
from p2pmesh.platform.thunderbolt import (
    CaptureError,
    HardwarePort,
    TbPort,
    local_ports,
    parse_networksetup,
    parse_system_profiler,
    to_json,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "thunderbolt"

JSON_KEYS = {"port", "interface", "domain_uuid", "peer_domain_uuid", "connected", "speed_gbps"}


def _text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _sp(name: str) -> dict[str, TbPort]:
    ports = parse_system_profiler(_text(name))
    by_port = {p.port: p for p in ports}
    assert len(by_port) == len(ports)
    return by_port


def _connected(ports: dict[str, TbPort]) -> set[str]:
    return {k for k, p in ports.items() if p.connected}


# ---------------------------------------------------------------------------------------
# system_profiler -json, one test per capture


def test_m5max_mbp_peer_macstudio() -> None:
    ports = _sp("sp_macbookpro_m5max_peer_macstudio_m3ultra.json")
    assert set(ports) == {"1", "2", "3"}
    assert _connected(ports) == {"1"}
    p = ports["1"]
    assert (p.peer_kind, p.peer_name, p.peer_model) == ("mac", "Mac Studio", "Mac15,14")
    assert p.domain_uuid is not None and p.domain_uuid.startswith("817DCFA4")
    assert p.peer_domain_uuid is not None and p.peer_domain_uuid.startswith("28CA4C30")
    assert p.speed_gbps == 80.0
    for k in ("2", "3"):
        assert ports[k].speed_gbps is None and ports[k].max_speed_gbps == 120.0
        assert ports[k].peer_kind is None and ports[k].peer_domain_uuid is None


def test_m3ultra_studio_peer_mbp_and_envoy_ssd() -> None:
    ports = _sp("sp_macstudio_m3ultra_peer_macbookpro_m5max_envoy.json")
    assert set(ports) == {"1", "2", "3", "4", "5", "6"}
    assert _connected(ports) == {"2", "4"}
    mbp, ssd = ports["2"], ports["4"]
    assert (mbp.peer_kind, mbp.peer_model, mbp.speed_gbps) == ("mac", "Mac17,7", 80.0)
    assert mbp.peer_domain_uuid is not None and mbp.peer_domain_uuid.startswith("817DCFA4")
    assert mbp.domain_uuid is not None and mbp.domain_uuid.startswith("28CA4C30")
    assert (ssd.peer_kind, ssd.peer_name, ssd.speed_gbps) == ("device", "Envoy Ultra", 80.0)
    assert ssd.peer_domain_uuid is None  # a drive is never a peer Mac


def test_the_two_omlx_captures_point_at_each_other() -> None:
    mbp = _sp("sp_macbookpro_m5max_peer_macstudio_m3ultra.json")["1"]
    studio = _sp("sp_macstudio_m3ultra_peer_macbookpro_m5max_envoy.json")["2"]
    assert mbp.peer_domain_uuid == studio.domain_uuid
    assert studio.peer_domain_uuid == mbp.domain_uuid


def test_macmini_peer_mbp_and_studio_display() -> None:
    ports = _sp("sp_macmini_m4pro_macos27_peer_macbookpro_studiodisplay.json")
    assert set(ports) == {"1", "2", "3"}
    assert _connected(ports) == {"2", "3"}
    assert (ports["2"].peer_kind, ports["2"].peer_model, ports["2"].speed_gbps) == ("mac", "Mac17,6", 40.0)
    assert ports["2"].peer_domain_uuid is not None and ports["2"].peer_domain_uuid.startswith("BC5DEC53")
    disp = ports["3"]
    assert (disp.peer_kind, disp.peer_name, disp.speed_gbps, disp.peer_domain_uuid) == (
        "device", "Studio Display", 20.0, None)
    assert ports["1"].peer_kind is None


@pytest.mark.parametrize(
    "name",
    ["sp_macbookpro_m3pro_macos27_nothing_connected.json", "sp_macbookpro_macos26_6_nothing_connected_with_spusb.json"],
)
def test_nothing_connected_tb4(name: str) -> None:
    ports = _sp(name)
    assert set(ports) == {"1", "2", "3"}
    assert _connected(ports) == set()
    for p in ports.values():
        assert (p.speed_gbps, p.max_speed_gbps, p.peer_kind, p.peer_domain_uuid) == (None, 40.0, None, None)
        assert p.domain_uuid  # every bus still has its own domain
    assert len({p.domain_uuid for p in ports.values()}) == 3


def test_intel_tb2_two_receptacles_on_one_bus() -> None:
    ports = _sp("sp_intel_macbookpro_tb2_sequoia_tb_gigabit_adapter.json")
    assert set(ports) == {"1", "2"}
    assert _connected(ports) == {"1"}
    assert ports["1"].domain_uuid == ports["2"].domain_uuid  # one controller, one domain
    adapter = ports["1"]
    assert (adapter.peer_kind, adapter.peer_name, adapter.speed_gbps) == (
        "device", "Thunderbolt to Gigabit Ethernet Adapter", 10.0)
    assert (ports["2"].max_speed_gbps, ports["2"].peer_kind) == (20.0, None)


def test_tb4_lg_ultrafine_display() -> None:
    ports = _sp("sp_macbookpro_tb4_tahoe_lg_ultrafine.json")
    assert set(ports) == {"1", "2", "3"}  # the display's own downstream port is not ours
    assert _connected(ports) == {"2"}
    assert (ports["2"].peer_kind, ports["2"].peer_name, ports["2"].speed_gbps) == ("device", "UltraFine 4K", 40.0)


def test_tb5_ugreen_dock() -> None:
    ports = _sp("sp_macbookpro_tb5_tahoe_ugreen_tb4_dock.json")
    assert set(ports) == {"1", "2", "3"}  # the dock's receptacle_2/3/4 are not ours
    assert _connected(ports) == {"1"}
    dock = ports["1"]
    assert (dock.peer_kind, dock.peer_name, dock.speed_gbps, dock.peer_domain_uuid) == (
        "device", "Thunderbolt 4 Docking Station (8-in-1)", 40.0, None)


def test_osaurus_pair_mac_peer_and_docks() -> None:
    a = _sp("sp_macbookpro_m5max_A_anonymized_peer_sabrent_tb5_dock.json")
    b = _sp("sp_macbookpro_m5max_B_anonymized_peer_acasis_tb3_dock.json")
    for ports in (a, b):
        assert set(ports) == {"1", "2", "3"}
        assert _connected(ports) == {"2", "3"}
        assert (ports["2"].peer_kind, ports["2"].peer_model, ports["2"].speed_gbps) == ("mac", "Mac17,6", 80.0)
        assert ports["3"].peer_kind == "device" and ports["3"].peer_domain_uuid is None
    assert a["2"].domain_uuid == "00000004-0000-4000-8000-000000000004"
    assert a["2"].peer_domain_uuid == "00000003-0000-4000-8000-000000000003"
    assert (b["2"].peer_domain_uuid, b["2"].domain_uuid) == (a["2"].domain_uuid, a["2"].peer_domain_uuid)
    assert (a["3"].peer_name, a["3"].speed_gbps) == ("SB-XTM5", 80.0)
    assert (b["3"].peer_name, b["3"].speed_gbps) == ("TBU405Pro", 40.0)


def test_pyrepr_studio_direct_mac_and_mac_behind_dock() -> None:
    ports = _sp("sp_macstudio_m3ultra_trimmed_pyrepr_peer_direct_and_via_thunderbay_dock.txt")
    assert set(ports) == {"1", "2", "3", "4", "5", "6"}
    assert _connected(ports) == {"2", "3", "6"}
    assert (ports["6"].peer_kind, ports["6"].peer_model, ports["6"].speed_gbps) == ("mac", "Mac16,5", 80.0)
    # The MBP nested under the ThunderBay is not a direct cable: port 3's peer is the dock.
    assert (ports["3"].peer_kind, ports["3"].peer_name, ports["3"].speed_gbps) == ("device", "ThunderBay Flex 8", 40.0)
    assert (ports["2"].peer_kind, ports["2"].peer_name) == ("device", "Mercury Helios 3S")
    # The author trimmed every UUID away.
    assert all(p.domain_uuid is None and p.peer_domain_uuid is None for p in ports.values())


def test_pyrepr_mbp_two_cables_to_the_same_studio() -> None:
    ports = _sp("sp_macbookpro_m4max_trimmed_pyrepr_two_links_to_macstudio.txt")
    assert set(ports) == {"1", "2", "3"}
    assert _connected(ports) == {"2", "3"}
    assert {(ports[k].peer_kind, ports[k].peer_model) for k in ("2", "3")} == {("mac", "Mac15,14")}
    assert (ports["2"].speed_gbps, ports["3"].speed_gbps) == (80.0, 40.0)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("sp_text_*")))
def test_text_format_is_refused_with_a_hint(name: str) -> None:
    with pytest.raises(CaptureError, match="text format.*-json"):
        parse_system_profiler(_text(name))


# ---------------------------------------------------------------------------------------
# networksetup


def _tb_map(name: str) -> dict[str, str]:
    return {p.name: p.device for p in parse_networksetup(_text(name)) if p.name.startswith("Thunderbolt")}


def test_networksetup_m5max_verbatim_non_sequential_and_dock_nics() -> None:
    tb = _tb_map("networksetup_macbookpro_m5max_macos26_5_tb_dock_nic_usb_lan.txt")
    assert tb == {
        "Thunderbolt Bridge": "bridge0",
        "Thunderbolt 1": "en1",
        "Thunderbolt 2": "en6",
        "Thunderbolt 3": "en2",
        "Thunderbolt Ethernet Slot 0": "en10",
        "Thunderbolt Ethernet Slot 1, Port 1": "en11",
    }
    ports = parse_networksetup(_text("networksetup_macbookpro_m5max_macos26_5_tb_dock_nic_usb_lan.txt"))
    assert HardwarePort("USB 10/100/1G/2.5G/5G/10G LAN", "en16", "f4:4d:ad:08:5b:c6") in ports
    assert len(ports) == 9


def test_networksetup_m5max_anonymized() -> None:
    ports = parse_networksetup(_text("networksetup_macbookpro_m5max_anonymized.txt"))
    assert {p.name: p.device for p in ports} == {
        "Ethernet Adapter (en3)": "en3", "Thunderbolt Bridge": "bridge0", "Wi-Fi": "en0",
        "Thunderbolt 1": "en1", "Thunderbolt 2": "en6", "Thunderbolt 3": "en2",
    }
    assert all(p.mac is not None and p.mac.startswith("02:00:00:00:00:0") for p in ports)


def test_networksetup_studio_trimmed_six_tb_no_bridge_no_macs() -> None:
    ports = parse_networksetup(_text("networksetup_macstudio_m3ultra_trimmed_no_mac_addresses.txt"))
    assert _tb_map("networksetup_macstudio_m3ultra_trimmed_no_mac_addresses.txt") == {
        f"Thunderbolt {n}": f"en{n + 1}" for n in range(1, 7)}
    assert all(p.mac is None for p in ports)
    assert len(ports) == 14


def test_networksetup_m4max_trimmed() -> None:
    ports = parse_networksetup(_text("networksetup_macbookpro_m4max_trimmed_no_mac_addresses.txt"))
    assert _tb_map("networksetup_macbookpro_m4max_trimmed_no_mac_addresses.txt") == {
        "Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt 3": "en3"}
    assert HardwarePort("Wi-Fi", "en0", None) in ports
    assert HardwarePort("USB 10/100/1G/2.5G LAN", "en7", None) in ports


@pytest.mark.parametrize(
    ("name", "expected", "count"),
    [
        ("networksetup_macbookpro16_m1_2021_macos14_4_glpi.txt",
         {"Thunderbolt Bridge": "bridge0", "Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt 3": "en3"}, 7),
        ("networksetup_macbookpro_m1pro_2021_macos14_5_lenovo_dock_glpi.txt",
         {"Thunderbolt Bridge": "bridge0", "Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt 3": "en3"}, 9),
        ("networksetup_intel_macbookpro16_2019_catalina_4_tb_ports_glpi.txt",
         {"Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt 3": "en3", "Thunderbolt 4": "en4",
          "Thunderbolt Bridge": "bridge0"}, 9),
        ("networksetup_intel_imac27_2019_macos10_14_6_glpi.txt",
         {"Thunderbolt 1": "en2", "Thunderbolt 2": "en3", "Thunderbolt Bridge": "bridge0"}, 6),
        ("networksetup_mac_2020_two_tb_ports_partial.txt",
         {"Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt Bridge": "bridge0"}, 6),
    ],
)
def test_networksetup_glpi_and_issue_captures(name: str, expected: dict[str, str], count: int) -> None:
    ports = parse_networksetup(_text(name))
    assert _tb_map(name) == expected
    assert len(ports) == count
    assert all(p.mac is None or p.mac == p.mac.strip() for p in ports)  # trailing space dropped


def test_networksetup_lenovo_dock_nic_and_anonymised_macs() -> None:
    ports = parse_networksetup(_text("networksetup_macbookpro_m1pro_2021_macos14_5_lenovo_dock_glpi.txt"))
    assert HardwarePort("ThinkPad Lan", "en8", "AA:AA:AA:AA:AA:DA") in ports


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("ifconfig_*")))
def test_ifconfig_captures_are_not_mistaken_for_either_format(name: str) -> None:
    with pytest.raises(CaptureError):
        parse_networksetup(_text(name))
    with pytest.raises(CaptureError):
        parse_system_profiler(_text(name))


def test_every_fixture_file_is_covered() -> None:
    # A new capture dropped into the folder must get a test: fail loudly rather than skip it.
    covered_prefixes = ("sp_", "networksetup_", "ifconfig_")
    names = {p.name for p in FIXTURES.iterdir()} - {"SOURCES.md"}
    assert names and all(n.startswith(covered_prefixes) for n in names)
    sp_json = {n for n in names if n.startswith("sp_") and not n.startswith("sp_text_")}
    assert len(sp_json) == 12
    for n in sorted(names):
        if n.startswith("sp_") and not n.startswith("sp_text_"):
            assert parse_system_profiler(_text(n))
        elif n.startswith("networksetup_"):
            assert parse_networksetup(_text(n))


# ---------------------------------------------------------------------------------------
# the join


def test_local_ports_studio_joins_receptacle_n_to_thunderbolt_n() -> None:
    ports = local_ports(
        _text("sp_macstudio_m3ultra_trimmed_pyrepr_peer_direct_and_via_thunderbay_dock.txt"),
        _text("networksetup_macstudio_m3ultra_trimmed_no_mac_addresses.txt"),
    )
    assert [(p.port, p.interface) for p in ports] == [(str(n), f"en{n + 1}") for n in range(1, 7)]


def test_local_ports_osaurus_a_non_sequential_interfaces() -> None:
    ports = local_ports(
        _text("sp_macbookpro_m5max_A_anonymized_peer_sabrent_tb5_dock.json"),
        _text("networksetup_macbookpro_m5max_anonymized.txt"),
    )
    by_port = {p.port: p for p in ports}
    assert {k: p.interface for k, p in by_port.items()} == {"1": "en1", "2": "en6", "3": "en2"}
    assert by_port["2"].peer_domain_uuid == "00000003-0000-4000-8000-000000000003"
    rows = to_json(ports)
    assert all(set(r) == JSON_KEYS for r in rows)
    assert json.loads(json.dumps(rows)) == rows


def test_local_ports_without_networksetup_or_missing_entry() -> None:
    sp = _text("sp_macstudio_m3ultra_peer_macbookpro_m5max_envoy.json")
    assert all(p.interface is None for p in local_ports(sp, None))
    # A 3-port networksetup against a 6-port Studio: ports 4-6 have no match.
    ports = local_ports(sp, _text("networksetup_macbookpro_m4max_trimmed_no_mac_addresses.txt"))
    assert [p.interface for p in ports] == ["en1", "en2", "en3", None, None, None]


# ---------------------------------------------------------------------------------------
# hostile and malformed input


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("\x00\xff\xfe garbage", "neither JSON"),
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ("{}", "no 'SPThunderboltDataType'"),
        ('{"SPThunderboltDataType": {}}', "must be a list"),
        ('{"SPThunderboltDataType": [], "hello": 1}', "unknown top-level key 'hello'"),
        ('{"SPThunderboltDataType": [1]}', r"\[0\] must be an object"),
        ('{"SPThunderboltDataType": [{}]}', "missing '_name'"),
        ('{"SPThunderboltDataType": [{"_name": "b"}]}', "no receptacle_N_tag"),
        ('{"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": {}}]}', "missing 'receptacle_status_key'"),
        ('{"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": []}]}', "must be an object"),
        (('{"SPThunderboltDataType": [{"_name": "b", "domain_uuid_key": 5, '
         '"receptacle_1_tag": {"receptacle_status_key": "x"}}]}'), "domain_uuid_key must be a string"),
        (('{"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": '
         '{"receptacle_status_key": "x", "current_speed_key": "fast"}}]}'), "unrecognised speed"),
        (('{"SPThunderboltDataType": [{"_name": "b", "_items": {}, '
         '"receptacle_1_tag": {"receptacle_status_key": "x"}}]}'), "_items must be a list"),
        ("{'SPThunderboltDataType': [", "ends early"),
        ("{'SPThunderboltDataType': []} extra", "unexpected text"),
        ("{'a' 'b'}", "expected ':'"),
        ("[" * 5000, "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("{'x': " + "[" * 5000, "nested too deeply"),
        ('{"SPThunderboltDataType": ' + "[" * 100000 + "]" * 100000 + "}", "not valid JSON|must be an object"),
    ],
)
def test_system_profiler_bad_input(text: str, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        parse_system_profiler(text)


def test_duplicate_receptacle_is_refused() -> None:
    buses = [{"_name": f"b{i}", "receptacle_1_tag": {"receptacle_status_key": "x", "receptacle_id_key": "1"}}
             for i in range(2)]
    with pytest.raises(CaptureError, match="appears twice"):
        parse_system_profiler(json.dumps({"SPThunderboltDataType": buses}))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("hello world", "not 'Field: value'"),
        ("Device: en0\n", "before any 'Hardware Port'"),
        ("Hardware Port: Wi-Fi\n", "has no 'Device'"),
        ("Hardware Port: Wi-Fi\nDevice: en0\nDevice: en1\n", "repeated"),
        ("VLAN Configurations\n===\n", "no 'Hardware Port' entries"),
        ('{"SPThunderboltDataType": []}', "not 'Field: value'"),
    ],
)
def test_networksetup_bad_input(text: str, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        parse_networksetup(text)


def test_non_str_input_is_a_capture_error() -> None:
    with pytest.raises(CaptureError):
        parse_system_profiler(b"{}")  # type: ignore[arg-type]
    with pytest.raises(CaptureError):
        parse_networksetup(None)  # type: ignore[arg-type]


_structured = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(
        st.sampled_from(["_name", "_items", "receptacle_1_tag", "receptacle_id_key", "receptacle_status_key",
                         "current_speed_key", "domain_uuid_key", "services_title", "SPThunderboltDataType"]),
        inner,
        max_size=5,
    ),
    max_leaves=20,
)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.text(max_size=300) | _structured.map(json.dumps) | _structured.map(repr))
def test_random_text_only_raises_capture_error(text: str) -> None:
    for parse in (parse_system_profiler, parse_networksetup):
        try:
            parse(text)
        except CaptureError:
            pass
    try:
        to_json(local_ports(text, text))
    except CaptureError:
        pass


# ---------------------------------------------------------------------------------------
# the `links parse` command


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="p2pmesh")
    links_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["links", "parse", *argv])


def test_links_parse_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--system-profiler", str(FIXTURES / "sp_macbookpro_m5max_B_anonymized_peer_acasis_tb3_dock.json"),
                 "--networksetup", str(FIXTURES / "networksetup_macbookpro_m5max_anonymized.txt"), "--json")
    assert links_cmd.run(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [set(r) for r in rows] == [JSON_KEYS] * 3
    assert rows[1] == {"port": "2", "interface": "en6", "domain_uuid": "00000003-0000-4000-8000-000000000003",
                       "peer_domain_uuid": "00000004-0000-4000-8000-000000000004", "connected": True,
                       "speed_gbps": 80.0}


def test_links_parse_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--system-profiler", str(FIXTURES / "sp_macbookpro_m5max_peer_macstudio_m3ultra.json"))
    assert links_cmd.run(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[0] == "PORT" and len(out) == 4
    assert "28CA4C30-A263-4C55-B302-953416D0B209" in out[1]


def test_links_parse_bad_and_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe not text")
    assert links_cmd.run(_args("--system-profiler", str(bad), "--json")) == 2
    assert capsys.readouterr().err.startswith("p2pmesh: system_profiler file")
    bad.write_text('{"SPThunderboltDataType": 3}')
    assert links_cmd.run(_args("--system-profiler", str(bad))) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2pmesh: SPThunderboltDataType must be a list") and "bad.json" in err
    assert links_cmd.run(_args("--system-profiler", str(tmp_path / "nope.json"))) == 2
    assert "cannot read system_profiler file" in capsys.readouterr().err
