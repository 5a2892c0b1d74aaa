"""`p2pmesh doctor`: check this machine and say what to fix.

  p2pmesh doctor [--json] [--state-dir DIR] [--socket PATH] [--interface NAME]...
                 [--skip CHECK]... [--timeout-s S]

This is the driver half. It gathers facts: bounded commands through drivers/linkwatch.run_tool,
a sysfs snapshot, /proc/meminfo, the agent's control socket and a zeroconf round trip. It hands
them to p2pmesh/platform/doctor*.py, which judge. Every command has a timeout (system_profiler gets
three times --timeout-s, it is slow) and every network wait is bounded (mDNS at most 3 s). A
missing tool turns its check into "skip"; a check that crashes becomes a "fail" naming the bug,
never a traceback. Nothing on the machine is changed; the throwaway mDNS service is withdrawn
when the probe ends.

Checks (docs/troubleshooting.md): thunderbolt, addresses, bridge, rdma, firewall, mdns, mlx,
memory, agent. Exit codes: 0 no check failed (warnings allowed), 1 a check failed, 2 bad usage.
cli/app.py calls add_parser/run; `python -m p2pmesh.cli.doctor_cmd` runs it on its own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2pmesh.core import advert
from p2pmesh.drivers.linkwatch import (
    IBV_DEVICES_ARGV,
    IFCONFIG_ARGV,
    IP_ADDR_ARGV,
    NETWORKSETUP_ARGV,
    SYSTEM_PROFILER_ARGV,
    ToolError,
    read_sysfs,
    run_tool,
)
from p2pmesh.platform.doctor import (
    CHECK_NAMES,
    REPORT_FIX,
    Check,
    Output,
    exit_code,
    render_text,
    report_json,
    skipped,
)
from p2pmesh.platform.doctor_cluster import MdnsProbe, SeenAdvert, check_agent, check_mdns
from p2pmesh.platform.doctor_firewall import (
    FIREWALL_TOOL,
    MacFirewallFacts,
    check_firewall_linux,
    check_firewall_macos,
    firewall_app_path,
)
from p2pmesh.platform.doctor_host import check_memory_linux, check_memory_macos, check_mlx
from p2pmesh.platform.doctor_links import (
    LinkFacts,
    LinuxFacts,
    MacFacts,
    check_addresses,
    check_bridge,
    check_rdma,
    check_thunderbolt,
    usable_interfaces,
)
from p2pmesh.platform.thunderbolt import CaptureError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
TIMEOUT_S_DEFAULT = 10.0
TIMEOUT_S_MAX = 300.0
SYSTEM_PROFILER_FACTOR = 3.0  # it takes about a second, much more on a loaded Mac
MDNS_WINDOW_S_MAX = 3.0
MDNS_PEER_WAIT_S = 1.0  # after our own answer, keep listening this long for other agents
MDNS_CLOSE_S = 2.0  # zeroconf's goodbye packets; past this the probe thread is abandoned
MDNS_PEERS_MAX = 32  # agents resolved per interface
INTERFACES_MAX = 32
MEMINFO_BYTES_MAX = 64 * 1024
DOCTOR_SERVICE_TYPE = "_p2pmesh-doctor._tcp.local."
"""Not the agents' type, so running agents never try to parse the throwaway service."""
MDNS_PORT = 5353
_IFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,31}")

