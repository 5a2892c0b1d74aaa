"""Port detection parsers: Linux sysfs snapshots and `ip -j` output, the bench marker, and the
macOS assembly (ifconfig, ibv_devices, system_profiler + networksetup).

The Linux snapshots follow the kernel's layout (drivers/thunderbolt: XDomain "N-R" under the
host router "N-0" in "domainN", thunderbolt-net bound to the service "N-R.S"); the macOS
tests use the real captures in tests/fixtures/thunderbolt (see SOURCES.md there). The
hostile-input tests pin that only CaptureError ever escapes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2pmesh.core.messages import PortInfo
from p2pmesh.platform.linux_links import (
    BenchMarker,
    bench_alias,
    linux_ports,
    macos_ports,
    parse_bench_alias,
    parse_ibv_devices,
    parse_ifconfig,
    parse_ip_addr_json,
)
from p2pmesh.platform.thunderbolt import CaptureError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "thunderbolt"

HOST0 = "d1b3a4c0-1f2e-4d5c-8b7a-0123456789ab"  # our router in domain0 (kernel prints lower case)
HOST1 = "e2c4b5d1-2a3b-4c5d-9e8f-112233445566"  # our router in domain1
PEER_A = "817dcfa4-b481-4100-80fc-91c7aa969f0b"
PEER_B = "28ca4c30-a263-4c55-b302-953416d0b209"
PCI = "devices/pci0000:00/0000:00:0d.2"
PCI1 = "devices/pci0000:00/0000:00:0d.3"


def _ip_json(addrs: dict[str, list[tuple[str, int]]]) -> str:
    """What `ip -j -4 addr show` prints for these interfaces."""
    out = []
    for i, (name, items) in enumerate(addrs.items(), 1):
        out.append(
            {
                "ifindex": i,
                "ifname": name,
                "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
                "mtu": 1500,
                "operstate": "UP",
                "addr_info": [
                    {"family": "inet", "local": a, "prefixlen": p, "scope": "global", "label": name}
                    for a, p in items
                ],
            }
        )
    return json.dumps(out)


def _iface(name: str, *, carrier: str | None = "1\n", operstate: str = "up\n", speed: str | None = None,
           device: str | None = None, alias: str = "\n", type_: str = "1\n") -> dict[str, str]:
    base = f"class/net/{name}"
    snap = {f"{base}/": "", f"{base}/operstate": operstate, f"{base}/ifalias": alias, f"{base}/type": type_}
    if carrier is not None:
        snap[f"{base}/carrier"] = carrier
    if speed is not None:
        snap[f"{base}/speed"] = speed
    if device is not None:
        snap[f"{base}/device@"] = device
    return snap


def _tb_host_with_two_peers() -> dict[str, str]:
    """Two controllers (domain0, domain1), one Mac cabled to each; thunderbolt-net made
    thunderbolt0 and thunderbolt1."""
    snap: dict[str, str] = {}
    snap |= _iface("thunderbolt0", device=f"{PCI}/domain0/0-0/0-1/0-1.0")
    snap |= _iface("thunderbolt1", device=f"{PCI1}/domain1/1-0/1-3/1-3.0")
    tb = "bus/thunderbolt/devices"
    snap |= {
        f"{tb}/0-0/unique_id": HOST0 + "\n",
        f"{tb}/0-0/rx_speed": "20.0 Gb/s\n",  # a router's own link attributes: not used
        f"{tb}/0-1/unique_id": PEER_A + "\n",
        f"{tb}/0-1/rx_speed": "20.0 Gb/s\n",
        f"{tb}/0-1/rx_lanes": "2\n",
        f"{tb}/0-1/tx_speed": "20.0 Gb/s\n",
        f"{tb}/0-1/tx_lanes": "2\n",
        f"{tb}/1-0/unique_id": HOST1 + "\n",
        f"{tb}/1-3/unique_id": PEER_B + "\n",
        f"{tb}/1-3/rx_speed": "10.0 Gb/s\n",
        f"{tb}/1-3/rx_lanes": "2\n",
        f"{tb}/1-3/tx_speed": "10.0 Gb/s\n",
        f"{tb}/1-3/tx_lanes": "1\n",  # asymmetric: the slower direction wins
    }
    return snap


# ---------------------------------------------------------------------------------------
# Linux: thunderbolt-net


def test_thunderbolt_net_two_interfaces_two_peers() -> None:
    ip = _ip_json({"lo": [("127.0.0.1", 8)], "thunderbolt0": [("169.254.10.1", 30)], "thunderbolt1": []})
    ports = linux_ports(_tb_host_with_two_peers(), ip)
    assert ports == [
        PortInfo("thunderbolt0", "thunderbolt", HOST0.upper(), PEER_A.upper(), True, 40.0, ("169.254.10.1/30",), False),
        PortInfo("thunderbolt1", "thunderbolt", HOST1.upper(), PEER_B.upper(), True, 10.0, (), False),
    ]


def test_thunderbolt_net_whose_xdomain_vanished_keeps_the_kind_without_uuids() -> None:
    # Unplugging races the snapshot: the interface is still there, the XDomain is gone.
    snap = _iface("thunderbolt0", carrier="0\n", operstate="down\n", device=f"{PCI}/domain0/0-0/0-1/0-1.0")
    (port,) = linux_ports(snap, "[]")
    assert (port.kind, port.domain_uuid, port.peer_domain_uuid, port.up, port.gbps) == ("thunderbolt", None, None, False, None)


def test_xdomain_behind_a_dock_still_names_the_peer() -> None:
    # A Mac behind a dock: XDomain 0-301 hangs off the dock's switch 0-1.
    snap = _iface("thunderbolt0", device=f"{PCI}/domain0/0-0/0-1/0-301/0-301.0")
    snap |= {"bus/thunderbolt/devices/0-0/unique_id": HOST0, "bus/thunderbolt/devices/0-301/unique_id": PEER_A}
    (port,) = linux_ports(snap, "[]")
    assert (port.domain_uuid, port.peer_domain_uuid, port.gbps) == (HOST0.upper(), PEER_A.upper(), None)


@pytest.mark.parametrize(
    "device",
    [
        f"{PCI}/domain0/0-0/0-1",  # the XDomain itself, not a service
        f"{PCI}/domain0/0-0/0-1/0-2.0",  # the service does not belong to its parent
        f"{PCI}/domain1/1-0/0-1/0-1.0",  # service of domain 0 under domain1
        "devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0",  # a USB NIC
        f"{PCI}/domain0/0-0/0-0.0",  # route 0 is the host router, never an XDomain
    ],
)
def test_only_xdomain_services_are_thunderbolt_net(device: str) -> None:
    (port,) = linux_ports(_iface("eth9", device=device, speed="1000\n"), "[]")
    assert (port.kind, port.gbps) == ("ethernet", 1.0)


# ---------------------------------------------------------------------------------------
# Linux: the bench marker


def test_bench_marked_veths_are_thunderbolt_cable_ends() -> None:
    u0, u1 = "11111111-0000-4000-8000-000000000001", "22222222-0000-4000-8000-000000000002"
    snap = _iface("tb0a0", alias=bench_alias(u0, u1, 40) + "\n", speed="10000\n")
    snap |= _iface("tb1a0", alias=bench_alias(u0, "host-2", 20.5) + "\n", carrier=None, operstate="down\n")
    snap |= _iface("veth9", alias="my own alias\n")  # an unmarked veth: virtual, skipped
    ports = linux_ports(snap, _ip_json({"tb0a0": [("10.77.0.1", 30)], "tb1a0": [("10.77.1.1", 30)]}))
    assert ports == [
        PortInfo("tb0a0", "thunderbolt", u0, u1, True, 40.0, ("10.77.0.1/30",), False),
        PortInfo("tb1a0", "thunderbolt", u0, "host-2", False, 20.5, ("10.77.1.1/30",), False),
    ]


@pytest.mark.parametrize("gbps", [40, 40.0, 0.001, 80.5, 999_999.0])
def test_bench_alias_round_trips(gbps: float) -> None:
    text = bench_alias("dom-A", "dom-B", gbps)
    assert text.startswith("p2pmesh:thunderbolt domain=dom-A peer=dom-B gbps=")
    assert parse_bench_alias(text + "\n") == BenchMarker("dom-A", "dom-B", float(gbps))


@settings(max_examples=300, deadline=None)
@given(gbps=st.floats(min_value=1e-9, max_value=999_999.999), token=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", fullmatch=True))
@example(gbps=0.0011342218512026372, token="a")
def test_bench_alias_round_trips_any_valid_value(gbps: float, token: str) -> None:
    assert parse_bench_alias(bench_alias(token, "peer", gbps)) == BenchMarker(token, "peer", gbps)


@pytest.mark.parametrize(
    "domain,peer,gbps",
    [("", "b", 1.0), ("a b", "b", 1.0), ("a", "b=c", 1.0), ("a", "b", 0), ("a", "b", -3.0),
     ("a", "b", float("inf")), ("a", "b", float("nan")), ("a", "b", 1e6), ("a", "b", True), ("x" * 65, "b", 1.0)],
)
def test_bench_alias_refuses_what_the_parser_would_refuse(domain: str, peer: str, gbps: float) -> None:
    with pytest.raises(ValueError):
        bench_alias(domain, peer, gbps)


def test_an_ordinary_alias_is_not_a_marker() -> None:
    assert parse_bench_alias("uplink to the rack switch\n") is None
    assert parse_bench_alias("") is None


@pytest.mark.parametrize(
    "alias",
    ["p2pmesh:thunderbolt", "p2pmesh:ethernet domain=a peer=b gbps=1", "p2pmesh:thunderbolt domain=a peer=b gbps=fast",
     "p2pmesh:thunderbolt domain=a peer=b gbps=0", "p2pmesh:thunderbolt domain=a peer=b gbps=1e9",
     "p2pmesh:thunderbolt peer=b domain=a gbps=1", "p2pmesh:thunderbolt domain=-a peer=b gbps=1"],
)
def test_a_broken_marker_is_an_error_not_an_alias(alias: str) -> None:
    with pytest.raises(CaptureError):
        parse_bench_alias(alias)
    with pytest.raises(CaptureError):
        linux_ports(_iface("veth0", alias=alias), "[]")


# ---------------------------------------------------------------------------------------
# Linux: other interfaces


def test_wifi_ethernet_and_what_is_skipped() -> None:
    snap: dict[str, str] = {}
    snap |= _iface("lo", type_="772\n", operstate="unknown\n")
    snap |= _iface("enp3s0", device="devices/pci0000:00/0000:00:1c.0/0000:03:00.0", speed="2500\n")
    snap |= _iface("eno1", device="devices/pci0000:00/0000:00:1f.6", speed="-1\n", carrier="0\n", operstate="down\n")
    snap |= _iface("wlp0s20f3", device="devices/pci0000:00/0000:00:14.3")
    snap["class/net/wlp0s20f3/phy80211@"] = "devices/pci0000:00/0000:00:14.3/ieee80211/phy0"
    snap |= _iface("wlan1", device="devices/pci0000:00/0000:00:14.0/usb1/1-2/1-2:1.0", speed="0\n")
    snap["class/net/wlan1/wireless/"] = ""
    snap |= _iface("docker0")  # bridge: no device link
    snap |= _iface("br0", speed="10000\n")
    snap |= _iface("vethab12")
    snap |= _iface("wwan0", device="devices/pci0000:00/0000:00:1c.4/0000:05:00.0", type_="519\n")
    ip = _ip_json({"enp3s0": [("192.168.1.20", 24), ("10.0.0.5", 8)], "docker0": [("172.17.0.1", 16)], "wlp0s20f3": [("192.168.1.21", 24)]})
    assert linux_ports(snap, ip) == [
        PortInfo("eno1", "ethernet", None, None, False, None, (), False),
        PortInfo("enp3s0", "ethernet", None, None, True, 2.5, ("192.168.1.20/24", "10.0.0.5/8"), False),
        PortInfo("wlan1", "wifi", None, None, True, None, (), False),
        PortInfo("wlp0s20f3", "wifi", None, None, True, None, ("192.168.1.21/24",), False),
    ]


@pytest.mark.parametrize(
    "carrier,operstate,up",
    [("1\n", "up\n", True), ("0\n", "lowerlayerdown\n", False), (None, "down\n", False), (None, "up\n", True),
     ("1\n", "unknown\n", True), (None, "unknown\n", False), ("0\n", "up\n", False)],
)
def test_carrier_then_operstate(carrier: str | None, operstate: str, up: bool) -> None:
    (port,) = linux_ports(_iface("eth0", carrier=carrier, operstate=operstate, device="devices/pci0000:00/0000:00:03.0/virtio2"), "[]")
    assert port.up is up


def test_no_carrier_and_no_operstate_is_down() -> None:
    (port,) = linux_ports({"class/net/eth0/": "", "class/net/eth0/device@": "devices/x/0000:00:03.0"}, "[]")
    assert port.up is False and port.kind == "ethernet"


def test_ports_sort_naturally() -> None:
    snap: dict[str, str] = {}
    for name in ("eth10", "eth2", "eth1"):
        snap |= _iface(name, device=f"devices/pci/{name}")
    assert [p.interface for p in linux_ports(snap, "[]")] == ["eth1", "eth2", "eth10"]


# ---------------------------------------------------------------------------------------
# ip -j -4 addr show


def test_ip_json_real_shape_with_empty_entries_and_other_families() -> None:
    text = json.dumps([
        {},  # older iproute2 prints one per interface the -4 filter dropped
        {"ifindex": 1, "ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifindex": 3, "link": "vb", "ifname": "va", "flags": ["M-DOWN"],
         "addr_info": [{"family": "inet6", "local": "fe80::1", "prefixlen": 64},
                       {"family": "inet", "local": "10.9.0.1", "prefixlen": 30}]},
        {"ifindex": 3, "ifname": "va", "addr_info": [{"family": "inet", "local": "10.9.0.1", "prefixlen": 30}]},
        {"ifindex": 4, "ifname": "vc"},
    ])
    assert parse_ip_addr_json(text) == {"lo": ("127.0.0.1/8",), "va": ("10.9.0.1/30",), "vc": ()}
    assert parse_ip_addr_json("[]") == {}


def test_ip_json_keeps_at_most_sixteen_addresses_per_interface() -> None:
    addrs = [(f"10.0.{i}.1", 24) for i in range(40)]
    got = parse_ip_addr_json(_ip_json({"eth0": addrs}))["eth0"]
    assert got == tuple(f"10.0.{i}.1/24" for i in range(16))


# ---------------------------------------------------------------------------------------
# garbage -> CaptureError


def _with(extra: dict[str, str]) -> dict[str, str]:
    return _tb_host_with_two_peers() | extra


BAD_SNAPSHOTS = {
    "carrier 2": _with({"class/net/thunderbolt0/carrier": "2\n"}),
    "operstate": _with({"class/net/x0/": "", "class/net/x0/device@": "devices/p/x", "class/net/x0/operstate": "sideways"}),
    "speed text": _iface("eth0", device="devices/p/eth0", speed="fast\n"),
    "speed absurd": _iface("eth0", device="devices/p/eth0", speed="99999999999\n"),
    "speed negative": _iface("eth0", device="devices/p/eth0", speed="-5\n"),
    "host uuid": _with({"bus/thunderbolt/devices/0-0/unique_id": "not-a-uuid\n"}),
    "peer uuid": _with({"bus/thunderbolt/devices/0-1/unique_id": "0" * 36}),
    "tb speed unit": _with({"bus/thunderbolt/devices/0-1/rx_speed": "20 Mb/s\n"}),
    "tb speed absurd": _with({"bus/thunderbolt/devices/0-1/rx_speed": "5000.0 Gb/s\n"}),
    "tb speed zero": _with({"bus/thunderbolt/devices/0-1/tx_speed": "0.0 Gb/s\n"}),
    "tb lanes": _with({"bus/thunderbolt/devices/0-1/rx_lanes": "8\n"}),
    "interface name": {"class/net/bad name/operstate": "up"},
    "long name": {"class/net/abcdefghijklmnop/operstate": "up"},
    "dotdot": {"class/net/../operstate": "up"},
    "absolute": {"/class/net/eth0/operstate": "up"},
    "empty part": {"class//net/eth0/operstate": "up"},
    "huge value": {"class/net/eth0/ifalias": "x" * 5000},
    "too many keys": {f"class/other/{i}": "" for i in range(17000)},
    "too many interfaces": {f"class/net/e{i}/": "" for i in range(600)},
}


@pytest.mark.parametrize("name", sorted(BAD_SNAPSHOTS))
def test_bad_snapshots_raise_capture_error(name: str) -> None:
    with pytest.raises(CaptureError):
        linux_ports(BAD_SNAPSHOTS[name], "[]")


@pytest.mark.parametrize("snapshot", [None, [], "class/net", {1: "x"}, {"class/net/eth0/operstate": 1}])
def test_snapshot_of_the_wrong_type_raises_capture_error(snapshot: object) -> None:
    with pytest.raises(CaptureError):
        linux_ports(snapshot, "[]")  # type: ignore[arg-type]


BAD_IP_JSON = [
    "", "not json", "{", "{}", "null", "[1]", '[{"addr_info": []}]', '[{"ifname": "a b"}]',
    '[{"ifname": "eth0", "addr_info": {}}]', '[{"ifname": "eth0", "addr_info": [1]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.0.0.300", "prefixlen": 8}]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.0.0.3", "prefixlen": 33}]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.0.0.3", "prefixlen": true}]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.0.0.3", "prefixlen": 8.0}]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": 167772163, "prefixlen": 8}]}]',
    '[{"ifname": "eth0", "addr_info": [{"family": "inet", "prefixlen": 8}]}]',
    "[" * 100_000,
    "[" + "{}," * 1_000_000 + "{}]",
    "[" + "1" * 5000 + "]",
]


@pytest.mark.parametrize("text", BAD_IP_JSON, ids=lambda t: t[:40])
def test_bad_ip_json_raises_capture_error(text: str) -> None:
    with pytest.raises(CaptureError):
        parse_ip_addr_json(text)


def test_ip_json_of_the_wrong_type_raises_capture_error() -> None:
    with pytest.raises(CaptureError):
        parse_ip_addr_json(b"[]")  # type: ignore[arg-type]


# Realistic pieces mixed with noise, so the fuzzer reaches the deep branches too.
_GOOD_NAMES = st.sampled_from(["eth0", "thunderbolt0", "tb0a0", "lo", "wlan0", "x"])
_NAMES = st.one_of(_GOOD_NAMES, _GOOD_NAMES, _GOOD_NAMES, st.sampled_from(["a b", "", "..", "e" * 16]))
_ATTRS = st.sampled_from(["operstate", "carrier", "speed", "ifalias", "type", "device@", "phy80211@", "wireless/", "", "x/y"])
_TB_DEVS = st.sampled_from(["0-0", "0-1", "1-0", "1-3", "domain0", "0-1.0"])
_TB_ATTRS = st.sampled_from(["unique_id", "rx_speed", "rx_lanes", "tx_speed", "tx_lanes"])
_GOOD_VALUES = st.sampled_from(
    ["1", "0", "up\n", "down", "unknown", "1000\n", "-1", "1\n", "20.0 Gb/s\n", "2\n", HOST0, PEER_A, "", "772",
     f"{PCI}/domain0/0-0/0-1/0-1.0", f"{PCI}/domain1/1-0/1-3/1-3.0", "devices/pci/eth0",
     bench_alias("a", "b", 40), "p2pmesh:thunderbolt domain=a"]
)
_VALUES = st.one_of(_GOOD_VALUES, _GOOD_VALUES, _GOOD_VALUES, st.text(max_size=40))
_GOOD_KEYS = st.one_of(
    st.builds(lambda n, a: f"class/net/{n}/{a}", _GOOD_NAMES, _ATTRS),
    st.builds(lambda d, a: f"bus/thunderbolt/devices/{d}/{a}", _TB_DEVS, _TB_ATTRS),
)
_KEYS = st.one_of(_GOOD_KEYS, _GOOD_KEYS, _GOOD_KEYS, st.builds(lambda n, a: f"class/net/{n}/{a}", _NAMES, _ATTRS), st.text(max_size=30))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
_ADDR_INFO = st.fixed_dictionaries(
    {"family": st.sampled_from(["inet", "inet", "inet6", 4]),
     "local": st.one_of(st.sampled_from(["10.0.0.1", "169.254.3.1", "::1", "1.2.3"]), _JSON),
     "prefixlen": st.one_of(st.integers(-2, 40), st.integers(0, 32), _JSON)}
)
_IP_ENTRY = st.one_of(
    st.fixed_dictionaries({"ifname": st.one_of(_GOOD_NAMES, _NAMES, _JSON), "addr_info": st.lists(_ADDR_INFO, max_size=3)}),
    st.just({}),
    _JSON,
)
_IP_TEXT = st.one_of(st.lists(_IP_ENTRY, max_size=4).map(json.dumps), _JSON.map(json.dumps), st.text(max_size=60))


def _check(ports: list[PortInfo]) -> None:
    for p in ports:
        assert isinstance(p, PortInfo) and p.kind in ("thunderbolt", "ethernet", "wifi")
        assert p.gbps is None or 0 < p.gbps < 1e6
        assert len(p.ipv4) <= 16 and p.interface != "lo"


@settings(max_examples=500, deadline=None)
@given(snapshot=st.dictionaries(_KEYS, _VALUES, max_size=16))
def test_fuzzed_snapshots_raise_only_capture_error(snapshot: dict[str, str]) -> None:
    try:
        ports = linux_ports(snapshot, "[]")
    except CaptureError as e:
        assert str(e)
        return
    _check(ports)


@settings(max_examples=500, deadline=None)
@given(ip_text=_IP_TEXT)
def test_fuzzed_ip_json_raises_only_capture_error(ip_text: str) -> None:
    try:
        addrs = parse_ip_addr_json(ip_text)
    except CaptureError as e:
        assert str(e)
        return
    assert all(all("/" in a for a in v) for v in addrs.values())


@settings(max_examples=300, deadline=None)
@given(extra=st.dictionaries(_GOOD_KEYS, _VALUES, max_size=6), ip_text=_IP_TEXT)
def test_fuzzed_changes_to_a_real_snapshot_raise_only_capture_error(extra: dict[str, str], ip_text: str) -> None:
    try:
        ports = linux_ports(_tb_host_with_two_peers() | extra, ip_text)
    except CaptureError as e:
        assert str(e)
        return
    _check(ports)


# ---------------------------------------------------------------------------------------
# macOS: ifconfig


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_every_ifconfig_fixture_parses() -> None:
    files = sorted(FIXTURES.glob("ifconfig_*.txt"))
    assert len(files) >= 3
    for f in files:
        entries = parse_ifconfig(f.read_text(encoding="utf-8"))
        assert entries, f.name
        assert all(e.status in (None, "active", "inactive") for e in entries.values()), f.name


def test_ifconfig_bridge0_mac_mini() -> None:
    (entry,) = parse_ifconfig(_fixture("ifconfig_bridge0_macmini_3_tb_members_mtu9000.txt")).values()
    assert (entry.name, entry.ipv4, entry.status, entry.media_gbps) == ("bridge0", ("10.25.0.1/24",), "active", None)


def test_ifconfig_intel_macbook_pro() -> None:
    e = parse_ifconfig(_fixture("ifconfig_intel_macbookpro_bridge0_4_tb_members.txt"))
    assert set(e) >= {"lo0", "en0", "en1", "en2", "en3", "en4", "bridge0", "bridge100", "en8", "utun1"}
    assert e["lo0"].ipv4 == ("127.0.0.1/8",) and e["lo0"].status is None
    for tb in ("en1", "en2", "en3", "en4"):  # bridge0 members: no address of their own
        assert (e[tb].ipv4, e[tb].status) == ((), "inactive")
    assert (e["bridge0"].ipv4, e["bridge0"].status) == ((), "inactive")
    assert (e["bridge100"].ipv4, e["bridge100"].status) == (("192.168.64.1/24",), "active")
    assert (e["en8"].status, e["en8"].media_gbps) == ("active", 0.1)  # "(100baseTX <full-duplex>)"
    assert e["utun1"].ipv4 == ()  # IPv6 only


def test_ifconfig_m1_macbook_pro() -> None:
    e = parse_ifconfig(_fixture("ifconfig_macbookpro16_m1_2021_macos14_4_bridge0_3_tb_members_glpi.txt"))
    assert (e["en0"].ipv4, e["en0"].status) == (("192.168.2.46/24",), "active")
    assert [e[n].status for n in ("en1", "en2", "en3")] == ["inactive"] * 3
    assert e["stf0"].ipv4 == () and e["stf0"].status is None


SYNTHETIC_IFCONFIG = """\
lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\tinet 127.0.0.1 netmask 0xff000000
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 192.168.1.30 netmask 0xffffff00 broadcast 192.168.1.255
\tmedia: autoselect
\tstatus: active
en3: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tmedia: autoselect (10GbaseT <full-duplex>)
\tstatus: active
en6: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.7.1 netmask 0xfffffffc broadcast 169.254.7.3
\tinet 10.0.6.1 netmask 255.255.0.0
\tmedia: autoselect <full-duplex>
\tstatus: active
utun4: flags=8051<UP,POINTOPOINT,RUNNING,MULTICAST> mtu 1380
\tinet 10.8.0.2 --> 10.8.0.1 netmask 0xffffffff
en9: flags=8863<UP,BROADCAST,RUNNING,MULTICAST>  mtu 1500
        inet 172.16.4.2  netmask 255.255.255.0  broadcast 172.16.4.255
