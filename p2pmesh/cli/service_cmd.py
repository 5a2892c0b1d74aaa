"""`p2pmesh service`: run the agent as a login service, so plug-and-play needs no terminal.

  p2pmesh service install   [--state-dir DIR] [--dry-run] [--no-start] [-- AGENT_ARGS...]
  p2pmesh service uninstall [--dry-run] [--no-start]
  p2pmesh service status    [--json]

macOS: a LaunchAgent, ``~/Library/LaunchAgents/dev.p2pmesh.agent.plist``, loaded with
``launchctl bootstrap gui/<uid>``; output goes to ``~/Library/Logs/p2pmesh/agent.log``.
Linux: a ``systemd --user`` unit, ``$XDG_CONFIG_HOME/systemd/user/p2pmesh.service``, enabled
and (re)started with ``systemctl --user``; output goes to the journal.

The file contents come from p2pmesh.platform.service_unit; this module finds the paths, writes
the file atomically and runs launchctl or systemctl, each call bounded by a timeout. When
the service manager is missing or refuses, the written file stays, and the message says what
failed and which commands to run by hand. See docs/service.md. cli/app.py calls add_parser/run;
``python -m p2pmesh.cli.service_cmd service ...`` runs the same code on its own.

Exit codes: 0 done (or nothing to do); 1 the service manager is unavailable or refused, or the
file could not be written; 2 bad usage (bad agent arguments, run under sudo).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from p2pmesh.cli import agent_cmd
from p2pmesh.cli.common import Refused, failed
from p2pmesh.platform.service_unit import (
    DEFAULT_LABEL,
    STOP_TIMEOUT_S,
    SYSTEMD_PROPERTIES,
    SYSTEMD_UNIT,
    ServiceOutputError,
    ServiceSpec,
    ServiceSpecError,
    ServiceState,
    default_environment,
    launchd_plist,
    not_loaded,
    parse_launchctl_print,
    parse_systemctl_show,
    systemd_unit,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
COMMAND_TIMEOUT_S = 30.0
# Stopping may wait out the agent's own stop timeout (a leave hands layers off first).
STOP_COMMAND_TIMEOUT_S = STOP_TIMEOUT_S + 30.0
# `launchctl bootstrap` right after a bootout often fails with errno 5 while launchd is
# still tearing the old job down; a retry a moment later succeeds.
BOOTSTRAP_ATTEMPTS_MAX = 4
BOOTSTRAP_RETRY_DELAY_S = 1.0
_LAUNCHD_NOT_FOUND = 113  # `launchctl print`: "Could not find service ... in domain for ..."
_STATE_DIR_PROBE = "/p2pmesh-service-state-dir-probe"


@dataclass(frozen=True)
class Host:
    """The facts about this computer the service depends on (tests build their own)."""

    platform: Literal["darwin", "linux"]
    home: Path
    uid: int
    config_home: Path  # $XDG_CONFIG_HOME, else ~/.config (Linux only)
    python: str  # the interpreter the service runs: this one, so the same venv

    @classmethod
    def current(cls) -> Host:
        if sys.platform == "darwin":
            platform: Literal["darwin", "linux"] = "darwin"
        elif sys.platform.startswith("linux"):
            platform = "linux"
        else:
            raise Refused(f"a login service is supported on macOS (launchd) and Linux (systemd), not {sys.platform}")
        home = Path.home()
        xdg = os.environ.get("XDG_CONFIG_HOME", "")
        # The XDG spec says a relative value is invalid and must be ignored; systemd agrees.
        config_home = Path(xdg) if xdg.startswith("/") else home / ".config"
        if not sys.executable:
            raise Refused("cannot tell which Python runs p2pmesh (sys.executable is empty)")
        return cls(platform, home, os.getuid(), config_home, os.path.abspath(sys.executable))

    @property
    def manager(self) -> str:
        return "launchd" if self.platform == "darwin" else "systemd"

    @property
    def unit_path(self) -> Path:
        if self.platform == "darwin":
            return self.home / "Library" / "LaunchAgents" / f"{DEFAULT_LABEL}.plist"
        return self.config_home / "systemd" / "user" / SYSTEMD_UNIT

    @property
    def log_path(self) -> Path | None:
        return self.home / "Library" / "Logs" / "p2pmesh" / "agent.log" if self.platform == "darwin" else None

    @property
    def logs(self) -> str:
        return str(self.log_path) if self.log_path is not None else f"journalctl --user -u {SYSTEMD_UNIT}"

    @property
    def launchd_target(self) -> str:
        return f"gui/{self.uid}/{DEFAULT_LABEL}"


def add_parser(subparsers: Any) -> None:
    """Add `service install|uninstall|status` to an argparse subparsers object."""
    service = subparsers.add_parser(
        "service", help="start the agent at login (a launchd agent on macOS, a systemd user unit on Linux)")
    service.set_defaults(run=run)
    sub = service.add_subparsers(dest="service_command", required=True, metavar="{install,uninstall,status}")
    install = sub.add_parser(
        "install", help="write the service file and start the agent now and at every login",
        description="Write the service file and start the agent now and at every login. Options for the "
                    "agent go after `--`, e.g. `p2pmesh service install -- --memory-limit 64000000000`.")
    install.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                         help="the agent's state directory (default: the agent's default)")
    install.add_argument("agent_args", nargs="*", metavar="AGENT_ARGS",
                         help="`p2pmesh agent` options, after `--`")
    uninstall = sub.add_parser("uninstall", help="stop the agent and remove the service file")
    for sp in (install, uninstall):
        sp.add_argument("--dry-run", action="store_true", help="print what would be written and run; change nothing")
        sp.add_argument("--no-start", action="store_true",
                        help="only write (or remove) the file; do not ask launchd/systemd to start or stop anything")
    status = sub.add_parser("status", help="is the service installed and running")
    status.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, host: Host | None = None) -> int:
    """Execute a `service` subcommand; prints to stdout, errors to stderr as `p2pmesh: ...`."""
    try:
        host = host or Host.current()
        if args.service_command == "status":
            return _status(args, host)
        if os.environ.get("SUDO_USER") and os.geteuid() == 0 and not args.dry_run:
            raise Refused("the agent runs as a login service of your own user: run this without sudo", EXIT_USAGE)
        if args.service_command == "install":
            return _install(args, host)
        return _uninstall(args, host)
    except Refused as exc:
        return failed(exc, exc.code)


# ---------------------------------------------------------------------------------------
# Running launchctl / systemctl


@dataclass(frozen=True)
class _Ran:
    argv: tuple[str, ...]
    code: int | None  # None: it could not be run, or timed out
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        said = (self.err.strip() or self.out.strip()).replace("\n", " ")
        what = f"exited {self.code}" if self.code is not None else "did not run"
        return f"`{shlex.join(self.argv)}` {what}" + (f": {said}" if said else "")


def _run(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> _Ran:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                              check=False)
    except FileNotFoundError:
        return _Ran(tuple(argv), None, "", f"{argv[0]} is not installed (not found on PATH)")
    except subprocess.TimeoutExpired:
        return _Ran(tuple(argv), None, "", f"no answer after {timeout_s:g} s")
    except OSError as exc:
        return _Ran(tuple(argv), None, "", str(exc))
    return _Ran(tuple(argv), done.returncode, done.stdout, done.stderr)


def _hint(host: Host, ran: _Ran) -> str:
    said = ran.err + ran.out
    if "Failed to connect to bus" in said or "DBUS_SESSION_BUS_ADDRESS" in said:
        return ("no systemd user instance is reachable from this session, as is usual in containers, under `su` "
                "and over ssh without lingering: log in as this user, or run `loginctl enable-linger` once")
    if "Could not find domain" in said:
        return (f"uid {host.uid} has no GUI login session (launchd agents need one): log in at the Mac's screen, "
                "or turn on automatic login")
    return ""


def _fail(host: Host, ran: _Ran, steps: list[list[str]], *, wrote: Path | None, note: str = "") -> Refused:
    """The error for a failed manager call: what ran, what it said, and what to run by hand."""
    hint = _hint(host, ran)
    lines = [ran.describe(), *([hint] if hint else []),
             f"{wrote} is written; to finish, run:" if wrote else "to finish, run:",
             *(f"  {shlex.join(step)}" for step in steps), *([note] if note else [])]
    return Refused("\n".join(lines))


def _launchd_loaded(host: Host, steps_by_hand: list[list[str]], *, wrote: Path | None) -> bool:
    """Whether launchd knows the job; a launchctl that cannot answer raises Refused."""
    ran = _run(["launchctl", "print", host.launchd_target])
    if ran.ok:
        return True
    if ran.code == _LAUNCHD_NOT_FOUND or "Could not find service" in ran.err:
        return False
    raise _fail(host, ran, steps_by_hand, wrote=wrote)


def _start_steps(host: Host) -> list[list[str]]:
    """What starting the service takes, for the dry run and for messages."""
    if host.platform == "darwin":
        return [["launchctl", "bootout", host.launchd_target],
                ["launchctl", "enable", host.launchd_target],
                ["launchctl", "bootstrap", f"gui/{host.uid}", str(host.unit_path)]]
    return [["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", SYSTEMD_UNIT],
            # restart, not `enable --now`: a reinstall with new arguments must replace the
            # running agent, and restart also starts a stopped one.
            ["systemctl", "--user", "restart", SYSTEMD_UNIT]]


def _stop_steps(host: Host) -> list[list[str]]:
    if host.platform == "darwin":
        return [["launchctl", "bootout", host.launchd_target]]
    return [["systemctl", "--user", "disable", "--now", SYSTEMD_UNIT]]


def _start(host: Host) -> None:
    steps = _start_steps(host)
    path = host.unit_path
    if host.platform == "linux":
        for i, step in enumerate(steps):
            ran = _run(step, STOP_COMMAND_TIMEOUT_S)
            if not ran.ok:
                raise _fail(host, ran, steps[i:], wrote=path)
        return
    loaded = _launchd_loaded(host, steps, wrote=path)
    bootout, enable, bootstrap = steps
    if loaded:
        ran = _run(bootout, STOP_COMMAND_TIMEOUT_S)
        if not ran.ok:
            raise _fail(host, ran, steps, wrote=path)
    # A job once turned off with `launchctl disable` stays off across bootstraps until enabled.
    ran = _run(enable)
    if not ran.ok:
        raise _fail(host, ran, [enable, bootstrap], wrote=path)
    for attempt in range(BOOTSTRAP_ATTEMPTS_MAX):
        ran = _run(bootstrap)
        if ran.ok or ran.code != 5:
            break
        if attempt + 1 < BOOTSTRAP_ATTEMPTS_MAX:
            time.sleep(BOOTSTRAP_RETRY_DELAY_S)
    if not ran.ok:
        raise _fail(host, ran, [bootstrap], wrote=path)


# ---------------------------------------------------------------------------------------
# install


def _agent_args(extra: list[str]) -> tuple[str, ...]:
    """Check the arguments after `--` the way `p2pmesh agent` will read them, so the service
    does not start into a crash loop."""
    parser = argparse.ArgumentParser(prog="p2pmesh")
    agent_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        parsed, unknown = parser.parse_known_args(["agent", "--state-dir", _STATE_DIR_PROBE, *extra])
    except SystemExit as exc:  # argparse has printed the problem (or the agent's --help)
        raise Refused("nothing was installed" if exc.code == 0 else
                       "the arguments after `--` must be `p2pmesh agent` options; nothing was installed",
                       EXIT_USAGE) from None
    if unknown:
        raise Refused(f"not `p2pmesh agent` options: {shlex.join(unknown)} (see `p2pmesh agent --help`)",
                       EXIT_USAGE)
    if parsed.state_dir != Path(_STATE_DIR_PROBE):
        raise Refused("give the state directory as `service install --state-dir DIR`, before `--`", EXIT_USAGE)
    if parsed.cluster_key_file is not None and not parsed.cluster_key_file.is_absolute():
        raise Refused(f"--cluster-key-file {parsed.cluster_key_file} must be an absolute path: the service "
                       "does not start in this directory", EXIT_USAGE)
    if not parsed.no_http:
        from p2pmesh.agent import http as http_api

        try:
            http_api.endpoint(parsed.http, parsed.http_token)
        except http_api.HttpConfigError as exc:
            # The service does not inherit this shell's environment, so $P2PMESH_HTTP_TOKEN
            # does not count here.
            raise Refused(f"{exc} (the service does not see this shell's ${http_api.TOKEN_ENV}: "
                           "pass --http-token after `--`)", EXIT_USAGE) from None
    return tuple(extra)


def _spec(args: argparse.Namespace, host: Host) -> ServiceSpec:
    from p2pmesh.agent import default_state_dir

    state_dir = (args.state_dir or default_state_dir()).expanduser().absolute()
    log = host.log_path
    try:
        return ServiceSpec(python=host.python, state_dir=str(state_dir), agent_args=_agent_args(args.agent_args),
                           log_path=str(log) if log is not None else None,
                           environment=default_environment(host.python))
    except ServiceSpecError as exc:
        raise Refused(str(exc), EXIT_USAGE) from None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write temp + fsync + rename, so launchd or systemd never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp makes the file 0600, which stays: the agent arguments may hold an HTTP token.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _install(args: argparse.Namespace, host: Host) -> int:
    spec = _spec(args, host)
    try:
        content = launchd_plist(spec) if host.platform == "darwin" else systemd_unit(spec).encode("utf-8")
    except ServiceSpecError as exc:
        raise Refused(str(exc), EXIT_USAGE) from None
    path = host.unit_path
    if args.dry_run:
        print(f"would write {path}:")
        print(content.decode("utf-8"), end="")
        if args.no_start:
            print("and start nothing (--no-start)")
        else:
            print("then run:" if host.platform == "linux" else "then run (the bootout only if it is loaded):")
            for step in _start_steps(host):
                print(f"  {shlex.join(step)}")
        print("nothing was changed (--dry-run)")
        return EXIT_OK
    try:
        if host.log_path is not None:
            host.log_path.parent.mkdir(parents=True, exist_ok=True)  # launchd does not create it
        _write_atomically(path, content)
    except OSError as exc:
        raise Refused(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"wrote {path}")
    if args.no_start:
        print("not started (--no-start); to start it now:")
        for step in _start_steps(host):
            print(f"  {shlex.join(step)}")
        return EXIT_OK
    _start(host)
    print(f"started with {host.manager}: the agent now runs at every login ({shlex.join(spec.argv)})")
    print(f"logs: {host.logs}; check it with `p2pmesh service status`")
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# uninstall


def _uninstall(args: argparse.Namespace, host: Host) -> int:
    path = host.unit_path
    after = [["systemctl", "--user", "daemon-reload"]] if host.platform == "linux" else []
    if args.dry_run:
        if not args.no_start:
            print("would run (only if it is loaded):")
            for step in _stop_steps(host):
                print(f"  {shlex.join(step)}")
        print(f"would remove {path}" + ("" if path.exists() else " (it does not exist)"))
        if not args.no_start:
            for step in after:
                print(f"then run: {shlex.join(step)}")
        print("nothing was changed (--dry-run)")
        return EXIT_OK
    stopped = False
    if not args.no_start:
        stopped = _stop(host, path, [*_stop_steps(host), ["rm", "-f", str(path)], *after])
    try:
        path.unlink()
        print(f"removed {path}")
    except FileNotFoundError:
        print(f"{path} was not there: nothing to remove")
        if not stopped:
            return EXIT_OK  # nothing changed, so systemd has nothing to reload
    except OSError as exc:
        raise Refused(f"cannot remove {path}: {exc.strerror or exc}") from None
    if not args.no_start:
        for step in after:
            ran = _run(step)
            if not ran.ok:
                raise _fail(host, ran, [step], wrote=None)
    return EXIT_OK


def _stop(host: Host, path: Path, by_hand: list[list[str]]) -> bool:
    """Stop and unload the service if the manager has it (True if it did); the file is left
    to the caller. When the manager cannot be asked, nothing is removed, so a retry sees the
    same state."""
    note = "(or `p2pmesh service uninstall --no-start` removes only the file)"
    stop = _stop_steps(host)[0]
    state, failed = _query(host)
    if state is None:
        assert failed is not None
        if not path.exists():
            return False  # no file of ours, so nothing of ours can be running
        raise _fail(host, failed, by_hand, wrote=None, note=note)
    if not state.loaded and not state.running:
        return False
    ran = _run(stop, STOP_COMMAND_TIMEOUT_S)
    if not ran.ok:
        raise _fail(host, ran, by_hand, wrote=None, note=note)
    print(f"stopped: {shlex.join(stop)}")
    return True


# ---------------------------------------------------------------------------------------
# status


def _query(host: Host) -> tuple[ServiceState | None, _Ran | None]:
    """The manager's view, or (None, what failed) when it cannot be asked."""
    if host.platform == "darwin":
        ran = _run(["launchctl", "print", host.launchd_target])
        if not ran.ok:
            if ran.code == _LAUNCHD_NOT_FOUND or "Could not find service" in ran.err:
                return not_loaded(), None
            return None, ran
        parse = parse_launchctl_print
    else:
        ran = _run(["systemctl", "--user", "show", SYSTEMD_UNIT, "--property=" + ",".join(SYSTEMD_PROPERTIES)])
        if not ran.ok:
            return None, ran
        parse = parse_systemctl_show
    try:
        return parse(ran.out), None
    except ServiceOutputError as exc:
        return None, _Ran(ran.argv, ran.code, "", str(exc))


