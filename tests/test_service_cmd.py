"""`p2pmesh service install|uninstall|status`, run for real with HOME and XDG_CONFIG_HOME in a
temporary directory (never the real user's), plus the launchd and systemd call sequences
against fake launchctl/systemctl programs on PATH.

Nothing here enables or starts a real service: with a reachable `systemctl --user`, the
tests that would start one are skipped and only --no-start runs.
"""
from __future__ import annotations

import argparse
import json
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.cli import service_cmd
from p2pmesh.cli.service_cmd import Host
from tests.platform.test_service_unit import LAUNCHCTL_RUNNING, SYSTEMCTL_NOT_FOUND, SYSTEMCTL_RUNNING

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------
# Real runs (this machine's systemctl, if any, with a temporary home)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SUDO_USER", None)
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_DATA_HOME=str(tmp_path / "data"))
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def _service(tmp_path: Path, *args: str, module: str = "p2pmesh.cli.service_cmd") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, "service", *args], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)


def _user_systemd_available(tmp_path: Path) -> bool:
    if shutil.which("systemctl") is None:
        return False
    done = subprocess.run(["systemctl", "--user", "show-environment"], env=_env(tmp_path), capture_output=True,
                          timeout=30, stdin=subprocess.DEVNULL, check=False)
    return done.returncode == 0


def _files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in tmp_path.rglob("*") if p.is_file())


def _unit(tmp_path: Path) -> Path:
    return tmp_path / "config" / "systemd" / "user" / "p2pmesh.service"


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the real runs use systemd --user")


@linux_only
def test_dry_run_prints_the_unit_and_writes_nothing(tmp_path: Path) -> None:
    r = _service(tmp_path, "install", "--dry-run", "--", "--memory-limit", "64000000000", "--peer", "10.0.0.2:7741")
    assert r.returncode == 0, r.stderr
    assert _files(tmp_path) == []
    assert f"would write {_unit(tmp_path)}:" in r.stdout
    assert (f"ExecStart={sys.executable} -m p2pmesh agent --state-dir {tmp_path}/data/p2pmesh "
            "--memory-limit 64000000000 --peer 10.0.0.2:7741") in r.stdout.splitlines()
    assert "  systemctl --user enable p2pmesh.service" in r.stdout.splitlines()
    assert "nothing was changed (--dry-run)" in r.stdout


@linux_only
def test_install_no_start_then_status_then_uninstall(tmp_path: Path) -> None:
    r = _service(tmp_path, "install", "--no-start", "--state-dir", str(tmp_path / "my state"), "--",
                 "--peer", "a host:1")
    assert r.returncode == 0, r.stderr
    unit = _unit(tmp_path)
    assert _files(tmp_path) == [unit]  # no temp file left behind
    assert stat.S_IMODE(unit.stat().st_mode) == 0o600
    lines = unit.read_text(encoding="utf-8").splitlines()
    assert (f'ExecStart={sys.executable} -m p2pmesh agent --state-dir "{tmp_path}/my state" --peer "a host:1"'
            in lines)
    assert {"Restart=on-failure", "WantedBy=default.target"} <= set(lines)
    assert "not started (--no-start)" in r.stdout

    r = _service(tmp_path, "status", "--json")
    status = json.loads(r.stdout)
    assert (status["manager"], status["name"], status["path"], status["installed"]) == (
        "systemd", "p2pmesh.service", str(unit), True)
    assert status["logs"] == "journalctl --user -u p2pmesh.service"
    if _user_systemd_available(tmp_path):
        assert r.returncode == 0, r.stderr
        assert status["error"] is None
    else:
        assert r.returncode == 1
        assert status["running"] is None and status["loaded"] is None
        assert "systemctl --user show p2pmesh.service" in status["error"]

    r = _service(tmp_path, "uninstall", "--no-start")
    assert r.returncode == 0, r.stderr
    assert _files(tmp_path) == []
    assert f"removed {unit}" in r.stdout
    r = _service(tmp_path, "uninstall", "--no-start")
    assert r.returncode == 0 and "nothing to remove" in r.stdout