"""


def test_ifconfig_netmasks_media_and_point_to_point() -> None:
    e = parse_ifconfig(SYNTHETIC_IFCONFIG)
    assert e["en6"].ipv4 == ("169.254.7.1/30", "10.0.6.1/16")
    assert e["en3"].media_gbps == 10.0 and e["en3"].ipv4 == ()
    assert e["utun4"].ipv4 == ("10.8.0.2/32",)
    assert e["lo0"].ipv4 == ("127.0.0.1/8",)
    assert e["en9"].ipv4 == ("172.16.4.2/24",) and e["en9"].status is None  # spaced-out columns


@pytest.mark.parametrize(
    "text",
    ["", "   \n", "\tinet 10.0.0.1 netmask 0xff000000\n", "garbage line\n",
     "en0: flags=1<UP> mtu 1500\nen0: flags=1<UP> mtu 1500\n",
     "en0: flags=1<UP> mtu 1500\n\tinet 10.0.0.1 netmask 0xff00ff00\n",
     "en0: flags=1<UP> mtu 1500\n\tinet 10.0.0.1 netmask 255.0.255.0\n",
     "en0: flags=1<UP> mtu 1500\n\tinet 10.0.0.1 netmask 999.0.0.0\n",
     "en0: flags=1<UP> mtu 1500\n\tinet 10.0.0.300 netmask 0xff000000\n",
     "en0: flags=1<UP> mtu 1500\n\tinet 10.0.0.1\n",
     "en0: flags=1<UP> mtu 1500\n\tstatus: sleepy\n"],
)
def test_bad_ifconfig_raises_capture_error(text: str) -> None:
    with pytest.raises(CaptureError):
        parse_ifconfig(text)


# ---------------------------------------------------------------------------------------
# macOS: ibv_devices

# The shape Apple documents for an M4 Pro Mac mini with RDMA over Thunderbolt enabled.
IBV_THREE = """\
    device                 node GUID
    ------              ----------------
    rdma_en2            e0c5797d9c8fac05
    rdma_en3            e1c5797d9c8fac05
    rdma_en4            e2c5797d9c8fac05
