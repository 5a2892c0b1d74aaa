"""`p2pmesh doctor` as a real process on this Linux machine: the JSON shape, exit codes, the
mDNS probe and the agent check against a real agent.

Network safety: every mDNS probe here is restricted with `--interface lo`, and the one agent
that advertises binds zeroconf to lo only (`--interface lo`) and listens on 127.0.0.x. Nothing
is sent to a real interface. Each run gets its own empty state directory, so no agent of the
developer's is asked.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.cli import doctor_cmd
from p2pmesh.drivers.keys import write_key
from p2pmesh.platform.doctor import CHECK_NAMES
from tests.agent.harness import AgentProc, control_status, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 90
AGENT_START_S = 30
STATUSES = {"ok", "warn", "fail", "skip"}


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pmesh.cli.doctor_cmd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)


def _json_run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int]:
    r = _doctor("--json", "--interface", "lo", "--state-dir", str(tmp_path / "state"), *args)
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    return doc, {c["name"]: c for c in doc["checks"]}, r.returncode


def test_json_report_shape_and_exit_code(tmp_path: Path) -> None:
    doc, checks, code = _json_run(tmp_path)
    assert set(doc) == {"ok", "checks"}
    assert [c["name"] for c in doc["checks"]] == list(CHECK_NAMES)
    for c in doc["checks"]:
        assert set(c) <= {"name", "status", "summary", "fix", "details"}, c
        assert c["status"] in STATUSES and isinstance(c["summary"], str) and c["summary"]
        assert isinstance(c.get("fix", ""), str) and isinstance(c.get("details", []), list)
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert doc["ok"] is (not failed)
    assert code == (1 if failed else 0), failed
    # This machine: mDNS works on loopback, MLX[cpu] is installed, no agent runs in a fresh
    # state directory, and there is no Thunderbolt hardware.
    assert checks["mdns"]["status"] == "ok", checks["mdns"]
    assert any(d.startswith("lo (127.0.0.1") for d in checks["mdns"]["details"])
    assert checks["mlx"]["status"] == "ok", checks["mlx"]
    assert checks["agent"]["status"] == "skip" and "p2pmesh agent" in checks["agent"]["fix"]
    assert checks["memory"]["status"] in ("ok", "warn")
    assert checks["rdma"]["status"] == "skip"


def test_human_report_and_skips(tmp_path: Path) -> None:
    r = _doctor("--interface", "lo", "--state-dir", str(tmp_path), "--skip", "mlx", "--skip", "mdns")
    assert r.returncode in (0, 1), r.stderr
    lines = r.stdout.splitlines()
    heads = [line for line in lines if line.startswith("[")]
    assert [h[7:].split()[0] for h in heads] == list(CHECK_NAMES)
    assert "[skip] mlx          skipped (--skip mlx)" in lines
    assert "[skip] mdns         skipped (--skip mdns)" in lines
    assert lines[-1].endswith("skipped")


def test_an_interface_that_does_not_exist_fails_the_mdns_check(tmp_path: Path) -> None:
    r = _doctor("--json", "--interface", "p2pmnope0", "--state-dir", str(tmp_path),
                *(arg for name in CHECK_NAMES if name != "mdns" for arg in ("--skip", name)))
    assert r.returncode == 1, r.stderr
    (mdns,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "mdns"]
    assert mdns["status"] == "fail" and "p2pmnope0: no such interface" in mdns["summary"]
    assert "--peer HOST:7741" in mdns["fix"]


@pytest.mark.parametrize("args", [["--timeout-s", "0"], ["--timeout-s", "nan"], ["--skip", "everything"],
                                  ["--interface", "not an interface"], ["--no-such-option"]])
def test_bad_usage_exits_2(args: list[str], tmp_path: Path) -> None:
    r = _doctor("--state-dir", str(tmp_path), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""


def test_add_parser_and_run_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The two functions cli/app.py wires in."""
    parser = argparse.ArgumentParser(prog="p2pmesh")
    doctor_cmd.add_parser(parser.add_subparsers(dest="command"))
    skips = [arg for name in CHECK_NAMES if name not in ("memory", "agent") for arg in ("--skip", name)]
    args = parser.parse_args(["doctor", "--json", "--state-dir", str(tmp_path), *skips])
    assert doctor_cmd.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["status"] for c in doc["checks"] if c["name"] == "agent"] == ["skip"]


def test_agent_check_and_mdns_against_a_real_agent_on_loopback(tmp_path: Path) -> None:
    """One agent advertising on lo only. Asked through its own state directory, the doctor
    reports its cluster; asked from a directory holding another cluster key, the mDNS check
    flags the agent as belonging to another cluster."""
    host = "127.0.0.61"
    agent = AgentProc(tmp_path / "a", f"{host}:{free_port(host)}",
                      extra=["--interface", "lo", "--data-port", str(free_port())])
    agent.state_dir.mkdir()
    agent.start()
    try:
        wait_for(lambda: (control_status(agent) or {}).get("healthy"), AGENT_START_S, "the agent to form its cluster")
        doc, checks, _ = _json_run(tmp_path, "--state-dir", str(agent.state_dir), "--skip", "mlx")
        assert checks["agent"]["status"] == "ok", checks["agent"]
        assert "1 of 1 member(s) up" in checks["agent"]["summary"]
        assert checks["mdns"]["status"] == "ok", checks["mdns"]  # its own advert is not a peer

        other = tmp_path / "other"
        other.mkdir()
        write_key(other / "cluster.key", bytes(range(32)))
        node = control_status(agent)["node_id"]  # type: ignore[index]
        doc, checks, _ = _json_run(tmp_path, "--state-dir", str(other), "--skip", "mlx")
        assert checks["agent"]["status"] == "skip"
        mdns = checks["mdns"]
        assert mdns["status"] == "warn", mdns
        assert f"agent {node[:8]} on lo holds a different cluster key" in mdns["summary"]
        assert "p2pmesh key set KEY" in mdns["fix"]
    finally:
        agent.stop()