@linux_only
def test_install_without_a_user_systemd_keeps_the_file_and_says_what_to_run(tmp_path: Path) -> None:
    if _user_systemd_available(tmp_path):
        pytest.skip("this machine has a user systemd; not enabling a real service from a test")
    r = _service(tmp_path, "install")
    assert r.returncode == 1
    assert _unit(tmp_path).is_file()
    assert f"wrote {_unit(tmp_path)}" in r.stdout
    if shutil.which("systemctl") is None:
        assert "systemctl is not installed" in r.stderr
    else:
        assert "p2pmesh: `systemctl --user daemon-reload` exited" in r.stderr
    assert f"{_unit(tmp_path)} is written; to finish, run:" in r.stderr
    for line in ("  systemctl --user daemon-reload", "  systemctl --user enable p2pmesh.service",
                 "  systemctl --user restart p2pmesh.service"):
        assert line in r.stderr.splitlines()

    # Uninstall cannot stop anything either: the file stays until --no-start says otherwise.
    r = _service(tmp_path, "uninstall")
    assert r.returncode == 1 and _unit(tmp_path).is_file()
    assert "  systemctl --user disable --now p2pmesh.service" in r.stderr.splitlines()
    assert "--no-start" in r.stderr


@linux_only
@pytest.mark.parametrize(("extra", "message"), [
    (["--bogus"], "not `p2pmesh agent` options: --bogus"),
    (["--memory-limit", "lots"], "invalid int value"),
    (["--state-dir", "/elsewhere"], "service install --state-dir DIR"),
    (["--cluster-key-file", "key.txt"], "must be an absolute path"),
    (["--http", "0.0.0.0:7780"], "--http-token after `--`"),
])
def test_bad_agent_arguments_install_nothing(tmp_path: Path, extra: list[str], message: str) -> None:
    r = _service(tmp_path, "install", "--no-start", "--", *extra)
    assert r.returncode == 2
    assert message in r.stderr
    assert _files(tmp_path) == []


