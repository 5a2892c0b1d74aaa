"""The link watcher: find this host's ports (PortInfo) and report when they change.

``detect_ports`` gathers the raw facts and hands them to the pure parsers in
platform/linux_links.py:
- Linux: a bounded snapshot of sysfs (see linux_links for its format) plus
  ``ip -j -4 addr show``. Both are cheap, so the watcher can poll every second.
- macOS: ``system_profiler SPThunderboltDataType -json`` (slow, about a second: poll it
  rarely), ``networksetup -listallhardwareports``, ``ifconfig`` and, when installed,
  ``ibv_devices`` (missing -> no RDMA).

Every command runs with a timeout and a cap on its output. ``watch`` polls and sends the new
port list on a bounded channel only when it changed; a failing tool or a malformed capture
is logged once and the last good list stands, so a flaky tool never takes the agent down.
"""
from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from p2pmesh.core.errors import MeshError
from p2pmesh.core.messages import PortInfo
from p2pmesh.platform.linux_links import linux_ports, macos_ports
from p2pmesh.platform.thunderbolt import CaptureError

log = logging.getLogger("p2pmesh.linkwatch")

IP_ADDR_ARGV = ("ip", "-j", "-4", "addr", "show")
SYSTEM_PROFILER_ARGV = ("system_profiler", "SPThunderboltDataType", "-json")
NETWORKSETUP_ARGV = ("networksetup", "-listallhardwareports")
IFCONFIG_ARGV = ("ifconfig",)
IBV_DEVICES_ARGV = ("ibv_devices",)

TOOL_TIMEOUT_S = 10.0
SYSTEM_PROFILER_TIMEOUT_S = 30.0  # it takes ~1 s, much more on a loaded Mac
TOOL_OUTPUT_MAX = 2_000_000  # bytes; real outputs are a few KB
READ_CHUNK = 65536

# sysfs bounds: a host has tens of interfaces and a few Thunderbolt devices.
SYSFS_ENTRIES_MAX = 256  # per directory listed (class/net, bus/thunderbolt/devices)
SYSFS_FILES_MAX = 4096
SYSFS_FILE_BYTES_MAX = 4096  # one page, the most a sysfs attribute holds
NET_FILES = ("operstate", "carrier", "speed", "ifalias", "type")
NET_LINKS = ("device", "phy80211")
TB_FILES = ("unique_id", "rx_speed", "rx_lanes", "tx_speed", "tx_lanes")
_TB_DEVICE = re.compile(r"[0-9]+-[0-9a-f]+")  # routers and XDomains; not services or domains

PERIOD_MIN_S = 0.1
LINUX_PERIOD_S = 1.0
DARWIN_PERIOD_S = 10.0  # system_profiler is slow and wakes Thunderbolt controllers


class ToolError(MeshError):
    """A command we depend on is missing, timed out, failed or printed too much."""


# ---------------------------------------------------------------------------------------
# detection


async def detect_ports(
    *,
    sysfs_root: Path = Path("/sys"),
    interfaces: set[str] | None = None,
    ip_argv: Sequence[str] = IP_ADDR_ARGV,
) -> list[PortInfo]:
    """This host's ports, restricted to ``interfaces`` when given.

    Raises ToolError when a required command fails and CaptureError when its output (or
    sysfs) is malformed. ``ip_argv`` exists so tests can feed a fake tree its own addresses.
    """
    if sys.platform == "darwin":
        ports = await _detect_macos()
    else:
        snapshot = await trio.to_thread.run_sync(read_sysfs, sysfs_root, interfaces)
        ip_json = await run_tool(ip_argv, timeout_s=TOOL_TIMEOUT_S)
        ports = linux_ports(snapshot, ip_json)
    if interfaces is not None:
        ports = [p for p in ports if p.interface in interfaces]
    return ports


async def _detect_macos() -> list[PortInfo]:
    sp = await run_tool(SYSTEM_PROFILER_ARGV, timeout_s=SYSTEM_PROFILER_TIMEOUT_S)
    ns = await run_tool(NETWORKSETUP_ARGV, timeout_s=TOOL_TIMEOUT_S)
    ifc = await run_tool(IFCONFIG_ARGV, timeout_s=TOOL_TIMEOUT_S)
    ibv: str | None
    try:
        ibv = await run_tool(IBV_DEVICES_ARGV, timeout_s=TOOL_TIMEOUT_S)
    except ToolError as e:
        # Not installed, or RDMA is off: either way no port has RDMA.
        log.debug("ibv_devices unavailable (%s): reporting no RDMA", e)
        ibv = None
    return macos_ports(sp, ns, ifc, ibv)


