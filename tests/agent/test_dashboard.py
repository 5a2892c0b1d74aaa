"""The dashboard's server side (p2pmesh/agent/http/dashboard.py, watch_events.py), over real
HTTP on loopback against a stub agent (fast and scripted; tests/agent/test_dashboard_browser.py
has the real cluster and the real browser):

- the page and its two assets load without the token, with a Content-Security-Policy, and
  name nothing outside the agent;
- `GET /v1/events` needs the token like the API; it sends the public status first, then the
  watch events and the new status when the status changes, heartbeats when nothing does;
  it wakes on the agent's ClusterView rather than waiting for its refresh period; streams are
  bounded in number and end when the server stops;
- watch_events gives the events the client's watch (client/events.py) gives.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import re
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest
import trio

from p2pmesh.agent.http import HttpLimits, serve_http
from p2pmesh.agent.http.dashboard import PAGES, asset
from p2pmesh.agent.http.watch_events import watch_events

TOKEN = "dashboard-token-0123456789"
A, B, C = "a" * 32, "b" * 32, "c" * 32


def _status(leader: str | None = A, members: dict[str, bool] | None = None, ring: int = 1,
            placement: dict[str, Any] | None = None, requests: dict[str, Any] | None = None,
            cluster: str = "c1") -> dict[str, Any]:
    members = {A: True, B: True} if members is None else members
    return {"node_id": A, "pid": 42, "state_dir": "/secret", "cluster_id": cluster, "role": "leader", "term": 3,
            "leader": leader, "healthy": leader is not None, "commit_index": 9, "applied_index": 9,
            "members": [{"node_id": n, "voter": True, "up": up, "addresses": [], "ports": []} for n, up in members.items()],
            "ring": {"epoch": ring, "order": list(members), "hops": []}, "placement": placement, "requests": requests}


class Stub:
    """An agent whose status the test sets; no generation."""

    def __init__(self) -> None:
        self.current = _status()

    def status(self) -> dict[str, Any]:
        return self.current

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise AssertionError("no generation here")
        yield {}


async def _serve(nursery: trio.Nursery, agent: Any, token: str | None = None, **limits: Any) -> tuple[str, int]:
    urls = await nursery.start(partial(serve_http, agent, "127.0.0.1", 0, token=token, limits=HttpLimits(**limits)))
    host, port = urls[0].removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _get(address: tuple[str, int], path: str, method: str = "GET", headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class Feed:
    """A blocking reader of one /v1/events stream (run it in a thread)."""

    def __init__(self, address: tuple[str, int], token: str | None = None) -> None:
        self.conn = http.client.HTTPConnection(*address, timeout=10)
        self.conn.request("GET", "/v1/events", headers={"Authorization": f"Bearer {token}"} if token else {})
        self.response = self.conn.getresponse()
        self.status = self.response.status

    def next(self) -> dict[str, Any] | None:
        """The next event's JSON; None at the end of the stream."""
        data = []
        while True:
            line = self.response.readline()
            if not line:
                return None
            line = line.rstrip(b"\r\n")
            if not line and data:
                return json.loads(b"\n".join(data))  # type: ignore[no-any-return]
            if line.startswith(b"data: "):
                data.append(line[6:])

    def close(self) -> None:
        self.conn.close()


async def _open(address: tuple[str, int], token: str | None = None) -> Feed:
    return await trio.to_thread.run_sync(Feed, address, token)


async def _next(feed: Feed, timeout_s: float = 5) -> dict[str, Any] | None:
    with trio.fail_after(timeout_s):
        return await trio.to_thread.run_sync(feed.next, abandon_on_cancel=True)


# ------------------------------------------------------------------------------------
# The page


def test_the_assets_name_nothing_outside_the_agent() -> None:
    page = asset("index.html").decode()
    assert set(re.findall(r'(?:src|href)="([^"]*)"', page)) == {"/dashboard.js", "/dashboard.css"}
    script, style = asset("dashboard.js").decode(), asset("dashboard.css").decode()
    # The one absolute URL is the SVG namespace (a name, never fetched).
    assert set(re.findall(r"https?://[^\s\"'`)]+", page + script + style)) == {"http://www.w3.org/2000/svg"}
    assert set(re.findall(r'fetch\("([^"]+)"', script)) == {"/v1/events", "/v1/chat/completions"}
    assert "url(" not in style and "@import" not in style
    assert "prefers-color-scheme: dark" in style


