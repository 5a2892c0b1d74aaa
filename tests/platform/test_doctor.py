"""The pure half of `p2pmesh doctor` (p2pmesh/platform/doctor*.py) on real captures.

macOS link checks read the captures in tests/fixtures/thunderbolt (SOURCES.md says where each
came from); the outputs that folder lacks (socketfilterfw, rdma_ctl, vm_stat, sysctl,
/proc/meminfo, iptables-save, nft) are small literals in the formats those tools print. Some
tests pair captures of different Macs (a system_profiler of one with an ifconfig of another):
the checks only join them by interface name, which is all these tests need. Every test
asserts the status and the fix a user would read, not just that something came out.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pmesh.platform.doctor import (
    ADDRESS_FIX,
    CHECK_NAMES,
    Check,
    Finding,
    Output,
    exit_code,
    fold,
    render_text,
    report_json,
)
from p2pmesh.platform.doctor_cluster import MdnsProbe, SeenAdvert, check_agent, check_mdns
from p2pmesh.platform.doctor_host import (
    check_memory_linux,
    check_memory_macos,
    check_mlx,
    parse_meminfo,
    parse_sysctl_int,
    parse_vm_stat,
)
from p2pmesh.platform.doctor_links import (
    LinuxFacts,
    MacFacts,
    check_addresses,
    check_bridge,
    check_rdma,
    check_thunderbolt,
    parse_macos_version,
    parse_rdma_ctl,
    usable_interfaces,
)
from p2pmesh.platform.doctor_firewall import (
    MacFirewallFacts,
    check_firewall_linux,
    check_firewall_macos,
    firewall_app_path,
    parse_app_blocked,
    parse_firewall_state,
    parse_iptables_save,
    parse_nft_ruleset,
    parse_on_off,
    port_verdict,
)
from p2pmesh.platform.linux_links import bench_alias
from p2pmesh.platform.thunderbolt import CaptureError
from p2pmesh.core.wire import PROTOCOL_VERSION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "thunderbolt"

SP_A = "sp_macbookpro_m5max_A_anonymized_peer_sabrent_tb5_dock.json"  # port 2 (en6) -> a Mac at 80 Gb/s
NS_M5 = "networksetup_macbookpro_m5max_anonymized.txt"  # captured with SP_A: Thunderbolt 2 = en6
SP_TB4_EMPTY = "sp_macbookpro_m3pro_macos27_nothing_connected.json"  # 3 ports, "Up to 40 Gb/s", nothing cabled
NS_M1 = "networksetup_macbookpro16_m1_2021_macos14_4_glpi.txt"  # Thunderbolt 1-3 = en1-en3, bridge0
IFC_M1 = "ifconfig_macbookpro16_m1_2021_macos14_4_bridge0_3_tb_members_glpi.txt"  # bridge0: en1, en2, en3

IFCONFIG_EN6 = """\
lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\tinet 127.0.0.1 netmask 0xff000000
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 192.168.1.30 netmask 0xffffff00 broadcast 192.168.1.255
\tstatus: active
en6: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.7.1 netmask 0xfffffffc broadcast 169.254.7.3
\tstatus: active
"""
IFCONFIG_EN6_BRIDGED = """\
en6: flags=8963<UP,BROADCAST,SMART,RUNNING,PROMISC,SIMPLEX,MULTICAST> mtu 1500
\tstatus: active
bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.44.2 netmask 0xffff0000 broadcast 169.254.255.255
\tmember: en1 flags=3<LEARNING,DISCOVER>
\tmember: en6 flags=3<LEARNING,DISCOVER>
\tstatus: active
"""
IBV_EN6 = "    device                 node GUID\n    ------              ----------------\n    rdma_en6            0a0b0c0d0e0f1011\n"


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _mac(sp: str = SP_A, ns: str = NS_M5, ifconfig: str = IFCONFIG_EN6, *, ibv: Output | None = None,
         rdma_ctl: Output | None = None, version: str = "26.2") -> MacFacts:
    return MacFacts(
        system_profiler=Output(_fixture(sp) if sp.endswith((".json", ".txt")) else sp),
        networksetup=Output(_fixture(ns) if ns.endswith(".txt") else ns),
        ifconfig=Output(_fixture(ifconfig) if ifconfig.endswith(".txt") else ifconfig),
        ibv_devices=ibv or Output(IBV_EN6),
        rdma_ctl=rdma_ctl or Output("RDMA is enabled\n"),
        os_version=Output(version + "\n"),
    )


# ---------------------------------------------------------------------------------------
# Folding findings, the report


def test_a_check_is_as_bad_as_its_worst_finding_and_lists_every_fix_to_make() -> None:
    c = fold("x", [Finding("ok", "fine"), Finding("warn", "meh", "do a"), Finding("fail", "bad", "do b")], ["d"])
    assert (c.status, c.summary, c.fix, c.details) == ("fail", "meh; bad", "do a\ndo b", ("d",))
    assert fold("x", [Finding("skip", "n/a", "start it"), Finding("skip", "n/a")]).fix == "start it"
    assert fold("x", [Finding("ok", "a"), Finding("skip", "b")]).summary == "a"


def test_only_a_failure_fails_the_run_and_the_json_has_the_promised_shape() -> None:
    checks = [Check("a", "ok", "fine"), Check("b", "warn", "meh", "fix it", ("why",)), Check("c", "skip", "n/a")]
    assert exit_code(checks) == 0
    assert exit_code([*checks, Check("d", "fail", "bad")]) == 1
    doc = report_json(checks)
    assert doc == {"ok": True, "checks": [
        {"name": "a", "status": "ok", "summary": "fine"},
        {"name": "b", "status": "warn", "summary": "meh", "fix": "fix it", "details": ["why"]},
        {"name": "c", "status": "skip", "summary": "n/a"}]}
    assert json.loads(json.dumps(doc)) == doc


def test_the_text_report_shows_each_fix_under_its_check() -> None:
    text = render_text([Check("bridge", "fail", "a loop", "step one\nstep two", ("detail",)), Check("mlx", "ok", "works")])
    lines = text.splitlines()
    assert lines[0] == "[FAIL] bridge       a loop"
    assert lines[1].strip() == "fix: step one" and lines[2].strip() == "step two" and lines[3].strip() == "- detail"
    assert lines[1].index("fix") == lines[0].index("a loop")
    assert lines[-1] == "1 ok, 0 warning(s), 1 failed, 0 skipped"


def test_check_names_are_the_documented_ones() -> None:
    assert CHECK_NAMES == ("thunderbolt", "addresses", "bridge", "rdma", "firewall", "mdns", "mlx", "memory", "agent")


# ---------------------------------------------------------------------------------------
# thunderbolt (macOS)


def test_a_mac_cabled_at_80_gbps_is_ok_and_every_port_is_described() -> None:
    c = check_thunderbolt(_mac())
    assert c.status == "ok", c
    assert "port 2 (en6) to MacBook Pro at 80 Gb/s" in c.summary
    assert c.details == (
        "port 1 (en1): empty, 120 Gb/s capable",
        "port 2 (en6): a Mac: MacBook Pro Mac17,6, at 80 Gb/s",
        "port 3 (en2): a device: SB-XTM5, at 80 Gb/s",
    )


def test_no_mac_cabled_is_a_warning_that_says_to_cable_port_to_port() -> None:
    c = check_thunderbolt(_mac(SP_TB4_EMPTY, NS_M1))
    assert c.status == "warn"
    assert c.summary == "no Mac is cabled directly to this one"
    assert c.fix is not None and "port to port" in c.fix and "dock" in c.fix


def test_a_cabled_mac_without_an_interface_names_networksetup_detectnewhardware() -> None:
    ns = "Hardware Port: Wi-Fi\nDevice: en0\nEthernet Address: 02:00:00:00:00:05\n"
    c = check_thunderbolt(_mac(ns=ns))
    assert c.status == "warn"
    assert "port 2 is cabled to a Mac but macOS made no network interface" in c.summary
    assert c.fix is not None and "networksetup -detectnewhardware" in c.fix and "'Thunderbolt 2'" in c.fix


def test_a_slow_mac_link_asks_for_a_thunderbolt_cable() -> None:
    doc = json.loads(_fixture(SP_A))
    for bus in doc["SPThunderboltDataType"]:
        if any("domain_uuid_key" in item for item in bus.get("_items", [])):
            bus["receptacle_1_tag"]["current_speed_key"] = "20 Gb/s"
    c = check_thunderbolt(_mac(sp=json.dumps(doc)))
    assert c.status == "warn" and "only 20 Gb/s" in c.summary
    assert c.fix is not None and "Thunderbolt 4 or 5 cable" in c.fix


def test_a_text_format_capture_is_a_failure_not_a_crash() -> None:
    c = check_thunderbolt(_mac(sp="sp_text_macmini_m4pro_nothing_connected.txt"))
    assert c.status == "fail" and "text format" in c.summary


def test_a_missing_system_profiler_skips_and_a_broken_one_fails() -> None:
    facts = _mac_outputs(system_profiler=Output(None, "system_profiler is not installed", missing=True))
    assert check_thunderbolt(facts).status == "skip"
    broken = check_thunderbolt(_mac_outputs(system_profiler=Output(None, "no answer within 30 s")))
    assert broken.status == "fail" and "no answer within 30 s" in broken.summary
    assert broken.fix is not None and "system_profiler SPThunderboltDataType -json" in broken.fix


def _mac_outputs(**outputs: Output) -> MacFacts:
    base = {k: Output("") for k in ("system_profiler", "networksetup", "ifconfig", "ibv_devices", "rdma_ctl", "os_version")}
    return MacFacts(**(base | outputs))


# ---------------------------------------------------------------------------------------
# Linux facts (bench-marked veths stand in for thunderbolt-net, as on the netns bench)


def _linux(ifaces: dict[str, tuple[bool, list[tuple[str, int]]]], *, bridges: dict[str, list[str]] | None = None,
           bus: bool = True) -> LinuxFacts:
    snap: dict[str, str] = {}
    ip = []
    for i, (name, (up, addrs)) in enumerate(sorted(ifaces.items())):
        base = f"class/net/{name}"
        snap |= {f"{base}/": "", f"{base}/operstate": "up\n" if up else "down\n", f"{base}/carrier": "1\n" if up else "0\n",
                 f"{base}/type": "1\n", f"{base}/ifalias": bench_alias(f"host-{name}", f"peer-{name}", 40.0) + "\n"}
        ip.append({"ifname": name, "addr_info": [{"family": "inet", "local": a, "prefixlen": n} for a, n in addrs]})
    return LinuxFacts(snap, Output(json.dumps(ip)), bus, {} if bridges is None else bridges)


def test_linux_without_a_thunderbolt_bus_skips_and_with_cables_is_ok() -> None:
    assert check_thunderbolt(_linux({}, bus=False)).status == "skip"
    empty_bus = check_thunderbolt(_linux({}))
    assert empty_bus.status == "warn" and empty_bus.fix is not None and "modprobe thunderbolt-net" in empty_bus.fix
    c = check_thunderbolt(_linux({"tb0": (True, [("169.254.1.1", 30)])}))
    assert c.status == "ok" and "tb0 cabled to a host at 40 Gb/s" in c.summary
    assert check_thunderbolt(_linux({"tb0": (False, [])})).status == "warn"


def test_usable_interfaces_are_the_ports_that_are_up() -> None:
    assert usable_interfaces(_linux({"tb0": (True, []), "tb1": (False, [])})) == ["tb0"]
    assert usable_interfaces(LinuxFacts(None, Output(None, "x"), False, None, "unreadable")) == []


# ---------------------------------------------------------------------------------------
# addresses


def test_a_cable_with_its_own_address_is_ok() -> None:
    c = check_addresses(_mac())
    assert c.status == "ok" and c.details == ("en6: 169.254.7.1/30",)


def test_a_cable_without_ipv4_points_at_links_plan() -> None:
    c = check_addresses(_mac(ifconfig=IFCONFIG_EN6.replace("\tinet 169.254.7.1 netmask 0xfffffffc broadcast 169.254.7.3\n", "")))
    assert c.status == "warn" and c.summary == "en6 (cabled to another host) has no IPv4 address"
    assert c.fix == ADDRESS_FIX and "p2pmesh links plan" in c.fix


def test_a_bridged_cable_without_ipv4_points_at_the_bridge_check() -> None:
    c = check_addresses(_mac(ifconfig=IFCONFIG_EN6_BRIDGED))
    assert c.status == "warn"
    assert c.summary == "en6 (cabled to another host) has no IPv4 address (it is a member of bridge0: see the bridge check)"


def test_two_cables_in_one_link_local_16_are_ambiguous() -> None:
    c = check_addresses(_linux({"tb0": (True, [("169.254.3.4", 16)]), "tb1": (True, [("169.254.9.9", 16)])}))
    assert c.status == "warn"
    assert "tb0 and tb1 share the subnet 169.254.0.0/16" in c.summary
    assert c.fix is not None and c.fix.startswith("give each cable its own /30")


def test_no_cable_means_no_address_to_check() -> None:
    assert check_addresses(_linux({"tb0": (False, [])})).status == "skip"


# ---------------------------------------------------------------------------------------
# bridge


def test_a_cabled_port_inside_thunderbolt_bridge_warns_with_the_settings_path_and_deletem() -> None:
    c = check_bridge(_mac(ifconfig=IFCONFIG_EN6_BRIDGED))
    assert c.status == "warn"
    assert c.summary.startswith("en6 (cabled to a Mac) is a member of bridge0 (Thunderbolt Bridge)")
    assert c.fix is not None
    assert "System Settings > Network > Thunderbolt Bridge" in c.fix and "`sudo ifconfig bridge0 deletem en6`" in c.fix


def test_the_default_thunderbolt_bridge_without_cables_is_ok_with_a_note() -> None:
    # The M1 MacBook Pro's real ifconfig (bridge0 = en1, en2, en3) and networksetup, with a
    # nothing-connected system_profiler of another 3-port Mac (receptacles 1-3 -> en1-en3).
    c = check_bridge(_mac(SP_TB4_EMPTY, NS_M1, IFC_M1))
    assert c.status == "ok"
    assert any("bridge0 (Thunderbolt Bridge)" in d and "no cabled port yet" in d for d in c.details)


def test_two_bridged_cables_on_linux_are_a_loop_and_fail() -> None:
    facts = _linux({"tb0": (True, []), "tb1": (True, [])}, bridges={"br0": ["tb0", "tb1"]})
    c = check_bridge(facts)
    assert c.status == "fail" and c.summary.startswith("br0 bridges the ring interface(s) tb0, tb1")
    assert c.fix == "`sudo ip link set dev tb0 nomaster`; `sudo ip link set dev tb1 nomaster`"
    one = check_bridge(_linux({"tb0": (True, []), "tb1": (False, [])}, bridges={"br0": ["tb0"]}))
    assert one.status == "warn"
    assert check_bridge(_linux({"tb0": (True, [])})).status == "ok"
    assert check_bridge(LinuxFacts({}, Output("[]"), False, None, bridges_error="cannot list")).status == "skip"


# ---------------------------------------------------------------------------------------
# rdma


def test_rdma_parsers() -> None:
    assert parse_macos_version("26.2\n") == (26, 2) and parse_macos_version("15.6.1") == (15, 6, 1)
    with pytest.raises(CaptureError):
        parse_macos_version("ProductVersion: 15")
    assert parse_rdma_ctl("RDMA is enabled") is True
    assert parse_rdma_ctl("disabled\n") is False
    assert parse_rdma_ctl("usage: rdma_ctl enable|disable|status") is None


def test_rdma_enabled_with_a_device_for_the_cabled_port_is_ok() -> None:
    c = check_rdma(_mac())
    assert c.status == "ok" and c.summary == "RDMA devices: rdma_en6"


def test_rdma_disabled_says_how_to_enable_it_in_recovery() -> None:
    c = check_rdma(_mac(rdma_ctl=Output("RDMA is disabled\n")))
    assert c.status == "warn" and c.fix is not None
    assert "Recovery" in c.fix and "`rdma_ctl enable`" in c.fix


def test_rdma_without_devices_or_without_one_for_the_cable_warns() -> None:
    header = "    device                 node GUID\n    ------              ----------------\n"
    none = check_rdma(_mac(ibv=Output(header)))
    assert none.status == "warn" and "ibv_devices lists no rdma_enX" in none.summary
    other = check_rdma(_mac(ibv=Output(header + "    rdma_en2            0a0b0c0d0e0f1011\n")))
    assert other.status == "warn" and "en6 is cabled to a Mac but has no RDMA device (rdma_en6)" in other.summary


def test_rdma_is_skipped_where_it_cannot_exist() -> None:
    old = check_rdma(_mac(version="15.6.1"))
    assert old.status == "skip" and "macOS 26.2" in old.summary and "15.6.1" in old.summary
    tb4 = check_rdma(_mac(SP_TB4_EMPTY, NS_M1))
    assert tb4.status == "skip" and "Thunderbolt 5" in tb4.summary
    gone = check_rdma(_mac(ibv=Output(None, "not installed", missing=True), rdma_ctl=Output(None, "not installed", missing=True)))
    assert gone.status == "skip"
    assert check_rdma(_linux({})).status == "skip"


# ---------------------------------------------------------------------------------------
# firewall (macOS)

APP = "/opt/homebrew/Cellar/python@3.12/3.12.7/Frameworks/Python.framework/Versions/3.12/Resources/Python.app"


def test_socketfilterfw_outputs_across_macos_versions() -> None:
    assert parse_firewall_state("Firewall is disabled. (State = 0)") == 0
    assert parse_firewall_state("Firewall is enabled. (State = 1)") == 1
    assert parse_firewall_state("Firewall is blocking all non-essential incoming connections. (State = 2)") == 2
    assert parse_firewall_state("something else") is None
    assert parse_on_off("Firewall has block all state set to enabled.") is True
    assert parse_on_off("Firewall has block all state set to disabled.") is False
    assert parse_on_off("Block all DISABLED!") is False and parse_on_off("Block all ENABLED!") is True
    assert parse_on_off("Firewall stealth mode is on") is True and parse_on_off("Firewall stealth mode is off") is False
    assert parse_on_off("Stealth mode enabled.") is True
    assert parse_app_blocked(f"Incoming connection to {APP} is blocked.", APP) is True
    assert parse_app_blocked(f"Incoming connection to {APP} is permitted.", APP) is False
    assert parse_app_blocked("The application /Users/blocked/py is not part of the firewall", "/Users/blocked/py") is None


def test_the_firewall_knows_a_framework_python_by_its_app_bundle() -> None:
    exe = "/opt/homebrew/Cellar/python@3.12/3.12.7/Frameworks/Python.framework/Versions/3.12/bin/python3.12"
    assert firewall_app_path(exe) == APP
    assert firewall_app_path("/Users/me/.venv/bin/python3") == "/Users/me/.venv/bin/python3"


def _fw(state: str, block_all: str = "Firewall has block all state set to disabled.",
        app: str = f"Incoming connection to {APP} is permitted.", stealth: str = "Firewall stealth mode is off") -> Check:
    return check_firewall_macos(MacFirewallFacts(Output(state), Output(block_all), Output(stealth), Output(app), APP))


def test_macos_firewall_verdicts() -> None:
    assert _fw("Firewall is disabled. (State = 0)").status == "ok"
    assert _fw("Firewall is enabled. (State = 1)").status == "ok"
    block = _fw("Firewall is enabled. (State = 1)", "Firewall has block all state set to enabled.")
    assert block.status == "fail" and block.fix is not None and "Block all incoming connections" in block.fix
    blocked = _fw("Firewall is enabled. (State = 1)", app=f"Incoming connection to {APP} is blocked.")
    assert blocked.status == "fail" and blocked.fix is not None and f"--unblockapp {APP}" in blocked.fix
    unknown = _fw("Firewall is enabled. (State = 1)", app=f"The application {APP} is not part of the firewall")
    assert unknown.status == "warn"
    assert unknown.fix is not None and unknown.fix.startswith("allow incoming connections for python in the Application Firewall")
    assert f"sudo /usr/libexec/ApplicationFirewall/socketfilterfw --add {APP}" in unknown.fix
    stealth = _fw("Firewall is enabled. (State = 1)", stealth="Firewall stealth mode is on")
    assert stealth.status == "ok" and any("stealth mode is on" in d for d in stealth.details)


def test_a_path_with_spaces_is_quoted_in_the_fix() -> None:
    app = "/Users/me/My Envs/bin/python3"
    c = check_firewall_macos(MacFirewallFacts(Output("Firewall is enabled. (State = 1)"), Output("disabled"),
                                              Output("off"), Output("not part of the firewall"), app))
    assert c.fix is not None and "--add '/Users/me/My Envs/bin/python3'" in c.fix


def test_a_missing_socketfilterfw_skips() -> None:
    missing = Output(None, "socketfilterfw is not installed", missing=True)
    c = check_firewall_macos(MacFirewallFacts(missing, missing, missing, missing, APP))
    assert c.status == "skip"


# ---------------------------------------------------------------------------------------
# firewall (Linux)

PORTS = [("tcp", 7741, "peer connections"), ("udp", 5353, "mDNS discovery"), ("tcp", 47000, "data plane")]

IPTABLES_SAVE = """\
# Generated by iptables-save v1.8.7 on Tue Dec  1 10:00:00 2026
*nat
:PREROUTING ACCEPT [0:0]
-A PREROUTING -p tcp --dport 7741 -j DROP
COMMIT
*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A INPUT -p udp -m udp --dport 5353 -m comment --comment "no mdns here" -j DROP
-A INPUT -p tcp -m multiport --dports 40000:49999 -j ACCEPT
-A OUTPUT -p tcp --dport 7741 -j REJECT
COMMIT
"""

NFT_RULESET = """\
table inet filter {
\tset allowed {
\t\ttype inet_service
\t\telements = { 7741 }
\t}
\tchain input {
\t\ttype filter hook input priority filter; policy drop;
\t\tct state established,related accept
\t\tiif "lo" accept
\t\tudp dport 5353 accept
\t\ttcp dport { 22, 7000-8000 } accept
\t}
\tchain forward {
\t\ttype filter hook forward priority filter; policy drop;
\t\ttcp dport 47000 accept
\t}
\tchain output {
\t\ttype filter hook output priority filter; policy accept;
\t\ttcp dport 7741 drop
\t}
}
"""


def test_iptables_save_policy_drop_explicit_drop_and_ranges() -> None:
    f = parse_iptables_save(IPTABLES_SAVE)
    assert f.default_drop
    assert port_verdict(f, "tcp", 7741) == "default-drop"  # the nat and OUTPUT drops do not count
    assert port_verdict(f, "udp", 5353) == "drop"
    assert port_verdict(f, "tcp", 47000) == "accept"
    c = check_firewall_linux([("iptables-save", Output(IPTABLES_SAVE)), ("nft", Output(None, "nft is not installed", missing=True))],
                             PORTS, root=True)
    assert c.status == "fail"
    assert "a rule in iptables-save drops 5353/udp (mDNS discovery)" in c.summary and "7741/tcp (peer connections) falls through" in c.summary
    assert c.fix is not None and "sudo ufw allow 5353/udp" in c.fix and "sudo ufw allow 7741/tcp" in c.fix


def test_a_catch_all_reject_counts_as_a_drop_policy() -> None:
    f = parse_iptables_save("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j REJECT --reject-with icmp-host-prohibited\nCOMMIT\n")
    assert f.default_drop and port_verdict(f, "tcp", 7741) == "default-drop"
    assert not parse_iptables_save("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -s 10.0.0.0/8 -j DROP\nCOMMIT\n").default_drop


def test_nft_input_chain_policy_sets_and_ranges() -> None:
    f = parse_nft_ruleset(NFT_RULESET)
    assert f.default_drop
    assert port_verdict(f, "tcp", 7741) == "accept"  # inside 7000-8000
    assert port_verdict(f, "udp", 5353) == "accept"
    assert port_verdict(f, "tcp", 47000) == "default-drop"  # the forward chain's accept is not for us
    c = check_firewall_linux([("nft", Output(NFT_RULESET))], PORTS, root=True)
    assert c.status == "warn" and c.summary == "incoming 47000/tcp (data plane) falls through to a drop policy"
    firewalld = parse_nft_ruleset("table inet firewalld {\n\tchain filter_INPUT {\n\t\ttype filter hook input priority "
                                  "filter + 10; policy accept;\n\t\treject with icmpx admin-prohibited\n\t}\n}\n")
    assert firewalld.default_drop


def test_unreadable_or_absent_rules_skip_with_the_reason() -> None:
    absent = check_firewall_linux([("nft", Output(None, "x", missing=True)), ("iptables-save", Output(None, "y", missing=True))],
                                  PORTS, root=False)
    assert absent.status == "skip" and "neither nft nor iptables-save" in absent.summary
    denied = check_firewall_linux([("nft", Output(None, "nft list ruleset: exit status 1")),
                                   ("iptables-save", Output(None, "y", missing=True))], PORTS, root=False)
    assert denied.status == "skip" and denied.fix == "reading them needs root: run `sudo p2pmesh doctor`"
    open_ = check_firewall_linux([("nft", Output(""))], PORTS, root=True)
    assert open_.status == "ok"


# ---------------------------------------------------------------------------------------
# mdns


def _txt(node: str, protocol: int = PROTOCOL_VERSION, cid: str = "aa" * 8) -> dict[bytes, bytes | None]:
    return {b"id": node.encode(), b"pv": str(protocol).encode(), b"cid": cid.encode(), b"mem": b"1", b"chip": b"M4"}


def test_mdns_round_trip_per_interface() -> None:
    ok = MdnsProbe("lo", ("127.0.0.1",), 480)
    assert check_mdns([ok], [], window_ms=3000, platform="linux").status == "ok"
    bad = MdnsProbe("en0", ("192.168.1.30",), None, "OSError: [Errno 65] No route to host")
    some = check_mdns([ok, bad], [], window_ms=3000, platform="darwin", over_ssh=True)
    assert some.status == "warn" and some.summary == "en0: OSError: [Errno 65] No route to host"
    assert some.fix is not None and "Local Network" in some.fix and "SSH" in some.fix and "--peer HOST:7741" in some.fix
    silent = check_mdns([MdnsProbe("en0", ("10.0.0.2",), None)], [], window_ms=3000, platform="linux")
    assert silent.status == "fail" and "not seen within 3000 ms" in silent.summary
    assert check_mdns([], [], window_ms=3000, platform="linux", notes=["en5: no IP address"]).status == "warn"


def test_mdns_flags_agents_of_another_protocol_or_key_or_outside_the_cluster() -> None:
    me, a, b, c, d = ("0" * 32, "a" * 32, "b" * 32, "c" * 32, "d" * 32)
    fp = "aa" * 8
    adverts = [
        SeenAdvert("self", "en0", _txt(me)),
        SeenAdvert("old", "en0", _txt(a, protocol=PROTOCOL_VERSION + 1)),
        SeenAdvert("otherkey", "en0", _txt(b, cid="bb" * 8)),
        SeenAdvert("stranger", "en0", _txt(c)),
        SeenAdvert("member", "en0", _txt(d)),
        SeenAdvert("junk", "en0", {b"id": b"nope"}),
    ]
    check = check_mdns([MdnsProbe("en0", ("10.0.0.2",), 300)], adverts, window_ms=3000, platform="linux",
                       own_node_id=me, fingerprint=fp, members=[me, d])
    assert check.status == "warn"
    assert f"agent aaaaaaaa on en0 speaks protocol {PROTOCOL_VERSION + 1}" in check.summary
    assert "agent bbbbbbbb on en0 holds a different cluster key" in check.summary
    assert "agent cccccccc advertises on en0 but is not a member of this cluster" in check.summary
    assert "junk on en0 sent an unreadable advertisement" in check.summary
    assert "dddddddd" not in check.summary and "00000000" not in check.summary
    assert check.fix is not None and "same p2pmesh version" in check.fix and "p2pmesh key set KEY" in check.fix


# ---------------------------------------------------------------------------------------
# mlx

GOOD_MLX = {"python": "/venv/bin/python", "machine": "arm64", "version": "0.32.4", "device": "Device(gpu, 0)",
            "metal": True, "matmul": [[7.0, 10.0], [15.0, 22.0]], "ring": True, "jaccl": True,
            "working_set_bytes": 96 * 2**30, "mlx_lm": "0.32.2"}


def _mlx(platform: str = "darwin", **changes: object) -> Check:
    return check_mlx(Output("noise on stdout\n" + json.dumps(GOOD_MLX | changes) + "\n"), platform)


def test_mlx_that_works() -> None:
    c = _mlx()
    assert c.status == "ok" and c.summary == "MLX 0.32.4 on Device(gpu, 0): matmul and ring backend work"
    assert any("96.0 GiB" in d for d in c.details)
    assert _mlx("linux", machine="x86_64", metal=False, device="Device(cpu, 0)").status == "ok"


def test_mlx_failures_each_say_what_to_install() -> None:
    missing = check_mlx(Output(json.dumps({"python": "/venv/bin/python", "machine": "x86_64",
                                           "import_error": "ModuleNotFoundError: No module named 'mlx'"})), "linux")
    assert missing.status == "fail" and missing.fix == "`/venv/bin/python -m pip install 'mlx[cpu]' mlx-lm`"
    rosetta = _mlx(machine="x86_64")
    assert rosetta.status == "fail" and "Rosetta" in rosetta.summary and rosetta.fix is not None and "arm64" in rosetta.fix
    assert _mlx(metal=False).status == "fail"
    assert _mlx(matmul=[[0.0, 0.0], [0.0, 0.0]]).status == "fail"
    assert _mlx(ring=False).status == "fail"
    no_lm = _mlx(mlx_lm=None)
    assert no_lm.status == "fail" and no_lm.fix == "`/venv/bin/python -m pip install mlx mlx-lm`"
    assert check_mlx(Output("Segmentation fault"), "darwin").status == "fail"
    crashed = check_mlx(Output(None, "python -c ...: exit status -11"), "darwin")
    assert crashed.status == "fail" and "exit status -11" in crashed.summary


# ---------------------------------------------------------------------------------------
# memory

VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               45231.
Pages active:                            892341.
Pages inactive:                          234521.
Pages speculative:                        12345.
Pages throttled:                              0.
Pages wired down:                        456789.
Pages purgeable:                          23456.
"Translation faults":                1234567890.
Pages copy-on-write:                   12345678.
Pages zero filled:                    234567890.
Pages reactivated:                      1234567.
Pages purged:                            234567.
File-backed pages:                       345678.
Anonymous pages:                         567890.
Pages stored in compressor:              890123.
Pages occupied by compressor:            123456.
Decompressions:                          345678.
Compressions:                            567890.
Pageins:                                 123456.
Pageouts:                                     0.
Swapins:                                      0.
Swapouts:                                     0.
"""
MEMINFO = "MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:   42000000 kB\nBuffers: 1 kB\n"