def read_sysfs(root: Path, interfaces: set[str] | None = None) -> dict[str, str]:
    """Read the sysfs files linux_links needs into a snapshot (blocking; run in a thread).

    Unreadable files are left out: the kernel refuses some reads by design (``carrier`` of
    a down interface is EINVAL, ``speed`` of a virtual one too). At most SYSFS_FILES_MAX
    entries of at most SYSFS_FILE_BYTES_MAX bytes are read; more raises CaptureError.
    """
    snap: dict[str, str] = {}
    real_root = root.resolve()

    def add(key: str, value: str) -> None:
        if len(snap) >= SYSFS_FILES_MAX:
            raise CaptureError(f"sysfs snapshot would exceed {SYSFS_FILES_MAX} entries")
        snap[key] = value

    def read_file(key: str) -> None:
        try:
            with open(root / key, "rb") as f:
                data = f.read(SYSFS_FILE_BYTES_MAX + 1)
        except OSError:
            return
        if len(data) > SYSFS_FILE_BYTES_MAX:
            raise CaptureError(f"sysfs file {key} is larger than {SYSFS_FILE_BYTES_MAX} bytes")
        add(key, data.decode("utf-8", errors="replace"))

    def read_link(key: str) -> None:
        path = root / key
        if not path.is_symlink():
            return
        target = Path(os.path.realpath(path))
        try:
            add(key + "@", target.relative_to(real_root).as_posix())
        except ValueError:
            add(key + "@", target.as_posix())  # outside the root: linux_links uses the tail only

    for name in _listdir(root / "class" / "net"):
        if interfaces is not None and name not in interfaces:
            continue
        base = f"class/net/{name}"
        add(base + "/", "")
        for attr in NET_FILES:
            read_file(f"{base}/{attr}")
        for attr in NET_LINKS:
            read_link(f"{base}/{attr}")
        if (root / base / "wireless").is_dir():
            add(base + "/wireless/", "")
    for dev in _listdir(root / "bus" / "thunderbolt" / "devices"):
        if _TB_DEVICE.fullmatch(dev):
            for attr in TB_FILES:
                read_file(f"bus/thunderbolt/devices/{dev}/{attr}")
    return snap


def _listdir(path: Path) -> list[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []  # no such directory: no Thunderbolt bus, or a fake tree without it
    if len(names) > SYSFS_ENTRIES_MAX:
        raise CaptureError(f"{path} has {len(names)} entries (at most {SYSFS_ENTRIES_MAX})")
    return names


async def run_tool(argv: Sequence[str], *, timeout_s: float, output_max: int = TOOL_OUTPUT_MAX) -> str:
    """Run a command; its stdout as text. ToolError if it is missing, exits non-zero, runs
    longer than ``timeout_s`` (it is killed) or prints more than ``output_max`` bytes."""
    what = " ".join(argv)
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(timeout_s):
            proc = await trio.lowlevel.open_process(
                list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
            stdout = proc.stdout
            if stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
                raise ToolError(f"{what}: no stdout pipe")
            try:
                # Bounded: every pass adds at least one byte until EOF or output_max.
                while True:
                    data = await stdout.receive_some(READ_CHUNK)
                    if not data:
                        break
                    size += len(data)
                    if size > output_max:
                        raise ToolError(f"{what}: printed more than {output_max} bytes")
                    chunks.append(data)
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    with trio.CancelScope(shield=True):
                        await proc.wait()
                with trio.CancelScope(shield=True):
                    await stdout.aclose()
    except trio.TooSlowError:
        raise ToolError(f"{what}: no answer within {timeout_s:g} s") from None
    except OSError as e:  # FileNotFoundError, PermissionError
        raise ToolError(f"{what}: cannot run: {e.strerror or e}") from None
    if code != 0:
        raise ToolError(f"{what}: exit status {code}")
    return b"".join(chunks).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------
# watching

Detector = Callable[[], Awaitable[list[PortInfo]]]


def default_period_s() -> float:
    return DARWIN_PERIOD_S if sys.platform == "darwin" else LINUX_PERIOD_S


async def watch(
    send_channel: trio.MemorySendChannel[list[PortInfo]],
    *,
    period_s: float | None = None,
    detect: Detector | None = None,
    max_polls: int | None = None,
) -> None:
    """Poll every ``period_s`` and send the port list whenever it differs from the last one
    sent (the first good list is always sent).

    The channel must be bounded (a buffer of 1 is the natural size); when it is full the
    list is not sent now but on a later poll (only the newest list matters, so nothing
    queues up and a slow receiver never stalls the polling). A failure is logged once
    (at warning) until detection succeeds again, and the last good list stands. Returns when
    the receiver is closed, or after ``max_polls`` polls (tests); otherwise runs until
    cancelled.
    """
    period = default_period_s() if period_s is None else period_s
    if not (math.isfinite(period) and period >= PERIOD_MIN_S):
        raise ValueError(f"period_s must be at least {PERIOD_MIN_S} s, not {period_s!r}")
    if math.isinf(send_channel.statistics().max_buffer_size):
        raise ValueError("watch needs a bounded channel")
    detector: Detector = detect if detect is not None else detect_ports
    sent: list[PortInfo] | None = None
    failing: str | None = None
    polls = 0
    # Runs for the agent's lifetime; each pass is bounded by the tools' timeouts.
    while max_polls is None or polls < max_polls:
        if polls:
            await trio.sleep(period)
        polls += 1
        try:
            ports = await detector()
        except (ToolError, CaptureError) as e:
            message = f"{type(e).__name__}: {e}"
            if message != failing:
                log.warning("port detection failed, keeping the last good port list: %s", message)
                failing = message
        else:
            if failing is not None:
                log.info("port detection works again")
                failing = None
            if ports != sent:
                try:
                    send_channel.send_nowait(ports)
                    sent = ports
                except trio.WouldBlock:
                    pass  # the receiver is behind; the next poll retries with the newest list
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