def _summary(installed: bool, state: ServiceState | None) -> str:
    if state is None:
        return "installed, state unknown" if installed else "not installed, state unknown"
    if state.running:
        return f"running (pid {state.pid})"
    if state.loaded:
        last = f"; last exit code {state.last_exit_code}" if state.last_exit_code is not None else ""
        last += f"; last ended by {state.last_signal}" if state.last_signal else ""
        return f"loaded, not running ({state.state}{last})"
    return "installed, not loaded" if installed else "not installed"


def _status(args: argparse.Namespace, host: Host) -> int:
    path = host.unit_path
    installed = path.is_file()
    state, failed = _query(host)
    error = None
    if failed is not None:
        hint = _hint(host, failed)
        error = failed.describe() + (f"; {hint}" if hint else "")
    view = state.to_json() if state is not None else {
        "loaded": None, "running": None, "pid": None, "state": None, "last_exit_code": None,
        "last_signal": None, "enabled": None}
    out: dict[str, Any] = {
        "manager": host.manager,
        "name": DEFAULT_LABEL if host.platform == "darwin" else SYSTEMD_UNIT,
        "path": str(path),
        "installed": installed,
        **view,
        "logs": host.logs,
        "error": error,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['manager']} {out['name']}: {_summary(installed, state)}")
        print(f"  file: {path}" + ("" if installed else " (absent)"))
        print(f"  logs: {host.logs}")
        if error:
            print(f"p2pmesh: cannot ask {host.manager}: {error}", file=sys.stderr)
    return EXIT_OK if state is not None else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """`python -m p2pmesh.cli.service_cmd service ...`: this command without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="p2pmesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