def test_memory_parsers() -> None:
    vm = parse_vm_stat(VM_STAT)
    assert vm["page size"] == 16384 and vm["pages free"] == 45231 and vm["translation faults"] == 1234567890
    assert vm["file-backed pages"] == 345678
    assert parse_sysctl_int("hw.memsize: 68719476736\n", "hw.memsize") == 68719476736
    assert parse_sysctl_int("0\n", "iogpu.wired_limit_mb") == 0
    assert parse_meminfo(MEMINFO) == (65536000 * 1024, 42000000 * 1024)
    for bad in ("", "Pages free: 1.", "Mach Virtual Memory Statistics: (page size of 4096 bytes)\n"):
        with pytest.raises(CaptureError):
            parse_vm_stat(bad)
    with pytest.raises(CaptureError):
        parse_sysctl_int("sysctl: unknown oid 'iogpu.wired_limit_mb'", "iogpu.wired_limit_mb")
    with pytest.raises(CaptureError):
        parse_meminfo("MemTotal: 1 kB\n")


def test_macos_memory_available_and_the_gpu_wired_limit() -> None:
    # (45231 + 234521 + 12345) pages of 16 KiB = 4.46 GiB available of 64 GiB: tight.
    c = check_memory_macos(Output(VM_STAT), Output("68719476736\n"), Output("0\n"))
    assert c.status == "warn" and c.summary == "memory is tight: 4.5 GiB of 64.0 GiB available"
    assert c.fix is not None and "--memory-limit" in c.fix
    assert any("macOS's default" in d for d in c.details)
    roomy = check_memory_macos(Output(VM_STAT), Output("17179869184\n"), Output(None, "exit status 1"))
    assert roomy.status == "ok" and roomy.summary == "4.5 GiB of 16.0 GiB available"
    greedy = check_memory_macos(Output(VM_STAT), Output("17179869184\n"), Output("15000\n"))
    assert greedy.status == "warn" and greedy.fix is not None
    assert "iogpu.wired_limit_mb=15000 leaves less than 4 GiB" in greedy.summary
    assert "`sudo sysctl iogpu.wired_limit_mb=8192`" in greedy.fix


