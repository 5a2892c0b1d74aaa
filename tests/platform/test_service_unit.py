"""The login service as data: the launchd plist, the systemd unit, the status parsers, and
the validation that keeps a bad argument out of both files."""
from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from p2pmesh.core.errors import LocalProtocolError
from p2pmesh.platform.service_unit import (
    DEFAULT_LABEL,
    ServiceOutputError,
    ServiceSpec,
    ServiceSpecError,
    ServiceState,
    default_environment,
    launchd_plist,
    parse_launchctl_print,
    parse_systemctl_show,
    systemd_quote,
    systemd_unit,
)

PY = "/Users/alice/p2pmesh/.venv/bin/python"
STATE = "/Users/alice/Library/Application Support/p2pmesh"
LOG = "/Users/alice/Library/Logs/p2pmesh/agent.log"
SPEC = ServiceSpec(python=PY, state_dir=STATE, agent_args=("--memory-limit", "64000000000"), log_path=LOG,
                   environment=default_environment(PY))


# ---------------------------------------------------------------------------------------
# launchd


def test_plist_round_trips_with_the_keys_launchd_needs() -> None:
    job = plistlib.loads(launchd_plist(SPEC))
    assert job == {
        "Label": DEFAULT_LABEL,
        "ProgramArguments": [PY, "-m", "p2pmesh", "agent", "--state-dir", STATE, "--memory-limit", "64000000000"],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        "ExitTimeOut": 90,
        "ProcessType": "Interactive",
        "StandardOutPath": LOG,
        "StandardErrorPath": LOG,
        "EnvironmentVariables": {
            "PATH": "/Users/alice/p2pmesh/.venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONUNBUFFERED": "1",
        },
    }


def test_plist_is_xml_and_keeps_awkward_arguments_intact() -> None:
    args = ("--peer", "host with space:7741", "--http-token", "a<b>&\"c'$%\\")
    data = launchd_plist(replace(SPEC, agent_args=args))
    assert data.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist')
    assert plistlib.loads(data)["ProgramArguments"][-4:] == list(args)


def test_plist_is_deterministic() -> None:
    assert launchd_plist(SPEC) == launchd_plist(replace(SPEC))


def test_plist_needs_a_log_file() -> None:
    with pytest.raises(ServiceSpecError, match="log file"):
        launchd_plist(replace(SPEC, log_path=None))


# ---------------------------------------------------------------------------------------
# systemd