@pytest.mark.trio
async def test_the_page_loads_without_the_token_and_its_data_does_not() -> None:
    async with trio.open_nursery() as nursery:
        address = await _serve(nursery, Stub(), token=TOKEN)
        for path, (name, kind) in PAGES.items():
            status, headers, body = await trio.to_thread.run_sync(_get, address, path)
            assert status == 200 and headers["content-type"] == kind and body == asset(name)
            assert "script-src 'self'" in headers["content-security-policy"]
            assert headers["x-content-type-options"] == "nosniff"
        status, headers, body = await trio.to_thread.run_sync(partial(_get, address, "/", "HEAD"))
        assert status == 200 and body == b"" and int(headers["content-length"]) == len(asset("index.html"))
        for auth in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            status, headers, body = await trio.to_thread.run_sync(partial(_get, address, "/v1/events", headers=auth))
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = await trio.to_thread.run_sync(_get, address, "/index.html")
        assert status == 401  # only the three pages are public; anything else is the API's
        feed = await _open(address, TOKEN)
        assert feed.status == 200 and feed.response.getheader("content-type").startswith("text/event-stream")
        first = await _next(feed)
        assert first is not None and first["type"] == "status"
        assert first["status"]["members"][0]["node_id"] == A and "pid" not in first["status"]
        assert "state_dir" not in first["status"]
        feed.close()
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------
# The feed


@pytest.mark.trio
async def test_the_feed_sends_watch_events_and_the_new_status_then_heartbeats() -> None:
    stub = Stub()
    async with trio.open_nursery() as nursery:
        address = await _serve(nursery, stub, event_refresh_s=0.05, event_heartbeat_s=0.5)
        feed = await _open(address)
        assert (await _next(feed))["type"] == "status"  # type: ignore[index]
        stub.current = _status(members={A: True, B: False}, ring=2)
        got = [await _next(feed) for _ in range(3)]
        assert [(e["type"], e.get("kind")) for e in got] == [  # type: ignore[index]
            ("event", "member_down"), ("event", "ring_changed"), ("status", None)]
        assert got[0]["node_id"] == B and got[0]["detail"] == f"{B[:8]} is down (the leader stopped hearing it)"  # type: ignore[index]
        assert got[2]["status"]["members"][1]["up"] is False  # type: ignore[index]
        # Nothing changes: a heartbeat after about event_heartbeat_s, and no repeated status.
        start = trio.current_time()
        assert await _next(feed) == {"type": "heartbeat"}
        assert trio.current_time() - start >= 0.4
        feed.close()
        nursery.cancel_scope.cancel()


class ViewStub(Stub):
    """An agent with a ClusterView (agent/ports.py): its status changes only with a
    published snapshot, as the running agent's does."""

    def __init__(self) -> None:
        from p2pmesh.agent.ports import ViewPublisher

        super().__init__()
        self.publisher = ViewPublisher(A)  # type: ignore[arg-type]
        self.view = self.publisher.view

    def publish(self, status: dict[str, Any]) -> None:
        from p2pmesh.agent.ports import Snapshot

        self.current = status
        assert self.publisher.publish(Snapshot(0, A, requests_resumed=self.view.current.requests_resumed + 1))  # type: ignore[arg-type]


@pytest.mark.trio
async def test_the_feed_wakes_on_the_agents_view_not_its_refresh_period() -> None:
    stub = ViewStub()
    async with trio.open_nursery() as nursery:
        address = await _serve(nursery, stub, event_refresh_s=3600.0)
        feed = await _open(address)
        assert (await _next(feed))["type"] == "status"  # type: ignore[index]
        await trio.sleep(0.2)  # the feed is waiting on the view now
        stub.publish(_status(leader=B))
        got = await _next(feed, timeout_s=2)  # long before the refresh period
        assert got is not None and got["kind"] == "leader_changed" and got["node_id"] == B
        feed.close()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_streams_are_bounded_freed_on_disconnect_and_ended_with_the_server() -> None:
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            address = await _serve(nursery, Stub(), event_streams_max=2, max_concurrent=1)
            feeds = [await _open(address) for _ in range(2)]
            for feed in feeds:
                assert feed.status == 200 and (await _next(feed))["type"] == "status"  # type: ignore[index]
            status, headers, body = await trio.to_thread.run_sync(_get, address, "/v1/events")
            assert status == 429 and json.loads(body)["error"]["code"] == "too_many_requests" and headers["retry-after"]
            # Streams are not API requests: with max_concurrent=1 and two streams open, a request still passes.
            status, _, _ = await trio.to_thread.run_sync(_get, address, "/v1/cluster")
            assert status == 200
            feeds.pop().close()
            with trio.fail_after(5):
                while True:  # the server notices the hang-up and frees the place
                    again = await _open(address)
                    if again.status == 200:
                        break
                    again.close()
                    await trio.sleep(0.05)
            assert (await _next(again))["type"] == "status"  # type: ignore[index]
            ended = trio.Event()

            async def read_to_end(feed: Feed) -> None:
                while await trio.to_thread.run_sync(feed.next, abandon_on_cancel=True) is not None:
                    pass
                ended.set()

            outer.start_soon(read_to_end, again)
            nursery.cancel_scope.cancel()  # the server stops: the open streams end
        with trio.fail_after(5):
            await ended.wait()
        for feed in (*feeds, again):
            feed.close()