def test_linux_memory() -> None:
    assert check_memory_linux(Output(MEMINFO)).status == "ok"
    tight = check_memory_linux(Output("MemTotal: 65536000 kB\nMemAvailable: 1000000 kB\n"))
    assert tight.status == "warn"
    assert check_memory_linux(Output("garbage")).status == "fail"


# ---------------------------------------------------------------------------------------
# agent

A, B, C = "a" * 32, "b" * 32, "c" * 32


def _status(**changes: object) -> dict[str, object]:
    hop = {"from": A, "to": B, "kind": "thunderbolt", "gbps": 80.0, "rtt_ms": 0.1, "from_interface": "en2",
           "to_interface": "en3", "from_ipv4": "169.254.7.1", "to_ipv4": "169.254.7.2", "rdma": False}
    back = hop | {"from": B, "to": A, "from_interface": "en3", "to_interface": "en2", "from_ipv4": "169.254.7.2",
                  "to_ipv4": "169.254.7.1"}
    base: dict[str, object] = {
        "node_id": A, "cluster_id": "f" * 32, "role": "leader", "term": 3, "leader": A, "healthy": True,
        "members": [{"node_id": A, "voter": True, "up": True}, {"node_id": B, "voter": True, "up": True}],
        "ring": {"epoch": 2, "order": [A, B], "hops": [hop, back]}}
    return base | changes


