"""The agent as a login service: what launchd and systemd are told, and what they answer.

This module owns three pure things, text in and text out:

- ``ServiceSpec``: the service, validated once (label, program argv, state directory, log
  file, environment, restart and stop timing).
- The two renderings of a spec: ``launchd_plist`` (a LaunchAgent property list for
  ``~/Library/LaunchAgents``) and ``systemd_unit`` (a ``systemd --user`` unit).
- The two status parsers: ``parse_launchctl_print`` and ``parse_systemctl_show``, which turn
  the managers' outputs into one ``ServiceState``.

Both renderings restart the agent when it crashes (a non-zero exit or a signal) and leave it
stopped when it exits 0, which is what `p2pmesh leave` and SIGTERM produce: otherwise a
clean leave would come straight back.

No I/O here: p2pmesh.cli.service_cmd finds the paths, writes the files and runs launchctl or
systemctl. A bad spec raises ``ServiceSpecError`` (the caller's fault); output this module
cannot read raises ``ServiceOutputError`` (the manager's).
"""
from __future__ import annotations

import plistlib
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Final

from p2pmesh.core.errors import LocalProtocolError, MeshError

DEFAULT_LABEL: Final = "dev.p2pmesh.agent"
SYSTEMD_UNIT: Final = "p2pmesh.service"
# The properties `systemctl --user show` is asked for; parse_systemctl_show reads these.
SYSTEMD_PROPERTIES: Final = (
    "LoadState", "ActiveState", "SubState", "MainPID", "ExecMainCode", "ExecMainStatus", "UnitFileState",
)
# launchd's own default ThrottleInterval, and systemd's RestartSec to match: a crash loop
# costs one start every 10 s, not a busy loop.
RESTART_DELAY_S: Final = 10
# `agent --leave-on-exit` may spend leave_timeout + drain_timeout + 1 s (66 s) handing its
# layers off after SIGTERM; launchd's default of 20 s would SIGKILL it halfway.
STOP_TIMEOUT_S: Final = 90
# The agent runs ifconfig, ip, networksetup and system_profiler by name; all live here.
SYSTEM_PATH: Final = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# systemd splits ExecStart= on whitespace and gives meaning to quotes, backslashes, `%`,
# `$` and a lone `;`. Words made only of these characters need no quoting.
_SYSTEMD_BARE = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_ARGS_LEN_MAX: Final = 256
_TEXT_LEN_MAX: Final = 4096


class ServiceSpecError(LocalProtocolError):
    """The service asked for cannot be written (a bad label, a relative path, a newline in
    an argument): the caller's fault, and nothing was written."""


class ServiceOutputError(MeshError):
    """launchctl or systemctl printed something this module cannot read: the manager's
    output changed or it failed in a way not seen before."""