def test_systemd_unit_exact_text() -> None:
    spec = ServiceSpec(python="/home/bob/.venv/bin/python", state_dir="/home/bob/.local/share/p2pmesh",
                       environment=default_environment("/home/bob/.venv/bin/python"))
    assert systemd_unit(spec).splitlines() == [
        "# Written by `p2pmesh service install`; remove it with `p2pmesh service uninstall`.",
        "[Unit]",
        "Description=p2pmesh agent",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=/home/bob/.venv/bin/python -m p2pmesh agent --state-dir /home/bob/.local/share/p2pmesh",
        'Environment="PATH=/home/bob/.venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" "PYTHONUNBUFFERED=1"',
        "Restart=on-failure",
        "RestartSec=10",
        "TimeoutStopSec=90",
        "KillMode=mixed",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    assert systemd_unit(spec).endswith("\n")


@pytest.mark.parametrize(("word", "quoted"), [
    ("--memory-limit", "--memory-limit"),
    ("10.0.0.2:7741", "10.0.0.2:7741"),
    ("/home/bob/My Models/p2pmesh", '"/home/bob/My Models/p2pmesh"'),
    ("", '""'),
    ("50%", '"50%%"'),  # specifiers
    ("$HOME", '"$$HOME"'),  # variable expansion
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    (";", '";"'),  # a bare `;` would separate commands
    ("it's", '"it\'s"'),
])
def test_systemd_quoting(word: str, quoted: str) -> None:
    assert systemd_quote(word) == quoted


def test_systemd_exec_start_quotes_paths_and_args_with_spaces() -> None:
    spec = ServiceSpec(python="/opt/my tools/bin/python", state_dir="/home/bob/state dir",
                       agent_args=("--peer", "a b", "--http-token", "100%$"))
    line = next(ln for ln in systemd_unit(spec).splitlines() if ln.startswith("ExecStart="))
    assert line == ('ExecStart="/opt/my tools/bin/python" -m p2pmesh agent --state-dir "/home/bob/state dir" '
                    '--peer "a b" --http-token "100%%$$"')


def test_systemd_environment_escapes_specifiers_but_not_dollars() -> None:
    spec = replace(SPEC, log_path=None, environment=(("GREETING", 'say "50%" for $5'),))
    assert 'Environment="GREETING=say \\"50%%\\" for $5"' in systemd_unit(spec).splitlines()


def test_systemd_log_file_when_given() -> None:
    lines = systemd_unit(replace(SPEC, log_path="/var/tmp/p2pmesh-100%.log")).splitlines()
    assert "StandardOutput=append:/var/tmp/p2pmesh-100%%.log" in lines
    assert "StandardError=append:/var/tmp/p2pmesh-100%%.log" in lines
    with pytest.raises(ServiceSpecError, match="whitespace"):
        systemd_unit(replace(SPEC, log_path="/home/bob/My Logs/agent.log"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    # The real parser: unbalanced quotes, bad specifiers and a missing executable all fail it.
    spec = ServiceSpec(python=sys.executable, state_dir=str(tmp_path / "state dir"),
                       agent_args=("--peer", 'we"ird $x 100%', "--http-token", "a\\b;", ";"),
                       environment=(*default_environment(sys.executable), ("X", 'a "b" 5%')))
    unit = tmp_path / "p2pmesh.service"
    unit.write_text(systemd_unit(spec), encoding="utf-8")
    done = subprocess.run(["systemd-analyze", "verify", "--user", str(unit)], capture_output=True, text=True,
                          timeout=60, env={"XDG_RUNTIME_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(("change", "message"), [
    ({"label": "dev/p2pmesh"}, "label"),
    ({"label": ""}, "label"),
    ({"label": ".hidden"}, "label"),
    ({"python": "python3"}, "not an absolute path"),
    ({"state_dir": "~/state"}, "not an absolute path"),
    ({"log_path": "agent.log"}, "not an absolute path"),
    ({"agent_args": ("--peer", "a\nExecStartPre=/bin/evil")}, "control character"),
    ({"agent_args": ("--peer", "a\x00b")}, "control character"),
    ({"agent_args": ("--peer", "\udcff")}, "UTF-8"),
    ({"agent_args": ["--peer", "x"]}, "tuple"),
    ({"state_dir": "/tmp/a\rb"}, "control character"),
    ({"environment": (("BAD NAME", "x"),)}, "environment name"),
    ({"environment": (("A", "1"), ("A", "2"))}, "repeat"),
    ({"environment": (("A", "line\nbreak"),)}, "control character"),
    ({"restart_delay_s": 0}, "restart delay"),
    ({"stop_timeout_s": True}, "stop timeout"),
])
def test_bad_specs_are_the_callers_fault(change: dict[str, object], message: str) -> None:
    with pytest.raises(ServiceSpecError, match=message) as info:
        replace(SPEC, **change)
    assert isinstance(info.value, LocalProtocolError)


def test_default_environment_puts_the_interpreters_directory_first_once() -> None:
    assert default_environment("/usr/bin/python3") == (
        ("PATH", "/usr/bin:/usr/local/bin:/bin:/usr/sbin:/sbin"), ("PYTHONUNBUFFERED", "1"))


# ---------------------------------------------------------------------------------------
# launchctl print

LAUNCHCTL_RUNNING = """\
gui/501/dev.p2pmesh.agent = {
\tactive count = 1
\tpath = /Users/alice/Library/LaunchAgents/dev.p2pmesh.agent.plist
\ttype = LaunchAgent
\tstate = running

\tprogram = /Users/alice/p2pmesh/.venv/bin/python
\targuments = {
\t\t/Users/alice/p2pmesh/.venv/bin/python
\t\t-m
\t\tp2pmesh
\t\tagent
\t\t--state-dir
\t\t/Users/alice/Library/Application Support/p2pmesh
\t}

\tstdout path = /Users/alice/Library/Logs/p2pmesh/agent.log
\tstderr path = /Users/alice/Library/Logs/p2pmesh/agent.log
\tinherited environment = {
\t\tSSH_AUTH_SOCK => /private/tmp/com.apple.launchd.kX3b1Wq2Zs/Listeners
\t}

\tdefault environment = {
\t\tPATH => /usr/bin:/bin:/usr/sbin:/sbin
\t}

\tenvironment = {
\t\tPATH => /Users/alice/p2pmesh/.venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
\t\tPYTHONUNBUFFERED => 1
\t\tXPC_SERVICE_NAME => dev.p2pmesh.agent
\t}

\tdomain = gui/501 [100004]
\tasid = 100004
\tminimum runtime = 10
\texit timeout = 90
\truns = 1
\tpid = 4242
\timmediate reason = speculative
\tforks = 3
\texecs = 1
\tinitialized = 1
\ttrampolined = 1
\tstarted suspended = 0
\tproxy started suspended = 0
\tlast exit code = (never exited)

\tresource coalition = {
\t\tID = 1187
\t\tstate = active
\t}

\tjetsam coalition = {
\t\tID = 1188
\t}

\tspawn type = interactive (4)
\tjetsam priority = 40
\tjetsam memory limit (active) = (unlimited)
\tjetsam memory limit (inactive) = (unlimited)
\tjetsamproperties category = daemon
\tsubmitted job. ignore execute allowed
\tjetsam thread limit = 32
\tcpumon = default
\tjob state = running

\tproperties = keepalive | runatload | inferred program
}
"""

LAUNCHCTL_CRASHED = """\
gui/501/dev.p2pmesh.agent = {
\tactive count = 0
\tpath = /Users/alice/Library/LaunchAgents/dev.p2pmesh.agent.plist
\ttype = LaunchAgent
\tstate = spawn scheduled

\tprogram = /Users/alice/p2pmesh/.venv/bin/python
\targuments = {
\t\t/Users/alice/p2pmesh/.venv/bin/python
\t\t-m
\t\tp2pmesh
\t\tagent
\t}

\tdomain = gui/501 [100004]
\tasid = 100004
\tminimum runtime = 10
\texit timeout = 90
\truns = 3
\tlast exit code = 2

\tspawn type = interactive (4)
\tproperties = keepalive | runatload | inferred program
}
"""


def test_launchctl_print_running() -> None:
    assert parse_launchctl_print(LAUNCHCTL_RUNNING) == ServiceState(
        loaded=True, running=True, pid=4242, state="running", last_exit_code=None)


def test_launchctl_print_between_crash_restarts() -> None:
    state = parse_launchctl_print(LAUNCHCTL_CRASHED)
    assert (state.loaded, state.running, state.pid, state.state, state.last_exit_code) == (
        True, False, None, "spawn scheduled", 2)


def test_launchctl_print_exit_code_with_a_name_and_a_signal() -> None:
    text = LAUNCHCTL_CRASHED.replace("last exit code = 2", "last exit code = 78: EX_CONFIG\n"
                                     "\tlast terminating signal = Segmentation fault: 11")
    state = parse_launchctl_print(text.replace("spawn scheduled", "not running"))
    assert (state.state, state.last_exit_code, state.last_signal) == ("not running", 78, "Segmentation fault: 11")
    assert state.to_json()["last_signal"] == "Segmentation fault: 11"


def test_launchctl_print_nested_state_lines_do_not_count() -> None:
    # `state = active` inside `resource coalition = {` must not override the job's state.
    text = LAUNCHCTL_RUNNING.replace("\tstate = running\n", "")
    with pytest.raises(ServiceOutputError, match="state"):
        parse_launchctl_print(text)


@pytest.mark.parametrize("text", ["", "Could not find service \"x\" in domain for user gui: 501\n",
                                  "gui/501/x = {\n\tpid = 12\n}\n"])
def test_launchctl_print_without_a_state_is_the_managers_fault(text: str) -> None:
    with pytest.raises(ServiceOutputError):
        parse_launchctl_print(text)


def test_launchctl_print_bad_pid() -> None:
    with pytest.raises(ServiceOutputError, match="pid"):
        parse_launchctl_print(LAUNCHCTL_RUNNING.replace("pid = 4242", "pid = lots"))


# ---------------------------------------------------------------------------------------
# systemctl show (the order is systemd's, not the --property order)

SYSTEMCTL_RUNNING = """\
MainPID=31337
ExecMainCode=0
ExecMainStatus=0
LoadState=loaded
ActiveState=active
SubState=running
UnitFileState=enabled
"""

SYSTEMCTL_FAILED = """\
MainPID=0
ExecMainCode=1
ExecMainStatus=2
LoadState=loaded
ActiveState=activating
SubState=auto-restart
UnitFileState=enabled
"""

SYSTEMCTL_KILLED = """\
MainPID=0
ExecMainCode=2
ExecMainStatus=9
LoadState=loaded
ActiveState=failed
SubState=failed
UnitFileState=disabled
"""

SYSTEMCTL_NOT_FOUND = """\
MainPID=0
ExecMainCode=0
ExecMainStatus=0
LoadState=not-found
ActiveState=inactive
SubState=dead
UnitFileState=
"""


def test_systemctl_show_running() -> None:
    assert parse_systemctl_show(SYSTEMCTL_RUNNING) == ServiceState(
        loaded=True, running=True, pid=31337, state="active (running)", last_exit_code=None, enabled=True)


def test_systemctl_show_restarting_after_a_failure() -> None:
    state = parse_systemctl_show(SYSTEMCTL_FAILED)
    assert (state.running, state.pid, state.state, state.last_exit_code, state.last_signal) == (
        False, None, "activating (auto-restart)", 2, None)


def test_systemctl_show_killed_by_a_signal() -> None:
    state = parse_systemctl_show(SYSTEMCTL_KILLED)
    assert (state.state, state.last_exit_code, state.last_signal, state.enabled) == (
        "failed (failed)", None, "signal 9", False)


def test_systemctl_show_unit_not_found() -> None:
    state = parse_systemctl_show(SYSTEMCTL_NOT_FOUND)
    assert (state.loaded, state.running, state.pid, state.enabled) == (False, False, None, None)
    assert state.to_json() == {"loaded": False, "running": False, "pid": None, "state": "inactive (dead)",
                               "last_exit_code": None, "last_signal": None, "enabled": None}


@pytest.mark.parametrize(("text", "message"), [
    ("Failed to connect to bus: No medium found\n", "not Key=value"),
    ("MainPID=0\n", "ActiveState"),
    ("ActiveState=active\nMainPID=many\n", "MainPID"),
    ("", "ActiveState"),
])
def test_systemctl_show_garbage_is_the_managers_fault(text: str, message: str) -> None:
    with pytest.raises(ServiceOutputError, match=message):
        parse_systemctl_show(text)
