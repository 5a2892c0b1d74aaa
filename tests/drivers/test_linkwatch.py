"""The link watcher against real files, real processes and real network namespaces.

- detect_ports on a fake sysfs tree laid out as the kernel lays it out (class/net entries
  are symlinks into devices/, Thunderbolt devices nest domainN/N-0/N-R/N-R.S);
- run_tool's timeout, output cap and failures;
- watch: sends only changes, logs a failure once and keeps the last good list;
- two namespaces joined by a bench-marked veth: both ends are found as Thunderbolt cable
  ends, and carrier follows the link (needs root; CI runs it).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from p2pmesh.core.messages import PortInfo
from p2pmesh.drivers.linkwatch import (
    SYSFS_FILE_BYTES_MAX,
    ToolError,
    detect_ports,
    read_sysfs,
    run_tool,
    watch,
)
from p2pmesh.platform.linux_links import bench_alias
from p2pmesh.platform.thunderbolt import CaptureError
from tests.agent.harness import ROOT
from tests.agent.netns import Bench, ip, require_root

linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="detect_ports reads sysfs only on Linux")

HOST = "d1b3a4c0-1f2e-4d5c-8b7a-0123456789ab"
PEER = "817dcfa4-b481-4100-80fc-91c7aa969f0b"
PCI = "devices/pci0000:00/0000:00:0d.2"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(root: Path, rel: str, target_rel: str) -> None:
    """A relative symlink at ``rel`` pointing to ``target_rel`` (both relative to root), as
    sysfs makes them."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(root / target_rel, path.parent))


def _netdev(root: Path, devdir: str, name: str, files: dict[str, str], *, device: bool) -> None:
    base = f"{devdir}/net/{name}"
    for attr, text in files.items():
        _write(root, f"{base}/{attr}", text)
    if device:
        _link(root, f"{base}/device", devdir)
    _link(root, f"class/net/{name}", base)


def _fake_sysfs(root: Path) -> None:
    xd = f"{PCI}/domain0/0-0/0-1"
    _write(root, f"{PCI}/domain0/0-0/unique_id", HOST + "\n")
    _write(root, f"{xd}/unique_id", PEER + "\n")
    for attr, text in {"rx_speed": "20.0 Gb/s\n", "rx_lanes": "2\n", "tx_speed": "20.0 Gb/s\n", "tx_lanes": "2\n"}.items():
        _write(root, f"{xd}/{attr}", text)
    _write(root, f"{xd}/0-1.0/key", "network\n")
    for dev in ("domain0", "0-0", "0-1", "0-1.0"):
        target = f"{PCI}/domain0" if dev == "domain0" else f"{PCI}/domain0/0-0" if dev == "0-0" else xd if dev == "0-1" else f"{xd}/0-1.0"
        _link(root, f"bus/thunderbolt/devices/{dev}", target)
    up = {"operstate": "up\n", "carrier": "1\n", "type": "1\n", "ifalias": "\n"}
    _netdev(root, f"{xd}/0-1.0", "thunderbolt0", up, device=True)
    _netdev(root, "devices/pci0000:00/0000:00:1f.6", "eno1", {**up, "speed": "1000\n"}, device=True)
    wifi = "devices/pci0000:00/0000:00:14.3"
    _netdev(root, wifi, "wlp0s20f3", {"operstate": "down\n", "type": "1\n"}, device=True)  # carrier unreadable
    _link(root, f"{wifi}/net/wlp0s20f3/phy80211", f"{wifi}/ieee80211/phy0")
    (root / f"{wifi}/ieee80211/phy0").mkdir(parents=True)
    _netdev(root, "devices/virtual", "lo", {"operstate": "unknown\n", "carrier": "1\n", "type": "772\n"}, device=False)
    _netdev(root, "devices/virtual", "docker0", up, device=False)
    marker = bench_alias("bench-host-0", "bench-host-1", 40) + "\n"
    _netdev(root, "devices/virtual", "tb0a0", {**up, "ifalias": marker, "speed": "10000\n"}, device=False)


def _ip_argv(addrs: dict[str, list[str]]) -> tuple[str, ...]:
    """A command that prints what `ip -j -4 addr show` would for these interfaces."""
    doc = [
        {"ifname": n, "addr_info": [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1])} for a in v]}
        for n, v in addrs.items()
    ]
    return (sys.executable, "-c", f"print({json.dumps(json.dumps(doc))})")