"""


def test_ibv_devices() -> None:
    assert parse_ibv_devices(IBV_THREE) == {"en2", "en3", "en4"}
    assert parse_ibv_devices("    device                 node GUID\n    ------              ----------------\n") == frozenset()
    assert parse_ibv_devices("") == frozenset()
    assert parse_ibv_devices("    mlx5_0    0002c90300a1b2c3\n") == frozenset()  # not a Thunderbolt device


@pytest.mark.parametrize("text", ["rdma_en2 guid extra words\n", "!!! 1234\n", "x" * 300_000])
def test_bad_ibv_devices_raises_capture_error(text: str) -> None:
    with pytest.raises(CaptureError):
        parse_ibv_devices(text)


# ---------------------------------------------------------------------------------------
# macOS: the assembly

SP_A = "sp_macbookpro_m5max_A_anonymized_peer_sabrent_tb5_dock.json"
SP_B = "sp_macbookpro_m5max_B_anonymized_peer_acasis_tb3_dock.json"
NS_M5 = "networksetup_macbookpro_m5max_anonymized.txt"  # captured with SP_A/SP_B (osaurus)


def test_macos_ports_on_the_osaurus_m5_max_captures() -> None:
    ports = {p.interface: p for p in macos_ports(_fixture(SP_A), _fixture(NS_M5), SYNTHETIC_IFCONFIG, "rdma_en6 0a0b\n")}
    # Thunderbolt 1/2/3 -> en1/en6/en2 (networksetup), Wi-Fi en0, "Ethernet Adapter (en3)";
    # bridge0 (Thunderbolt Bridge) is skipped.
    assert list(ports) == ["en0", "en1", "en2", "en3", "en6"]
    assert ports["en6"] == PortInfo(
        "en6", "thunderbolt", "00000004-0000-4000-8000-000000000004", "00000003-0000-4000-8000-000000000003",
        True, 80.0, ("169.254.7.1/30", "10.0.6.1/16"), True,
    )
    # rid 3 carries a Sabrent hub: connected, but no Mac peer.
    assert (ports["en2"].kind, ports["en2"].up, ports["en2"].peer_domain_uuid, ports["en2"].gbps) == ("thunderbolt", True, None, 80.0)
    assert (ports["en1"].up, ports["en1"].gbps, ports["en1"].rdma) == (False, None, False)
    assert ports["en0"] == PortInfo("en0", "wifi", None, None, True, None, ("192.168.1.30/24",), False)
    assert ports["en3"] == PortInfo("en3", "ethernet", None, None, True, 10.0, (), False)


def test_macos_ports_of_both_ends_pair_up() -> None:
    a = {p.interface: p for p in macos_ports(_fixture(SP_A), _fixture(NS_M5), SYNTHETIC_IFCONFIG, None)}
    b = {p.interface: p for p in macos_ports(_fixture(SP_B), _fixture(NS_M5), SYNTHETIC_IFCONFIG, None)}
    assert a["en6"].peer_domain_uuid == b["en6"].domain_uuid
    assert b["en6"].peer_domain_uuid == a["en6"].domain_uuid
    assert not any(p.rdma for p in a.values())  # no ibv_devices: no RDMA


def test_macos_ports_with_an_ifconfig_lacking_the_interfaces() -> None:
    # ifconfig from another Mac (glpi M1): en6 is absent, so it has no address.
    ifc = _fixture("ifconfig_macbookpro16_m1_2021_macos14_4_bridge0_3_tb_members_glpi.txt")
    ports = {p.interface: p for p in macos_ports(_fixture("sp_macbookpro_m5max_peer_macstudio_m3ultra.json"), _fixture(NS_M5), ifc, IBV_THREE)}
    assert ports["en1"].up and ports["en1"].peer_domain_uuid == "28CA4C30-A263-4C55-B302-953416D0B209"
    assert ports["en6"].ipv4 == () and ports["en2"].rdma is True
    assert ports["en0"].ipv4 == ("192.168.2.46/24",)


@settings(max_examples=300, deadline=None)
@given(ifc=st.text(max_size=200), ibv=st.text(max_size=100))
def test_fuzzed_ifconfig_and_ibv_devices_raise_only_capture_error(ifc: str, ibv: str) -> None:
    for parse, text in ((parse_ifconfig, ifc), (parse_ibv_devices, ibv)):
        try:
            parse(text)  # type: ignore[operator]
        except CaptureError as e:
            assert str(e)


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.sampled_from(SYNTHETIC_IFCONFIG.splitlines() + ["\tinet 1.2.3.4 netmask 0x0", "\tstatus: ", "x:"]), max_size=12))
def test_shuffled_ifconfig_lines_raise_only_capture_error(lines: list[str]) -> None:
    try:
        entries = parse_ifconfig("\n".join(lines))
    except CaptureError:
        return
    assert all(all("/" in a for a in e.ipv4) for e in entries.values())