# Run as `python -c` so a broken MLX (an import that crashes, a hung Metal init) cannot take
# the doctor down; it prints one JSON object and always exits 0 on its own.
MLX_PROBE = r"""
import importlib.metadata, importlib.util, json, platform, sys
out = {"python": sys.executable, "machine": platform.machine()}
try:
    import mlx.core as mx
except Exception as e:
    out["import_error"] = f"{type(e).__name__}: {e}"
else:
    out["version"] = getattr(mx, "__version__", None)
    out["device"] = str(mx.default_device())
    try:
        out["metal"] = bool(mx.metal.is_available())
    except Exception:
        out["metal"] = False
    try:
        a = mx.array([[1.0, 2.0], [3.0, 4.0]])
        out["matmul"] = (a @ a).tolist()
    except Exception as e:
        out["matmul"] = f"{type(e).__name__}: {e}"
    try:
        out["ring"] = bool(mx.distributed.is_available("ring"))
        out["jaccl"] = bool(mx.distributed.is_available("jaccl"))
    except Exception:
        out["ring"] = bool(mx.distributed.is_available())
    try:
        out["working_set_bytes"] = int(mx.device_info().get("max_recommended_working_set_size") or 0)
    except Exception:
        pass
# Found, not imported: importing mlx_lm pulls in transformers, which takes seconds.
if importlib.util.find_spec("mlx_lm") is not None:
    try:
        out["mlx_lm"] = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        out["mlx_lm"] = "installed"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Options:
    state_dir: Path
    socket: Path
    interfaces: tuple[str, ...]
    skip: frozenset[str]
    timeout_s: float


def add_parser(subparsers: Any) -> None:
    """Add `doctor` to an argparse subparsers object (from add_subparsers())."""
    helptext = "check this machine (cables, bridge, RDMA, firewall, mDNS, MLX, memory, agent) and say what to fix"
    doctor = subparsers.add_parser("doctor", help=helptext, description=helptext)
    doctor.set_defaults(run=run)
    _add_arguments(doctor)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from p2pmesh.agent import default_state_dir

    p.add_argument("--json", action="store_true", help='one JSON object: {"ok": bool, "checks": [...]}')
    p.add_argument("--state-dir", type=Path, default=default_state_dir(), help="the agent's state directory (default: %(default)s)")
    p.add_argument("--socket", type=Path, default=None, help="the agent's control socket (default: agent.sock in --state-dir)")
    p.add_argument("--interface", action="append", default=[], metavar="NAME",
                   help="probe mDNS on this interface (repeatable; default: every port that is up)")
    p.add_argument("--skip", action="append", default=[], choices=CHECK_NAMES, metavar="CHECK",
                   help=f"leave a check out (repeatable): {', '.join(CHECK_NAMES)}")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S_DEFAULT, metavar="S",
                   help="bound on each command and network wait (default %(default)s; mDNS waits at most 3 s)")


def run(args: argparse.Namespace) -> int:
    """Run every check not skipped; print the report; 0 if none failed, 1 if one did, 2 on bad usage."""
    timeout = args.timeout_s
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and 0 < timeout <= TIMEOUT_S_MAX):
        print(f"p2pmesh: --timeout-s must be a number of seconds in (0, {TIMEOUT_S_MAX:g}]", file=sys.stderr)
        return EXIT_USAGE
    bad = [n for n in args.skip if n not in CHECK_NAMES] + [n for n in args.interface if not _IFACE.fullmatch(n)]
    if bad:
        print(f"p2pmesh: not a check or interface name: {', '.join(map(repr, bad))}", file=sys.stderr)
        return EXIT_USAGE
    opts = Options(args.state_dir, args.socket or args.state_dir / "agent.sock", tuple(dict.fromkeys(args.interface)),
                   frozenset(args.skip), float(timeout))
    checks = trio.run(gather, opts)
    print(json.dumps(report_json(checks)) if args.json else render_text(checks))
    return exit_code(checks)


# ---------------------------------------------------------------------------------------
# Orchestration


async def gather(opts: Options) -> list[Check]:
    """Every check, in CHECK_NAMES order. Independent gathers run concurrently; the mDNS
    probe waits for the link facts (its default interfaces) and the agent (its members)."""
    checks: dict[str, Check] = {name: skipped(name, f"skipped (--skip {name})") for name in opts.skip}

    async def guarded(name: str, fn: Callable[..., Awaitable[Check]], *args: Any) -> None:
        try:
            checks[name] = await fn(*args)
        except Exception as exc:  # a bug in one check must not hide the others' results
            checks[name] = _crashed(name, exc)

    async with trio.open_nursery() as nursery:
        for name, fn in (("mlx", _mlx), ("memory", _memory), ("firewall", _firewall)):
            if name not in opts.skip:
                nursery.start_soon(guarded, name, fn, opts)
        nursery.start_soon(_links_agent_mdns_guarded, opts, checks, guarded)
    return [checks.get(name) or Check(name, "fail", "the check did not finish", REPORT_FIX) for name in CHECK_NAMES]


async def _links_agent_mdns_guarded(opts: Options, checks: dict[str, Check], guarded: Any) -> None:
    try:
        await _links_agent_mdns(opts, checks, guarded)
    except Exception as exc:  # gathering the shared facts broke: every check still waiting on them fails
        for name in ("thunderbolt", "addresses", "bridge", "rdma", "agent", "mdns"):
            checks.setdefault(name, _crashed(name, exc))


def _crashed(name: str, exc: BaseException) -> Check:
    return Check(name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}", f"this is a p2pmesh bug: {REPORT_FIX}")


async def _links_agent_mdns(opts: Options, checks: dict[str, Check], guarded: Any) -> None:
    want = [n for n in ("thunderbolt", "addresses", "bridge", "rdma") if n not in opts.skip]
    facts: list[LinkFacts] = []
    agent: list[tuple[dict[str, Any] | None, str | None]] = []
    async with trio.open_nursery() as nursery:
        if want or ("mdns" not in opts.skip and not opts.interfaces):
            nursery.start_soon(_append, facts, _link_facts(opts.timeout_s))
        if "agent" not in opts.skip or "mdns" not in opts.skip:
            nursery.start_soon(_append, agent, _agent_status(opts.socket, opts.timeout_s))
    judges = {"thunderbolt": check_thunderbolt, "addresses": check_addresses, "bridge": check_bridge, "rdma": check_rdma}
    for name in want:
        try:
            checks[name] = judges[name](facts[0])
        except Exception as exc:  # as in gather(): one bug, one failed check
            checks[name] = _crashed(name, exc)
    status, error = agent[0] if agent else (None, None)
    if "agent" not in opts.skip:
        checks["agent"] = check_agent(status, error, socket=str(opts.socket))
    if "mdns" not in opts.skip:
        await guarded("mdns", _mdns, opts, facts[0] if facts else None, status)


async def _append(into: list[Any], value: Awaitable[Any]) -> None:
    into.append(await value)


async def _run(argv: Sequence[str], timeout_s: float) -> Output:
    """A command's stdout as an Output: missing tool, failure and timeout are reasons, not errors."""
    if shutil.which(argv[0]) is None:
        return Output(None, f"{argv[0]} is not installed", missing=True)
    try:
        return Output(await run_tool(argv, timeout_s=timeout_s))
    except ToolError as exc:
        return Output(None, str(exc))