# ------------------------------------------------------------------------------------
# watch_events and the client's watch


def test_watch_events_are_the_clients_watch_events() -> None:
    """The same statuses through the client's diff (client/events.py, typed values) and the
    agent's (watch_events.py, the JSON): the same kinds, sentences and fields."""
    from p2pmesh.client import _diff, _status as parse

    def placement(epoch: int, stages: list[tuple[str, int, int]], pending: dict[str, Any] | None = None,
                  model: str | None = "m") -> dict[str, Any]:
        p: dict[str, Any] = {"epoch": epoch, "model": model, "serving": bool(stages), "batch": 1, "batch_asked": 1,
                             "stages": [{"node_id": n, "layers": [a, b]} for n, a, b in stages]}
        if pending is not None:
            p["pending"] = pending
        return p

    two = [(A, 0, 3), (B, 3, 6)]
    sequence = [
        _status(placement=placement(1, [(A, 0, 6)])),
        _status(leader=B, members={A: True, B: False, C: True}, ring=2,
                placement=placement(1, [(A, 0, 6)], {"epoch": 2, "stages": [{"node_id": n, "layers": [a, b]} for n, a, b in two],
                                                     "ready": [], "fetched": [A], "batch": 1})),
        _status(leader=B, members={A: True, B: True}, ring=2,
                placement=placement(1, [(A, 0, 6)], {"epoch": 2, "stages": [{"node_id": n, "layers": [a, b]} for n, a, b in two],
                                                     "ready": [B], "fetched": [A, B], "batch": 1})),
        _status(leader=None, members={A: True, B: True}, ring=2, placement=placement(2, two)),
        _status(members={A: True}, cluster="c2", placement=placement(0, [], model=None)),
        _status(members={A: True}, cluster="c2", placement=placement(1, [(A, 0, 6)]),
                requests={"active": 3, "queued": 1, "tokens_per_s": 120.5, "head": A, "epoch": 1}),
        _status(members={A: True}, cluster="c2", placement=placement(1, [(A, 0, 6)]),
                requests={"active": 3, "queued": 1, "tokens_per_s": 99.0, "head": A, "epoch": 1}),
        _status(members={A: True}, cluster="c2", placement=placement(1, [(A, 0, 6)])),
        _status(members={A: True}, cluster="c2", placement=None),
        {**_status(members={A: True}, cluster="c2", placement=None),
         "transfers": [{"node_id": A, "source": "hub", "bytes_done": 0, "bytes_total": 10**8, "mb_s": 0.0, "eta_s": None}]},
        {**_status(members={A: True}, cluster="c2", placement=None),
         "transfers": [{"node_id": A, "source": "hub", "bytes_done": 5 * 10**7, "bytes_total": 10**8, "mb_s": 50.0, "eta_s": 1.0},
                       {"node_id": B, "source": "peer", "bytes_done": 10**6, "bytes_total": 10**6, "mb_s": 9.5, "eta_s": 0.0}]},
    ]
    fields = ("node_id", "epoch", "ready", "stages")
    seen = set()
    for i, prev in enumerate(sequence):
        for cur in sequence[i:]:
            ours = watch_events(prev, cur)
            theirs = [{"kind": e.kind.value, "detail": e.detail, **{f: getattr(e, f) for f in fields if getattr(e, f) is not None},
                       **({k: list(v) if isinstance(v, tuple) else v  # (JSON has lists)
                           for k, v in dataclasses.asdict(e.transfer).items() if v is not None} if e.transfer else {})}
                      for e in _diff(parse(prev), parse(cur))]
            assert [{k: v for k, v in e.items() if v is not None} for e in ours] == theirs, (i, cur)
            seen |= {e["kind"] for e in ours}
    assert seen == {"cluster_changed", "member_joined", "member_left", "member_down", "member_up", "leader_changed",
                    "ring_changed", "model_changed", "plan_committed", "rebalance_progress", "requests_changed",
                    "plan_activated", "fetch_progress"}