EXPECTED = [
    PortInfo("eno1", "ethernet", None, None, True, 1.0, ("192.168.1.5/24",), False),
    PortInfo("tb0a0", "thunderbolt", "bench-host-0", "bench-host-1", True, 40.0, ("10.77.0.1/30",), False),
    PortInfo("thunderbolt0", "thunderbolt", HOST.upper(), PEER.upper(), True, 40.0, ("169.254.1.1/30",), False),
    PortInfo("wlp0s20f3", "wifi", None, None, False, None, (), False),
]
ADDRS = {"lo": ["127.0.0.1/8"], "eno1": ["192.168.1.5/24"], "docker0": ["172.17.0.1/16"],
         "tb0a0": ["10.77.0.1/30"], "thunderbolt0": ["169.254.1.1/30"]}


@linux_only
@pytest.mark.trio
async def test_detect_ports_on_a_fake_sysfs_tree(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    assert await detect_ports(sysfs_root=tmp_path, ip_argv=_ip_argv(ADDRS)) == EXPECTED


@linux_only
@pytest.mark.trio
async def test_detect_ports_restricted_to_some_interfaces(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    got = await detect_ports(sysfs_root=tmp_path, interfaces={"thunderbolt0", "docker0", "nope"}, ip_argv=_ip_argv(ADDRS))
    assert got == [EXPECTED[2]]


def test_read_sysfs_snapshot_format(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    snap = read_sysfs(tmp_path)
    assert snap["class/net/thunderbolt0/device@"] == f"{PCI}/domain0/0-0/0-1/0-1.0"
    assert snap["class/net/wlp0s20f3/phy80211@"] == "devices/pci0000:00/0000:00:14.3/ieee80211/phy0"
    assert snap["bus/thunderbolt/devices/0-1/rx_lanes"] == "2\n"
    assert snap["class/net/docker0/"] == ""
    assert "class/net/wlp0s20f3/carrier" not in snap and "class/net/docker0/device@" not in snap
    assert not any(k.startswith("bus/thunderbolt/devices/0-1.0/") for k in snap)  # services are not read


def test_read_sysfs_skips_unreadable_files_and_refuses_huge_ones(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    (tmp_path / f"{PCI}/domain0/0-0/0-1/0-1.0/net/thunderbolt0/speed").mkdir()  # open() fails: skipped
    assert "class/net/thunderbolt0/speed" not in read_sysfs(tmp_path)
    _write(tmp_path, "devices/virtual/net/docker0/ifalias", "x" * (SYSFS_FILE_BYTES_MAX + 1))
    with pytest.raises(CaptureError):
        read_sysfs(tmp_path)


@linux_only
@pytest.mark.trio
async def test_detect_ports_on_an_empty_tree(tmp_path: Path) -> None:
    assert await detect_ports(sysfs_root=tmp_path, ip_argv=_ip_argv({})) == []


@linux_only
@pytest.mark.trio
async def test_detect_ports_reports_tool_failures_as_tool_error(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    with pytest.raises(ToolError):
        await detect_ports(sysfs_root=tmp_path, ip_argv=("/nonexistent/ip",))
    with pytest.raises(CaptureError):
        await detect_ports(sysfs_root=tmp_path, ip_argv=("echo", "not json"))


# ---------------------------------------------------------------------------------------
# run_tool


@pytest.mark.trio
async def test_run_tool() -> None:
    assert await run_tool(("echo", "hi"), timeout_s=10) == "hi\n"
    with pytest.raises(ToolError, match="within"):
        await run_tool(("sleep", "30"), timeout_s=0.2)
    with pytest.raises(ToolError, match="more than"):
        await run_tool(("yes",), timeout_s=10, output_max=10_000)
    with pytest.raises(ToolError, match="exit status 3"):
        await run_tool((sys.executable, "-c", "raise SystemExit(3)"), timeout_s=10)
    with pytest.raises(ToolError, match="cannot run"):
        await run_tool(("/nonexistent/tool",), timeout_s=10)


# ---------------------------------------------------------------------------------------
# watch

A = [PortInfo("en2", "thunderbolt", "D-A", "D-B", True, 40.0, (), False)]
B = [PortInfo("en2", "thunderbolt", "D-A", "D-B", False, None, (), False)]


def _script(steps: list[list[PortInfo] | Exception]):  # type: ignore[no-untyped-def]
    it = iter(steps)

    async def detect() -> list[PortInfo]:
        step = next(it)
        if isinstance(step, Exception):
            raise step
        return step

    return detect


@pytest.mark.trio
async def test_watch_sends_only_changes_and_survives_failures(autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    steps: list[list[PortInfo] | Exception] = [
        A, A, ToolError("ip: exit status 1"), ToolError("ip: exit status 1"), CaptureError("bad"), A, B, B, [],
    ]
    send, receive = trio.open_memory_channel[list[PortInfo]](len(steps))
    caplog.set_level(logging.INFO, logger="p2pmesh.linkwatch")
    start = trio.current_time()
    await watch(send, period_s=0.5, detect=_script(steps), max_polls=len(steps))
    assert trio.current_time() - start == pytest.approx(0.5 * (len(steps) - 1))
    got = []
    while True:
        try:
            got.append(receive.receive_nowait())
        except trio.WouldBlock:
            break
    assert got == [A, B, []]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # the repeated ToolError is logged once, then the CaptureError
    assert "exit status 1" in warnings[0] and "bad" in warnings[1]


@pytest.mark.trio
async def test_watch_with_a_full_channel_sends_the_newest_list_later(autojump_clock: trio.abc.Clock) -> None:
    send, receive = trio.open_memory_channel[list[PortInfo]](1)
    send.send_nowait([])  # the receiver has not read yet: the channel is full
    await watch(send, period_s=0.1, detect=_script([A, B, B]), max_polls=2)
    assert receive.receive_nowait() == []
    await watch(send, period_s=0.1, detect=_script([B]), max_polls=1)
    assert receive.receive_nowait() == B  # A was never queued behind the stale list


@pytest.mark.trio
async def test_watch_stops_when_the_receiver_is_gone(autojump_clock: trio.abc.Clock) -> None:
    send, receive = trio.open_memory_channel[list[PortInfo]](1)
    await receive.aclose()
    await watch(send, period_s=0.1, detect=_script([A]))  # returns instead of polling forever


@pytest.mark.trio
async def test_watch_refuses_bad_arguments() -> None:
    send, _ = trio.open_memory_channel[list[PortInfo]](1)
    for period in (0.0, 0.05, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            await watch(send, period_s=period, detect=_script([]))
    unbounded, _ = trio.open_memory_channel[list[PortInfo]](float("inf"))
    with pytest.raises(ValueError, match="bounded"):
        await watch(unbounded, period_s=1.0, detect=_script([]))


# ---------------------------------------------------------------------------------------
# network namespaces

DETECT_IN_NS = """
import json, trio
from p2pmesh.drivers.linkwatch import detect_ports
ports = trio.run(detect_ports)
print(json.dumps([[p.interface, p.kind, p.domain_uuid, p.peer_domain_uuid, p.up, p.gbps, list(p.ipv4), p.rdma] for p in ports]))
"""
NS_TIMEOUT_S = 30
WAIT_TRIES = 50


def _ports_in(bench: Bench, host: int) -> list[PortInfo]:
    r = subprocess.run(
        [*bench.exec_prefix(host), sys.executable, "-c", DETECT_IN_NS],
        check=False, capture_output=True, text=True, timeout=NS_TIMEOUT_S, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return [PortInfo(i, k, d, p, u, g, tuple(a), rd) for i, k, d, p, u, g, a, rd in json.loads(r.stdout)]


def _wait_for_up(bench: Bench, host: int, want: bool) -> list[PortInfo]:
    ports: list[PortInfo] = []
    for _ in range(WAIT_TRIES):  # carrier follows `ip link set` at once; allow for a slow CI box
        ports = _ports_in(bench, host)
        if ports and all(p.up is want for p in ports):
            return ports
        time.sleep(0.1)
    return ports


@linux_only
def test_bench_veth_ends_are_thunderbolt_ports_in_namespaces() -> None:
    require_root()
    u0, u1 = "a0000000-0000-4000-8000-000000000000", "b1111111-0000-4000-8000-000000000001"
    bench = Bench.create(2)
    try:
        cable = bench.plug(0, 1)
        ip("-n", cable.a, "link", "set", "dev", cable.dev_a, "alias", bench_alias(u0, u1, 40))
        ip("-n", cable.b, "link", "set", "dev", cable.dev_b, "alias", bench_alias(u1, u0, 40))
        assert _wait_for_up(bench, 0, True) == [
            PortInfo(cable.dev_a, "thunderbolt", u0, u1, True, 40.0, (f"{cable.addr_a}/30",), False)
        ]
        assert _wait_for_up(bench, 1, True) == [
            PortInfo(cable.dev_b, "thunderbolt", u1, u0, True, 40.0, (f"{cable.addr_b}/30",), False)
        ]
        bench.set_link(cable, False)
        for host, dev in ((0, cable.dev_a), (1, cable.dev_b)):
            (port,) = _wait_for_up(bench, host, False)
            assert (port.interface, port.up, port.kind) == (dev, False, "thunderbolt")
        # Only one end down: the other end loses carrier too (a pulled cable).
        bench.set_link(cable, True)
        ip("-n", cable.b, "link", "set", cable.dev_b, "down")
        (port,) = _wait_for_up(bench, 0, False)
        assert (port.interface, port.up) == (cable.dev_a, False)
    finally:
        bench.close()