def test_a_healthy_agent_reports_its_cluster() -> None:
    c = check_agent(_status(), None, socket="/s")
    assert c.status == "ok"
    assert c.summary == "leader in cluster ffffffff: 2 of 2 member(s) up, leader aaaaaaaa, ring of 2 (epoch 2)"


def test_no_agent_skips_with_how_to_start_one() -> None:
    c = check_agent(None, None, socket="/s")  # no agent runs there: the finding says it, no detail
    assert c.status == "skip" and c.fix is not None and "p2pmesh agent" in c.fix and c.details == ()
    silent = check_agent(None, "the agent sent nothing for 3 s", socket="/s")  # one runs, but failed: why is shown
    assert silent.status == "skip" and silent.details == ("the agent sent nothing for 3 s",)


def test_agent_problems_each_warn() -> None:
    down = check_agent(_status(members=[{"node_id": A, "up": True}, {"node_id": B, "up": False}, {"node_id": C, "up": False}]),
                       None, socket="/s")
    assert down.status == "warn" and "member(s) down: bbbbbbbb, cccccccc" in down.summary
    assert f"member {B}: DOWN" in down.details and f"member {A}: up" in down.details
    assert down.fix is not None and "`p2pmesh doctor` there" in down.fix
    sick = check_agent(_status(healthy=False, role="follower", leader=None), None, socket="/s")
    assert sick.status == "warn" and "no working leader (this agent is follower)" in sick.summary
    unaddressed = _status()
    unaddressed["ring"]["hops"][0]["from_ipv4"] = None  # type: ignore[index]
    c = check_agent(unaddressed, None, socket="/s")
    assert c.status == "warn" and "over Thunderbolt has no IPv4 pair" in c.summary and c.fix == ADDRESS_FIX
    ringless = check_agent(_status(ring=None), None, socket="/s")
    assert ringless.status == "warn" and "no ring is committed yet" in ringless.summary
    newer = _status(members=[{"node_id": A, "up": True}, {"node_id": B, "up": True, "protocol": PROTOCOL_VERSION + 1}])
    assert "speaks protocol" in check_agent(newer, None, socket="/s").summary
    assert check_agent(_status(ring={"epoch": "x"}), None, socket="/s").status == "warn"


# ---------------------------------------------------------------------------------------
# Hostile input: parsers raise only CaptureError, and the rule readers never raise


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300))
def test_fuzzed_outputs_raise_only_capture_error(text: str) -> None:
    for parse in (parse_vm_stat, parse_meminfo, parse_macos_version, lambda t: parse_sysctl_int(t, "hw.memsize")):
        try:
            parse(text)
        except CaptureError:
            pass
    parse_iptables_save(text)
    parse_nft_ruleset(text)
    parse_on_off(text)
    parse_firewall_state(text)
    parse_app_blocked(text, "/x")
    parse_rdma_ctl(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300))
def test_fuzzed_captures_never_crash_a_check(text: str) -> None:
    facts = MacFacts(*(Output(text) for _ in range(6)))
    for check in (check_thunderbolt, check_addresses, check_bridge, check_rdma):
        assert check(facts).status in ("ok", "warn", "fail", "skip")
    assert check_mlx(Output(text), "darwin").status == "fail"
    assert check_memory_macos(Output(text), Output(text), Output(text)).status in ("ok", "warn", "fail")