async def _run_all(commands: dict[str, tuple[Sequence[str], float]]) -> dict[str, Output]:
    out: dict[str, Output] = {}

    async def one(key: str, argv: Sequence[str], timeout_s: float) -> None:
        out[key] = await _run(argv, timeout_s)

    async with trio.open_nursery() as nursery:
        for key, (argv, timeout_s) in commands.items():
            nursery.start_soon(one, key, argv, timeout_s)
    return out


# ---------------------------------------------------------------------------------------
# Gathering


async def _link_facts(timeout_s: float) -> LinkFacts:
    """The same sources the agent's link watcher reads (drivers/linkwatch.py), plus
    rdma_ctl and the macOS version on a Mac and the bridges on Linux."""
    if sys.platform == "darwin":
        out = await _run_all({
            "system_profiler": (SYSTEM_PROFILER_ARGV, timeout_s * SYSTEM_PROFILER_FACTOR),
            "networksetup": (NETWORKSETUP_ARGV, timeout_s),
            "ifconfig": (IFCONFIG_ARGV, timeout_s),
            "ibv_devices": (IBV_DEVICES_ARGV, timeout_s),
            "rdma_ctl": (("rdma_ctl", "status"), timeout_s),
            "os_version": (("sw_vers", "-productVersion"), timeout_s),
        })
        return MacFacts(**out)
    from p2pmesh.drivers.netconfig import NetconfigError, gather_bridges

    snapshot: dict[str, str] | None = None
    sysfs_error = bridges_error = None
    try:
        snapshot = await trio.to_thread.run_sync(read_sysfs, Path("/sys"))
    except (CaptureError, OSError) as exc:
        sysfs_error = str(exc)
    ip_addr = await _run(IP_ADDR_ARGV, timeout_s)
    bridges: dict[str, list[str]] | None = None
    try:
        bridges = await gather_bridges(timeout_s=timeout_s)
    except NetconfigError as exc:
        bridges_error = str(exc)
    return LinuxFacts(snapshot, ip_addr, Path("/sys/bus/thunderbolt").is_dir(), bridges, sysfs_error, bridges_error)