def _text(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise ServiceSpecError(f"{what} must be text, got {type(value).__name__}")
    if len(value) > _TEXT_LEN_MAX:
        raise ServiceSpecError(f"{what} is {len(value)} characters long (at most {_TEXT_LEN_MAX})")
    if _CONTROL.search(value):
        raise ServiceSpecError(f"{what} {value!r} contains a control character (a unit file line cannot hold it)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ServiceSpecError(f"{what} {value!r} is not valid UTF-8 text") from None
    return value


def _absolute(what: str, value: str) -> str:
    _text(what, value)
    # The service starts in `/` (launchd) or $HOME (systemd), never where install ran.
    if not value.startswith("/"):
        raise ServiceSpecError(f"{what} {value!r} is not an absolute path")
    return value


def default_environment(python: str) -> tuple[tuple[str, str], ...]:
    """The environment the agent runs with: the interpreter's directory (a venv's tools)
    then the system directories, and unbuffered output so log lines land as written."""
    entries = [posixpath.dirname(python), *SYSTEM_PATH]
    path = ":".join(dict.fromkeys(e for e in entries if e))
    return (("PATH", path), ("PYTHONUNBUFFERED", "1"))


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One agent service. Constructing it validates every field (raises ServiceSpecError)."""

    python: str  # absolute path of the interpreter, as is: a venv's symlink must stay a symlink
    state_dir: str  # absolute; always passed to the agent, so the service and the shell agree
    agent_args: tuple[str, ...] = ()  # extra `p2pmesh agent` options, already checked by the caller
    label: str = DEFAULT_LABEL  # the launchd Label and plist file name
    log_path: str | None = None  # stdout+stderr; None: the manager's own log (the journal)
    environment: tuple[tuple[str, str], ...] = ()
    restart_delay_s: int = RESTART_DELAY_S
    stop_timeout_s: int = STOP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not _LABEL.fullmatch(self.label):
            raise ServiceSpecError(
                f"label {self.label!r} must be 1-128 letters, digits, '.', '_' or '-' (like {DEFAULT_LABEL!r})")
        _absolute("the Python interpreter", self.python)
        _absolute("the state directory", self.state_dir)
        if self.log_path is not None:
            _absolute("the log file", self.log_path)
        if not isinstance(self.agent_args, tuple) or len(self.agent_args) > _ARGS_LEN_MAX:
            raise ServiceSpecError(f"agent arguments must be a tuple of at most {_ARGS_LEN_MAX} strings")
        for arg in self.agent_args:
            _text("agent argument", arg)
        names = [name for name, _ in self.environment]
        if len(set(names)) != len(names):
            raise ServiceSpecError(f"environment names repeat: {names}")
        for name, value in self.environment:
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise ServiceSpecError(f"environment name {name!r} must be letters, digits and '_'")
            _text(f"environment value of {name}", value)
        for what, seconds in (("restart delay", self.restart_delay_s), ("stop timeout", self.stop_timeout_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= 3600:
                raise ServiceSpecError(f"{what} must be 1-3600 seconds, got {seconds!r}")

    @property
    def argv(self) -> tuple[str, ...]:
        return (self.python, "-m", "p2pmesh", "agent", "--state-dir", self.state_dir, *self.agent_args)


# ---------------------------------------------------------------------------------------
# Renderings


def launchd_plist(spec: ServiceSpec) -> bytes:
    """The LaunchAgent property list (XML) for ``~/Library/LaunchAgents/<label>.plist``.

    Raises:
        ServiceSpecError: the spec has no log file (launchd has no journal to fall back to).
    """
    if spec.log_path is None:
        raise ServiceSpecError("a launchd service needs a log file: launchd discards output otherwise")
    job: dict[str, Any] = {
        "Label": spec.label,
        "ProgramArguments": list(spec.argv),
        "RunAtLoad": True,
        # Restart after a crash, not after `p2pmesh leave` or SIGTERM (both exit 0).
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": spec.restart_delay_s,
        "ExitTimeOut": spec.stop_timeout_s,
        # The default (Standard) and Background throttle CPU and I/O; the agent serves
        # inference. Adaptive only lifts limits for XPC traffic, which the agent has none of.
        "ProcessType": "Interactive",
        "StandardOutPath": spec.log_path,
        "StandardErrorPath": spec.log_path,
    }
    if spec.environment:
        job["EnvironmentVariables"] = dict(spec.environment)
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=True)


def systemd_quote(word: str) -> str:
    """One ExecStart= word, quoted by systemd's rules (systemd.service(5), "Command lines"):
    C-style escapes for backslash and quote, `%%` for a literal `%` (specifiers) and `$$`
    for a literal `$` (variable expansion)."""
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return escaped if _SYSTEMD_BARE.fullmatch(word) else f'"{escaped}"'


def _systemd_env(name: str, value: str) -> str:
    # Environment= expands specifiers but not variables, so `$` stays as is.
    assignment = f"{name}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{assignment}"'


def systemd_unit(spec: ServiceSpec) -> str:
    """The ``systemd --user`` unit text for ``~/.config/systemd/user/p2pmesh.service``.

    Raises:
        ServiceSpecError: the log file path holds whitespace (`append:` cannot quote it).
    """
    lines = [
        "# Written by `p2pmesh service install`; remove it with `p2pmesh service uninstall`.",
        "[Unit]",
        "Description=p2pmesh agent",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(systemd_quote(w) for w in spec.argv),
    ]
    if spec.environment:
        lines.append("Environment=" + " ".join(_systemd_env(n, v) for n, v in spec.environment))
    if spec.log_path is not None:
        if re.search(r"\s", spec.log_path):
            raise ServiceSpecError(f"the log file {spec.log_path!r} holds whitespace, which systemd cannot take here")
        target = "append:" + spec.log_path.replace("%", "%%")
        lines += [f"StandardOutput={target}", f"StandardError={target}"]
    lines += [
        # Restart after a crash, not after `p2pmesh leave` or SIGTERM (both exit 0).
        "Restart=on-failure",
        f"RestartSec={spec.restart_delay_s}",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        # SIGTERM to the agent only, as launchd does: the agent stops its own workers, and
        # anything left after the timeout is killed.
        "KillMode=mixed",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Status


@dataclass(frozen=True, slots=True)
class ServiceState:
    """What the service manager says about the service."""

    loaded: bool  # the manager knows the job (launchd) or found the unit file (systemd)
    running: bool
    pid: int | None
    state: str  # the manager's own words: "running", "not running", "active (running)", ...
    last_exit_code: int | None  # None: never exited, or the manager does not say
    last_signal: str | None = None  # set instead when the last run ended by a signal
    enabled: bool | None = None  # systemd: starts at login; launchd: None (RunAtLoad does)

    def to_json(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "running": self.running, "pid": self.pid, "state": self.state,
                "last_exit_code": self.last_exit_code, "last_signal": self.last_signal, "enabled": self.enabled}


def not_loaded(state: str = "not loaded") -> ServiceState:
    """The state of a service the manager does not know."""
    return ServiceState(loaded=False, running=False, pid=None, state=state, last_exit_code=None)


def _int(what: str, value: str) -> int:
    if not re.fullmatch(r"-?[0-9]{1,10}", value):
        raise ServiceOutputError(f"{what} {value!r} is not a number")
    return int(value)


def parse_launchctl_print(text: str) -> ServiceState:
    """Read ``launchctl print gui/<uid>/<label>`` for a loaded job.

    Only the job's own top-level ``key = value`` lines are read (``state``, ``pid``, ``last
    exit code``, ``last terminating signal``); nested blocks such as ``arguments = {`` are
    skipped. Apple documents this output as "NOT API", so unknown lines are ignored and only
    a missing ``state`` is an error.

    Raises:
        ServiceOutputError: no ``state`` line, or a number that is not one.
    """
    fields: dict[str, str] = {}
    depth = 0
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith("{"):
            depth += 1
            continue
        if line == "}":
            depth = max(0, depth - 1)
            continue
        key, sep, value = line.partition(" = ")
        if sep and depth == 1:
            fields.setdefault(key, value.strip())
    if "state" not in fields:
        raise ServiceOutputError("`launchctl print` printed no `state = ...` line for the job")
    pid = _int("launchd pid", fields["pid"]) if "pid" in fields else None
    code: int | None = None
    last = fields.get("last exit code", "")
    # "0", "1", "78: EX_CONFIG", or "(never exited)".
    match = re.fullmatch(r"(-?[0-9]{1,10})(?::.*)?", last)
    if match:
        code = int(match.group(1))
    state = fields["state"]
    return ServiceState(loaded=True, running=state == "running" and pid is not None, pid=pid, state=state,
                        last_exit_code=code, last_signal=fields.get("last terminating signal"))


def parse_systemctl_show(text: str) -> ServiceState:
    """Read ``systemctl --user show p2pmesh.service --property=...`` (SYSTEMD_PROPERTIES),
    one ``Key=value`` per line, in any order.

    Raises:
        ServiceOutputError: a line without ``=``, no ActiveState, or a bad number.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ServiceOutputError(f"`systemctl show` printed {line[:80]!r}, not Key=value")
        fields[key.strip()] = value.strip()
    if "ActiveState" not in fields:
        raise ServiceOutputError("`systemctl show` printed no ActiveState")
    active, sub = fields["ActiveState"], fields.get("SubState", "")
    pid = _int("MainPID", fields.get("MainPID", "0")) or None
    # ExecMainCode is the CLD_* of the last exit: 0 never exited, 1 exited, 2/3 killed/dumped.
    how = _int("ExecMainCode", fields.get("ExecMainCode", "0"))
    status = _int("ExecMainStatus", fields.get("ExecMainStatus", "0"))
    unit_file = fields.get("UnitFileState", "")
    return ServiceState(
        loaded=fields.get("LoadState", "loaded") == "loaded",
        running=active == "active" and sub == "running",
        pid=pid,
        state=f"{active} ({sub})" if sub else active,
        last_exit_code=status if how == 1 else None,
        last_signal=f"signal {status}" if how in (2, 3) else None,
        enabled=unit_file.startswith("enabled") if unit_file else None,
    )
