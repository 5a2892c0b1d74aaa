"""`p2pmesh links plan|apply` as real processes, the netconfig allowlist, and (as root) an
apply inside a network namespace that must add exactly the planned /30 and nothing else."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pmesh import cli
from p2pmesh.core.addressing import commands_for, plan_addresses, ring_from_status
from p2pmesh.drivers import netconfig
from tests.agent.netns import Bench, ip, require_root

ROOT = Path(__file__).resolve().parent.parent
A, B, C = "a" * 32, "b" * 32, "c" * 32
PLATFORM = "darwin" if sys.platform == "darwin" else "linux"
RUN_TIMEOUT_S = 60


def _hop(src: str, dst: str, si: str | None, di: str | None, sip: str | None = None, dip: str | None = None,
         kind: str = "thunderbolt") -> dict[str, Any]:
    return {"from": src, "to": dst, "kind": kind, "gbps": 40, "rtt_ms": 0.3, "from_interface": si,
            "to_interface": di, "from_ipv4": sip, "to_ipv4": dip, "rdma": False}


def _status(me: str, hops: list[dict[str, Any]], order: list[str] | None = None, epoch: int = 4) -> dict[str, Any]:
    return {"node_id": me, "role": "follower", "members": [],
            "ring": {"epoch": epoch, "order": order or [A, B, C], "hops": hops}}


RING3 = [_hop(A, B, "p2pmnope2", "en5"), _hop(B, C, "en6", "en2", "10.9.0.1", "10.9.0.2"), _hop(C, A, "en3", "p2pmnope3")]


def _write(tmp_path: Path, status: Any, name: str = "status.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(status), encoding="utf-8")
    return path


def _p2pmesh(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), sys.executable, "-m", "p2pmesh", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)


# ---------------------------------------------------------------------------------------
# plan


def test_plan_json_from_a_status_file(tmp_path: Path) -> None:
    status = _status(A, RING3)
    r = _p2pmesh("links", "plan", "--status-file", str(_write(tmp_path, status)), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"node_id", "epoch", "assignments", "commands", "warnings"}
    assert (out["node_id"], out["epoch"]) == (A, 4)
    view = ring_from_status(status)
    assert view is not None
    plan = plan_addresses(view.hops)
    assert out["commands"] == commands_for(A, plan, PLATFORM)
    assert len(out["commands"]) == 2  # A's two cables; the B-C pair is kept
    assert {(x["node_id"], x["interface"], x["reused"]) for x in out["assignments"]} >= {(B, "en6", True), (A, "p2pmnope2", False)}
    assert all(isinstance(w, str) for w in out["warnings"])


def test_plan_text_names_interface_and_cable_and_changes_nothing(tmp_path: Path) -> None:
    r = _p2pmesh("links", "plan", "--status-file", str(_write(tmp_path, _status(A, RING3))))
    assert r.returncode == 0, r.stderr
    assert "nothing is changed by `plan`" in r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith(("  ip ", "  ifconfig "))]
    assert len(lines) == 2
    assert all("# p2pmnope" in line and "cable to" in line for line in lines)


def test_plan_for_a_node_outside_the_ring_or_with_no_ring(tmp_path: Path) -> None:
    r = _p2pmesh("links", "plan", "--status-file", str(_write(tmp_path, _status("d" * 32, RING3))))
    assert r.returncode == 0 and "not in ring epoch 4" in r.stdout
    r = _p2pmesh("links", "plan", "--status-file", str(_write(tmp_path, {"node_id": A, "ring": None})))
    assert r.returncode == 2 and "no ring is committed" in r.stderr


@pytest.mark.parametrize("content, match", [
    ("{not json", "is not a JSON status"),
    (json.dumps(_status(A, [_hop(A, B, "en2", None)])), "no interface is known"),
    (json.dumps({"node_id": A, "ring": {"epoch": "x"}}), "malformed"),
])
def test_plan_refuses_bad_input_with_exit_2(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(content, encoding="utf-8")
    r = _p2pmesh("links", "plan", "--status-file", str(path))
    assert r.returncode == 2 and match in r.stderr and r.stdout == ""
    r = _p2pmesh("links", "plan", "--status-file", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_links_help_names_every_subcommand() -> None:
    r = _p2pmesh("links", "--help")
    assert r.returncode == 0
    assert all(word in r.stdout for word in ("parse", "plan", "apply"))


def _fake_agent(path: Path, status: dict[str, Any], stop: threading.Event) -> threading.Thread:
    """A control socket that answers `status` like the agent (one JSON line each way)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    server.settimeout(0.2)

    def serve() -> None:
        with server:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(5)
                    request = conn.makefile("rb").readline()
                    assert json.loads(request)["op"] == "status"
                    conn.sendall(json.dumps({"ok": True, "status": status}).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_plan_asks_the_running_agent_through_its_control_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stop = threading.Event()
    thread = _fake_agent(tmp_path / "agent.sock", _status(A, RING3), stop)
    try:
        assert cli.main(["links", "plan", "--state-dir", str(tmp_path), "--json"]) == 0
    finally:
        stop.set()
        thread.join(5)
    out = json.loads(capsys.readouterr().out)
    assert out["node_id"] == A and len(out["commands"]) == 2
    assert cli.main(["links", "plan", "--state-dir", str(tmp_path / "nobody")]) == 2
    assert "cannot read the ring" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# apply: confirmation, and the driver's allowlist


def test_apply_without_yes_refuses_when_stdin_is_not_a_tty(tmp_path: Path) -> None:
    # The interfaces do not exist: had anything run, it would have failed with exit 1.
    r = _p2pmesh("links", "apply", "--status-file", str(_write(tmp_path, _status(A, RING3))))
    assert r.returncode == 2
    assert "without confirmation" in r.stderr and "--yes" in r.stderr
    assert "p2pmnope2" in r.stdout  # the plan was shown before refusing


def test_apply_with_nothing_to_do_exits_0(tmp_path: Path) -> None:
    hops = [_hop(A, B, "en2", "en5", "10.9.0.1", "10.9.0.2"), _hop(B, A, "en5", "en2", "10.9.0.2", "10.9.0.1")]
    r = _p2pmesh("links", "apply", "--status-file", str(_write(tmp_path, _status(A, hops, [A, B]))))
    assert r.returncode == 0 and "nothing to do" in r.stdout


@pytest.mark.parametrize("argv", [
    ["ifconfig", "bridge0", "down"],
    ["ifconfig", "bridge0", "deletem", "en2"],
    ["ifconfig", "en2", "inet", "169.254.1.1/30"],  # no alias: would replace the primary address
    ["ip", "link", "set", "br0", "down"],
    ["ip", "addr", "flush", "dev", "eth0"],
    ["networksetup", "-setdhcp", "Thunderbolt Bridge"],
    ["sh", "-c", "ifconfig en2 inet 169.254.1.1/30 alias"],
    ["/sbin/ifconfig", "en2", "inet", "169.254.1.1/30", "alias"],
    ["ifconfig", "-a", "inet", "169.254.1.1/30", "alias"],
    [],
])
def test_netconfig_refuses_anything_but_adding_one_address(argv: list[str]) -> None:
    with pytest.raises(netconfig.CommandRefused):
        netconfig.check_argv(argv)


def test_netconfig_checks_every_command_before_running_any() -> None:
    good = ["ip", "addr", "add", "169.254.1.1/30", "dev", "p2pmnope9"]  # would fail if it ran
    with pytest.raises(netconfig.CommandRefused, match="only ever adds an address"):
        trio.run(netconfig.apply, [good, ["ip", "link", "set", "p2pmnope9", "down"]])


def test_netconfig_names_the_failed_command_and_its_stderr() -> None:
    if PLATFORM != "linux":
        pytest.skip("uses ip(8)")
    bad = ["ip", "addr", "add", "169.254.1.1/30", "dev", "p2pmnope9"]
    with pytest.raises(netconfig.CommandFailed) as info:
        trio.run(netconfig.apply, [bad])
    assert info.value.argv == bad and info.value.returncode not in (0, None)
    assert "p2pmnope9" in str(info.value) and info.value.stderr.strip() in str(info.value)
    assert info.value.done == []


# ---------------------------------------------------------------------------------------
# apply for real, inside a namespace (root only)


LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7790)); s.listen(1); s.settimeout(20)
print("ready", flush=True)
c, peer = s.accept(); c.sendall(b"ok"); c.close(); print(peer[0], flush=True)
"""
DIAL = "import socket, sys; print(socket.create_connection((sys.argv[1], 7790), timeout=10).recv(2).decode())"


def test_apply_in_a_namespace_adds_the_planned_slash30_and_nothing_else(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(2)
    try:
        cable = bench.plug(0, 1, ipv4=False)
        hops = [_hop(A, B, cable.dev_a, cable.dev_b), _hop(B, A, cable.dev_b, cable.dev_a)]
        view = ring_from_status(_status(A, hops, [A, B]))
        assert view is not None
        mine, theirs = (next(x for x in plan_addresses(view.hops) if x.node_id == n) for n in (A, B))
        outside_before = (ip("-4", "-o", "addr").stdout, ip("-4", "route").stdout)
        peer_before = ip("-n", bench.hosts[1], "-4", "-o", "addr").stdout

        status_a = _write(tmp_path, _status(A, hops, [A, B]), "a.json")
        r = _p2pmesh("links", "apply", "--yes", "--status-file", str(status_a), prefix=bench.exec_prefix(0))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"ip addr add {mine.address}/30 dev {cable.dev_a}" in r.stdout
        inet = [line.split()[3] for line in ip("-n", bench.hosts[0], "-4", "-o", "addr", "show", "dev", cable.dev_a).stdout.splitlines()]
        assert inet == [f"{mine.address}/30"]
        # Nothing outside that namespace changed: not the host, not the other end.
        assert (ip("-4", "-o", "addr").stdout, ip("-4", "route").stdout) == outside_before
        assert ip("-n", bench.hosts[1], "-4", "-o", "addr").stdout == peer_before

        # Running it again changes nothing (the address is already there).
        r = _p2pmesh("links", "apply", "--yes", "--status-file", str(status_a), prefix=bench.exec_prefix(0))
        assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr

        # The other end applies its half from its own view; then TCP crosses the cable.
        status_b = _write(tmp_path, _status(B, list(reversed(hops)), [A, B]), "b.json")
        r = _p2pmesh("links", "apply", "--yes", "--status-file", str(status_b), prefix=bench.exec_prefix(1))
        assert r.returncode == 0, r.stdout + r.stderr
        listener = subprocess.Popen([*bench.exec_prefix(1), sys.executable, "-c", LISTEN, theirs.address],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
            dial = subprocess.run([*bench.exec_prefix(0), sys.executable, "-c", DIAL, theirs.address],
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
            assert dial.stdout.strip() == "ok", dial.stderr
            assert listener.stdout.readline().strip() == mine.address
        finally:
            listener.kill()
            listener.wait(10)
    finally:
        bench.close()


def test_apply_failure_exits_1_and_names_the_command(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(1)
    try:
        hops = [_hop(A, B, "p2pmnope4", "en5"), _hop(B, A, "en5", "p2pmnope4")]
        path = _write(tmp_path, _status(A, hops, [A, B]))
        r = _p2pmesh("links", "apply", "--yes", "--status-file", str(path), prefix=bench.exec_prefix(0))
        assert r.returncode == 1
        assert "ip addr add" in r.stderr and "p2pmnope4" in r.stderr
        assert os.geteuid() == 0 and "needs root" not in r.stderr
    finally:
        bench.close()


def test_apply_refuses_a_plan_that_clashes_with_a_local_address(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(1)
    try:
        hops = [_hop(A, B, "p2pmnope5", "en5"), _hop(B, A, "en5", "p2pmnope5")]
        view = ring_from_status(_status(A, hops, [A, B]))
        assert view is not None
        peer = next(x for x in plan_addresses(view.hops) if x.node_id == B)
        ip("-n", bench.hosts[0], "addr", "add", f"{peer.address}/32", "dev", "lo")
        path = _write(tmp_path, _status(A, hops, [A, B]))
        r = _p2pmesh("links", "apply", "--yes", "--status-file", str(path), prefix=bench.exec_prefix(0))
        assert r.returncode == 2, r.stdout + r.stderr
        assert "never leave this Mac" in r.stdout and "clashes" in r.stderr
    finally:
        bench.close()


def test_bare_links_shows_the_live_ports_of_a_namespace_host() -> None:
    """`p2pmesh links` (no subcommand) runs the agent's link watcher: inside a bench host it
    finds the Thunderbolt-marked cable end with both domain UUIDs and its address, and the
    LAN port."""
    require_root()
    bench = Bench.create(2)
    try:
        bench.lan()
        cable = bench.plug(0, 1, thunderbolt=True, gbps=40.0)
        out = subprocess.run(
            [*bench.exec_prefix(0), sys.executable, "-m", "p2pmesh", "links", "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stderr
        ports = {p["interface"]: p for p in json.loads(out.stdout)}
        tb = ports[cable.dev_a]
        assert tb["kind"] == "thunderbolt" and tb["up"] and tb["gbps"] == 40.0
        assert tb["domain_uuid"] and tb["peer_domain_uuid"] and tb["domain_uuid"] != tb["peer_domain_uuid"]
        assert tb["ipv4"] == [f"{cable.addr_a}/30"]
        assert ports["lan0"]["kind"] == "ethernet" and ports["lan0"]["ipv4"] == ["10.99.0.1/24"]
        text = subprocess.run(
            [*bench.exec_prefix(0), sys.executable, "-m", "p2pmesh", "links"],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        )
        assert text.returncode == 0 and cable.dev_a in text.stdout and "thunderbolt" in text.stdout
    finally:
        bench.close()
