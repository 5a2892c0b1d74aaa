"""The dashboard in the browser (docs/dashboard.md): the page at `GET /` with its two assets,
and `GET /v1/events`, the live feed it draws from.

- The page (`PAGES`): index.html, dashboard.js and dashboard.css from static/ beside this
  module, shipped in the package and read once. Nothing is fetched from anywhere else, and
  the Content-Security-Policy says so to the browser too (no inline script, no other origin).
  The page needs no token: it holds no data. It asks for the token when the API wants one.
- The feed (`EventStreams`): server-sent events, each one `data: {json}` with a `type`:
  `status` (the public status, as /v1/cluster), `event` (a watch event, watch_events.py),
  `heartbeat` (nothing changed for `event_heartbeat_s`). It wakes on the agent's ClusterView
  (`changed`, agent/ports.py) when the agent has one; the serving head's batch report
  (status `requests`) has no event (it is kept out of the view), so the status is also
  looked at every `event_refresh_s`, and sent only when it differs. Streams are bounded in
  number (429 past `event_streams_max`, not counted in the API's request limit since they
  last), end when the client goes away, and are cancelled with the server on shutdown. The
  bounds are HttpLimits' `event_*` fields.
"""
from __future__ import annotations

from importlib import resources
from typing import Any

import trio

from p2pmesh.agent.http.bodies import ApiError
from p2pmesh.agent.http.config import HttpLimits
from p2pmesh.agent.http.stream import Receive, Reply, Send
from p2pmesh.agent.http.watch_events import watch_events
from p2pmesh.agent.status import public_status

PAGES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
"""Path -> (file in static/, content type): served to anyone who can reach the API."""

SECURITY_HEADERS = (
    ("content-security-policy", "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
)

_assets: dict[str, bytes] = {}


def asset(name: str) -> bytes:
    """One file of static/ (read once; a few tens of KiB)."""
    data = _assets.get(name)
    if data is None:
        data = _assets[name] = resources.files(__package__).joinpath("static", name).read_bytes()
    return data


async def serve_page(path: str, method: str, send: Send) -> bool:
    """Answer a GET or HEAD of one of PAGES; False when ``path`` is not one of them (or the
    method is another), for the API's routing to answer."""
    page = PAGES.get(path)
    if page is None or method not in ("GET", "HEAD"):
        return False
    body = asset(page[0])
    headers = [(b"content-type", page[1].encode()), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body if method == "GET" else b"", "more_body": False})
    return True


class EventStreams:
    """The open event streams of one server, and the feed each one runs."""

    def __init__(self, agent: Any, limits: HttpLimits) -> None:
        self.agent = agent
        self.limits = limits
        self.open = 0

    async def stream(self, receive: Receive, reply: Reply) -> None:
        """Serve one stream until the client goes away (or the server is cancelled)."""
        if self.open >= self.limits.event_streams_max:
            raise ApiError(429, f"too many event streams (at most {self.limits.event_streams_max}); close a dashboard tab",
                           code="too_many_requests", headers=(("retry-after", "5"),))
        self.open += 1
        try:
            await reply.start_events()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._feed, reply)
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()
        finally:
            self.open -= 1

    async def _feed(self, reply: Reply) -> None:
        view = getattr(self.agent, "view", None)  # the running agent's ClusterView; a stub has none
        version = -1
        prev: dict[str, Any] | None = None
        quiet_since = trio.current_time()
        while True:
            cur = public_status(self.agent.status())
            if cur != prev:
                # Compare what goes out, not the snapshot's version: a new version may change
                # nothing public, and the batch report changes without one.
                for event in watch_events(prev, cur) if prev is not None else ():
                    await reply.event({"type": "event", **event})
                await reply.event({"type": "status", "status": cur})
                prev, quiet_since = cur, trio.current_time()
            elif trio.current_time() - quiet_since >= self.limits.event_heartbeat_s:
                await reply.event({"type": "heartbeat"})
                quiet_since = trio.current_time()
            wait = self.limits.event_refresh_s
            if view is not None:
                snapshot = await view.changed(version, timeout_s=wait)
                version = snapshot.version
            else:
                await trio.sleep(wait)