async def _agent_status(socket: Path, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """The agent's status object, or why there is none (None: no agent runs there, which
    the check says itself)."""
    from p2pmesh.client import AgentNotRunning, AsyncClient, P2PMeshError

    with trio.move_on_after(timeout_s + 1.0):
        try:
            return await AsyncClient(socket).status_object(timeout=timeout_s), None
        except AgentNotRunning:
            return None, None
        except P2PMeshError as exc:
            return None, str(exc)
    return None, f"the agent at {socket} did not answer within {timeout_s:g} s"


async def _mlx(opts: Options) -> Check:
    return check_mlx(await _run([sys.executable, "-c", MLX_PROBE], opts.timeout_s), sys.platform)


async def _memory(opts: Options) -> Check:
    if sys.platform == "darwin":
        out = await _run_all({
            "vm_stat": (("vm_stat",), opts.timeout_s),
            "memsize": (("sysctl", "-n", "hw.memsize"), opts.timeout_s),
            "wired_limit": (("sysctl", "-n", "iogpu.wired_limit_mb"), opts.timeout_s),  # absent before macOS 14
        })
        return check_memory_macos(out["vm_stat"], out["memsize"], out["wired_limit"])
    try:
        with open("/proc/meminfo", "rb") as f:
            meminfo = Output(f.read(MEMINFO_BYTES_MAX).decode("ascii", "replace"))
    except OSError as exc:
        meminfo = Output(None, f"cannot read /proc/meminfo: {exc.strerror}", missing=True)
    return check_memory_linux(meminfo)


async def _firewall(opts: Options) -> Check:
    if sys.platform == "darwin":
        if not os.path.exists(FIREWALL_TOOL):
            return skipped("firewall", f"{FIREWALL_TOOL} is missing")
        app = firewall_app_path(os.path.realpath(sys.executable))
        out = await _run_all({key: ((FIREWALL_TOOL, *flags), opts.timeout_s) for key, flags in (
            ("global_state", ("--getglobalstate",)), ("block_all", ("--getblockall",)),
            ("stealth", ("--getstealthmode",)), ("app_blocked", ("--getappblocked", app)))})
        return check_firewall_macos(MacFirewallFacts(app_path=app, **out))
    from p2pmesh.agent import DEFAULT_PORT, AgentConfig

    out = await _run_all({"nft": (("nft", "list", "ruleset"), opts.timeout_s),
                          "iptables-save": (("iptables-save",), opts.timeout_s)})
    ports = [("tcp", DEFAULT_PORT, "peer connections"), ("udp", MDNS_PORT, "mDNS discovery"),
             ("tcp", AgentConfig().data_port_base, "the data plane's first worker port")]
    return check_firewall_linux(list(out.items()), ports, root=os.geteuid() == 0)


# ---------------------------------------------------------------------------------------
# mDNS


async def _mdns(opts: Options, facts: LinkFacts | None, status: dict[str, Any] | None) -> Check:
    from p2pmesh.drivers.discovery import interface_addresses

    window_s = min(MDNS_WINDOW_S_MAX, opts.timeout_s)
    names = list(opts.interfaces) or (usable_interfaces(facts) if facts is not None else []) or _all_interfaces()
    targets: list[tuple[str, list[str]]] = []
    notes: list[str] = []
    for name in names[:INTERFACES_MAX]:
        addrs = interface_addresses([name], include_loopback=False)
        if addrs:
            targets.append((name, addrs))
        elif name in opts.interfaces:
            targets.append((name, []))  # asked for by name: its absence is a finding, not a note
        else:
            notes.append(f"{name}: no IP address, nothing to test")
    token = os.urandom(6).hex()
    results: list[tuple[MdnsProbe, list[SeenAdvert]]] = []
    async with trio.open_nursery() as nursery:
        for i, (name, addrs) in enumerate(targets):
            nursery.start_soon(_probe_bounded, results, name, addrs, window_s, f"{token}-{i}")
    probes = sorted((p for p, _ in results), key=lambda p: p.interface)
    members = [str(m.get("node_id")) for m in status.get("members") or [] if isinstance(m, dict)] if status else None
    return check_mdns(probes, [a for _, ads in results for a in ads], window_ms=int(window_s * 1000),
                      platform=sys.platform, own_node_id=status.get("node_id") if status else None,
                      fingerprint=_fingerprint(opts.state_dir), members=members,
                      over_ssh="SSH_CONNECTION" in os.environ, notes=notes)


def _all_interfaces() -> list[str]:
    """Every interface with an address but loopback: the agent's own default."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        ips = [ip.ip if isinstance(ip.ip, str) else ip.ip[0] for ip in adapter.ips]
        if any(not (ip.startswith("127.") or ip == "::1") for ip in ips):
            out.append(adapter.nice_name)
    return sorted(set(out))


def _fingerprint(state_dir: Path) -> str | None:
    """This Mac's cluster-key fingerprint, to spot agents holding another key; None if unknown."""
    from p2pmesh.drivers import keys
    from p2pmesh.drivers.tls import cluster_fingerprint

    path = state_dir / keys.KEY_FILE
    try:
        return cluster_fingerprint(keys.read_key(path)) if path.exists() else None
    except (OSError, keys.KeyError_):
        return None


async def _probe_bounded(results: list[tuple[MdnsProbe, list[SeenAdvert]]], interface: str, addrs: list[str],
                         window_s: float, token: str) -> None:
    """One interface's probe in a worker thread (zeroconf blocks), abandoned if it overstays."""
    result = None
    if not addrs:
        result = (MdnsProbe(interface, (), None, "no such interface, or it has no IP address"), [])
    else:
        with trio.move_on_after(window_s + MDNS_CLOSE_S):
            result = await trio.to_thread.run_sync(_probe, interface, addrs, window_s, token, abandon_on_cancel=True)
    results.append(result or (MdnsProbe(interface, tuple(addrs), None,
                                        f"zeroconf did not finish within {window_s + MDNS_CLOSE_S:g} s"), []))


def _probe(interface: str, addrs: list[str], window_s: float, token: str) -> tuple[MdnsProbe, list[SeenAdvert]]:
    """Register a throwaway service on this interface with one zeroconf instance and browse
    for it with a second one, bound the way drivers/discovery.py binds the agent's. Seeing it
    proves zeroconf can bind, join the group and send here; other hosts are not involved."""
    from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

    from p2pmesh.drivers.discovery import _zc_interfaces

    started = time.monotonic()
    deadline = started + window_s
    own = f"doctor-{token}.{DOCTOR_SERVICE_TYPE}"
    seen = threading.Event()
    seen_at: list[float] = []
    peers: dict[str, None] = {}
    zcs: list[Zeroconf] = []
    adverts: list[SeenAdvert] = []
    error = None

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Added:
            return
        if name == own and not seen_at:
            seen_at.append(time.monotonic())
            seen.set()
        elif service_type == advert.SERVICE_TYPE and len(peers) < MDNS_PEERS_MAX:
            peers[name] = None

    has4, has6 = any(":" not in a for a in addrs), any(":" in a for a in addrs)
    version = IPVersion.All if has4 and has6 else IPVersion.V4Only if has4 else IPVersion.V6Only
    try:
        bind = _zc_interfaces(addrs)
        if not bind:
            raise OSError("only global IPv6 addresses here; discovery binds IPv4 and link-local IPv6")
        zcs.append(Zeroconf(interfaces=bind, ip_version=version))
        info = ServiceInfo(DOCTOR_SERVICE_TYPE, own, port=9, properties={"by": "p2pmesh doctor"},
                           parsed_addresses=[a.split("%")[0] for a in addrs], server=f"p2pmesh-doctor-{token}.local.")
        # A random name needs no conflict probing (as in discovery.py): announce at once.
        zcs[0].register_service(info, cooperating_responders=True)
        zcs.append(Zeroconf(interfaces=bind, ip_version=version))
        ServiceBrowser(zcs[1], [DOCTOR_SERVICE_TYPE, advert.SERVICE_TYPE], handlers=[on_change])
        seen.wait(max(0.0, deadline - time.monotonic()))
        # Other agents answer the browser's first query within about a second of it; on a
        # busy machine our own answer may come late, so the wait counts from it.
        heard = seen_at[0] if seen_at else started
        time.sleep(max(0.0, min(deadline, heard + MDNS_PEER_WAIT_S) - time.monotonic()))
        for name in list(peers):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms < 50:
                break
            found = zcs[1].get_service_info(advert.SERVICE_TYPE, name, timeout=min(left_ms, 1000))
            if found is not None:
                adverts.append(SeenAdvert(name, interface, dict(found.properties)))
    except Exception as exc:  # zeroconf and the OS raise many types; all mean "no mDNS here"
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for zc in reversed(zcs):
            try:
                zc.close()  # withdraws the throwaway service (goodbye packets)
            except Exception:  # closing on an interface that vanished may fail: nothing to undo
                pass
    seen_ms = int((seen_at[0] - started) * 1000) if seen_at else None
    return MdnsProbe(interface, tuple(addrs), seen_ms, error), adverts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2pmesh doctor", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