def test_the_p2pmesh_command_has_it(tmp_path: Path) -> None:
    from p2pmesh.cli import app

    sub = next(a for a in app.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices["service"].get_default("run") is service_cmd.run
    r = _service(tmp_path, "install", "--dry-run", module="p2pmesh")
    assert r.returncode == 0, r.stderr
    assert _files(tmp_path) == []


# ---------------------------------------------------------------------------------------
# The call sequences, against fake launchctl / systemctl

FAKE = """\
#!{python}
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:]
with open(os.path.join(here, "calls.jsonl"), "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *args]) + "\\n")
key = next(a for a in args if not a.startswith("-"))
answers = json.load(open(os.path.join(here, "answers.json"))).get(key, [[0, "", ""]])
count_file = os.path.join(here, "count-" + key)
n = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(n + 1))
code, out, err = answers[min(n, len(answers) - 1)]
sys.stdout.write(out)
sys.stderr.write(err)
sys.exit(code)
"""


class Fake:
    """A fake launchctl and systemctl on PATH: canned answers per subcommand, calls logged."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name in ("launchctl", "systemctl"):
            tool = self.bin / name
            tool.write_text(FAKE.format(python=sys.executable), encoding="utf-8")
            tool.chmod(0o755)
        self.answer()
        monkeypatch.setenv("PATH", str(self.bin))
        monkeypatch.delenv("SUDO_USER", raising=False)
        monkeypatch.setattr(service_cmd, "BOOTSTRAP_RETRY_DELAY_S", 0.0)

    def answer(self, **answers: list[tuple[int, str, str]]) -> None:
        (self.bin / "answers.json").write_text(json.dumps(answers), encoding="utf-8")

    @property
    def calls(self) -> list[list[str]]:
        log = self.bin / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return Fake(tmp_path, monkeypatch)


def _mac(tmp_path: Path) -> Host:
    return Host("darwin", tmp_path / "home", 501, tmp_path / "home" / ".config", "/Users/alice/.venv/bin/python")


def _linux(tmp_path: Path) -> Host:
    return Host("linux", tmp_path / "home", 1000, tmp_path / "config", "/home/bob/.venv/bin/python")


def _run(host: Host, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="p2pmesh")
    service_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return service_cmd.run(parser.parse_args(["service", *argv]), host=host)


NOT_FOUND = (113, "", 'Could not find service "dev.p2pmesh.agent" in domain for user gui: 501\n')
PLIST = "home/Library/LaunchAgents/dev.p2pmesh.agent.plist"


def test_mac_install_bootstraps_the_written_plist(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.answer(print=[NOT_FOUND])
    assert _run(_mac(tmp_path), "install", "--state-dir", "/Users/alice/state", "--", "--no-mdns") == 0
    plist = tmp_path / PLIST
    job = plistlib.loads(plist.read_bytes())
    assert job["ProgramArguments"] == ["/Users/alice/.venv/bin/python", "-m", "p2pmesh", "agent",
                                       "--state-dir", "/Users/alice/state", "--no-mdns"]
    assert job["StandardOutPath"] == str(tmp_path / "home/Library/Logs/p2pmesh/agent.log")
    assert (tmp_path / "home/Library/Logs/p2pmesh").is_dir()  # launchd would not create it
    assert fake.calls == [
        ["launchctl", "print", "gui/501/dev.p2pmesh.agent"],
        ["launchctl", "enable", "gui/501/dev.p2pmesh.agent"],
        ["launchctl", "bootstrap", "gui/501", str(plist)],
    ]
    assert "started with launchd" in capsys.readouterr().out


def test_mac_reinstall_boots_out_the_loaded_job_first(tmp_path: Path, fake: Fake) -> None:
    fake.answer(print=[(0, LAUNCHCTL_RUNNING, "")])
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 0
    assert [c[1] for c in fake.calls] == ["print", "bootout", "enable", "bootstrap"]


def test_mac_bootstrap_retries_the_errno_5_race(tmp_path: Path, fake: Fake) -> None:
    eio = (5, "", "Bootstrap failed: 5: Input/output error\n")
    fake.answer(print=[(0, LAUNCHCTL_RUNNING, "")], bootstrap=[eio, eio, (0, "", "")])
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 0
    assert [c[1] for c in fake.calls].count("bootstrap") == 3


def test_mac_bootstrap_refused_keeps_the_file_and_names_the_command(
        tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.answer(print=[NOT_FOUND], bootstrap=[(5, "", "Bootstrap failed: 5: Input/output error\n")])
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 1
    assert [c[1] for c in fake.calls].count("bootstrap") == service_cmd.BOOTSTRAP_ATTEMPTS_MAX
    assert (tmp_path / PLIST).is_file()
    err = capsys.readouterr().err
    assert f"`launchctl bootstrap gui/501 {tmp_path / PLIST}` exited 5: Bootstrap failed: 5" in err
    assert f"  launchctl bootstrap gui/501 {tmp_path / PLIST}" in err.splitlines()


def test_mac_without_a_gui_session_says_so(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.answer(print=[(125, "", "Could not find domain for user gui: 501\n")])
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 1
    assert "no GUI login session" in capsys.readouterr().err
    assert (tmp_path / PLIST).is_file()


def test_mac_without_launchctl(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    (fake.bin / "launchctl").unlink()
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 1
    err = capsys.readouterr().err
    assert "launchctl is not installed" in err
    assert "  launchctl enable gui/501/dev.p2pmesh.agent" in err.splitlines()


def test_mac_status_json(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.answer(print=[(0, LAUNCHCTL_RUNNING, ""), NOT_FOUND])
    assert _run(_mac(tmp_path), "status", "--json") == 0
    status: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert status == {
        "manager": "launchd", "name": "dev.p2pmesh.agent", "path": str(tmp_path / PLIST), "installed": False,
        "loaded": True, "running": True, "pid": 4242, "state": "running", "last_exit_code": None,
        "last_signal": None, "enabled": None, "logs": str(tmp_path / "home/Library/Logs/p2pmesh/agent.log"),
        "error": None,
    }
    assert _run(_mac(tmp_path), "status") == 0
    assert capsys.readouterr().out.startswith("launchd dev.p2pmesh.agent: not installed\n")


def test_mac_uninstall_boots_out_and_removes(tmp_path: Path, fake: Fake) -> None:
    fake.answer(print=[NOT_FOUND])
    host = _mac(tmp_path)
    assert _run(host, "install", "--no-start", "--state-dir", "/s") == 0
    assert fake.calls == []  # --no-start asks launchd nothing
    fake.answer(print=[(0, LAUNCHCTL_RUNNING, "")])
    assert _run(host, "uninstall") == 0
    assert not (tmp_path / PLIST).exists()
    assert [c[1:] for c in fake.calls] == [["print", "gui/501/dev.p2pmesh.agent"],
                                           ["bootout", "gui/501/dev.p2pmesh.agent"]]


def test_linux_install_enables_and_restarts(tmp_path: Path, fake: Fake) -> None:
    assert _run(_linux(tmp_path), "install", "--state-dir", "/home/bob/state") == 0
    assert (tmp_path / "config/systemd/user/p2pmesh.service").is_file()
    assert fake.calls == [["systemctl", "--user", "daemon-reload"],
                          ["systemctl", "--user", "enable", "p2pmesh.service"],
                          ["systemctl", "--user", "restart", "p2pmesh.service"]]


def test_linux_enable_refused_lists_what_is_left(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.answer(enable=[(1, "", "Failed to enable unit: Access denied\n")])
    assert _run(_linux(tmp_path), "install", "--state-dir", "/s") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "p2pmesh: `systemctl --user enable p2pmesh.service` exited 1: Failed to enable unit: Access denied"
    assert err[2:] == ["  systemctl --user enable p2pmesh.service", "  systemctl --user restart p2pmesh.service"]


def test_linux_status_and_uninstall(tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    host = _linux(tmp_path)
    assert _run(host, "install", "--no-start", "--state-dir", "/s") == 0
    fake.answer(show=[(0, SYSTEMCTL_RUNNING, "")])
    capsys.readouterr()
    assert _run(host, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["installed"], status["running"], status["pid"], status["enabled"]) == (True, True, 31337, True)
    assert fake.calls[-1] == ["systemctl", "--user", "show", "p2pmesh.service",
                              "--property=LoadState,ActiveState,SubState,MainPID,ExecMainCode,ExecMainStatus,UnitFileState"]
    assert _run(host, "uninstall") == 0
    assert [c[1:] for c in fake.calls[-3:]] == [["--user", "show", "p2pmesh.service", fake.calls[-3][-1]],
                                                ["--user", "disable", "--now", "p2pmesh.service"],
                                                ["--user", "daemon-reload"]]
    assert not (tmp_path / "config/systemd/user/p2pmesh.service").exists()


def test_linux_uninstall_of_an_unknown_unit_only_removes_the_file(tmp_path: Path, fake: Fake) -> None:
    host = _linux(tmp_path)
    assert _run(host, "install", "--no-start", "--state-dir", "/s") == 0
    fake.answer(show=[(0, SYSTEMCTL_NOT_FOUND, "")])
    assert _run(host, "uninstall") == 0
    assert [c[2] for c in fake.calls] == ["show", "daemon-reload"]


def test_uninstall_when_nothing_is_installed_changes_nothing(tmp_path: Path, fake: Fake) -> None:
    fake.answer(show=[(1, "", "Failed to connect to bus: No medium found\n")])
    assert _run(_linux(tmp_path), "uninstall") == 0
    assert [c[2] for c in fake.calls] == ["show"]  # no daemon-reload for a file that was never there


def test_sudo_is_refused(tmp_path: Path, fake: Fake, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SUDO_USER", "alice")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert _run(_mac(tmp_path), "install", "--state-dir", "/s") == 2
    assert "without sudo" in capsys.readouterr().err
    assert fake.calls == [] and not (tmp_path / PLIST).exists()
