"""The HTTP API's settings: where it listens, its token, and its bounds; and the checks the
CLI runs before starting the agent (a non-loopback bind needs a token: `InsecureBind`)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from p2pmesh.core.errors import MeshError

DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 7780
"""Not 7741 (peers) or 7742 (link probes, peer port + 1), nowhere near the data plane's
47000-48023, and not 8000/8080 where other local model servers usually sit."""
DEFAULT_HTTP_ADDRESS = f"{DEFAULT_HTTP_HOST}:{DEFAULT_HTTP_PORT}"
TOKEN_ENV = "P2PMESH_HTTP_TOKEN"
TOKEN_CHARS_MIN = 16
TOKEN_CHARS_MAX = 4096


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on what one client can make the agent hold."""

    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64
    """Requests in flight on the API (GET /health is not counted, so a saturated agent can
    still be probed). One more is refused with 429."""
    body_timeout_s: float = 30.0
    """A request body must arrive within this time (408 otherwise)."""
    stream_idle_timeout_s: float = 300.0
    """A generation that yields nothing for this long fails (504)."""
    event_streams_max: int = 8
    """Dashboard event streams (`GET /v1/events`) open at once, counted apart from the
    requests above since they last (one per dashboard tab); one more is refused with 429."""
    event_heartbeat_s: float = 15.0
    """An event stream that had nothing to say for this long sends a heartbeat."""
    event_refresh_s: float = 1.0
    """How often an event stream looks at the status besides the cluster view's changes: the
    serving head's batch report (tokens/s, requests running and queued) has no event."""


@dataclass(frozen=True, slots=True)
class HttpEndpoint:
    """Where the API listens and the token it requires (None: no token)."""

    host: str
    port: int
    token: str | None = field(default=None, repr=False)  # never in a log line


class HttpConfigError(MeshError, ValueError):
    """The user's HTTP settings are unusable (the user's to fix: flags or environment).
    A ValueError too, so the CLI's usage-error handler prints it as it is."""


class InsecureBind(HttpConfigError):
    """A non-loopback address was asked for without a token."""


class HttpBindError(HttpConfigError):
    """The address cannot be bound (in use, not on this Mac, no permission)."""


# ------------------------------------------------------------------------------------
# Configuration checks (the CLI calls these before starting the agent)


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HttpConfigError(
            f"--http must look like HOST:PORT (e.g. {DEFAULT_HTTP_ADDRESS} or [::1]:{DEFAULT_HTTP_PORT}), got {address!r}"
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so it is not trusted as local


def check_bind(host: str, token: str | None) -> None:
    """Refuse a token that cannot be sent in a header or is too short to guess-proof, and an
    address reachable from other machines without a token."""
    if token is not None:
        if not TOKEN_CHARS_MIN <= len(token) <= TOKEN_CHARS_MAX or not all("!" <= c <= "~" for c in token):
            raise HttpConfigError(
                f"the HTTP token must be {TOKEN_CHARS_MIN} to {TOKEN_CHARS_MAX} printable ASCII characters without spaces "
                f"(for example: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    elif not is_loopback(host):
        raise InsecureBind(
            f"refusing to serve the HTTP API on {host} without a token: anyone who can reach that address could use "
            f"the cluster. Set {TOKEN_ENV} (or --http-token), bind to 127.0.0.1, or pass --no-http"
        )


def endpoint(address: str, token: str | None) -> HttpEndpoint:
    """Parse and check `--http` and the token in one go (raises HttpConfigError)."""
    host, port = parse_address(address)
    token = token or None
    check_bind(host, token)
    return HttpEndpoint(host, port, token)


def find_config_error(exc: BaseException) -> HttpConfigError | None:
    """The HttpConfigError inside an exception (group) from trio.run, if any: a bind failure
    surfaces through the agent's nurseries wrapped in exception groups."""
    if isinstance(exc, HttpConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_config_error(inner)
            if found is not None:
                return found
    return None
