"""p2pmesh/agent/tasks/fetch.py's loop: it reports a stage's files once they are on disk, and a
stage it cannot get is reported broken after its bounded tries (so the leader restarts or
re-plans it rather than waiting for ever). The loop gets real ports: a ClusterView that the
test publishes committed states to, and the Inbox the core would read."""
from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing

from p2pmesh.agent.ports import ClusterView, Inbox, Snapshot, ViewPublisher
from p2pmesh.agent.tasks import fetch
from p2pmesh.agent.tasks.peer_copy import ModelPlaces, PeerCopy
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, ModelInfo, Stage
from p2pmesh.core.node_io import Input, Mode, StageFilesFetched, Status, WorkerCrashed

ME, PEER = NodeId("me"), NodeId("peer")


def _state(model: str) -> ClusterState:
    return ClusterState(ClusterId("c1"), (), 1, (ME, PEER), (), placement_epoch=3, active_epoch=2,
                        model=ModelInfo(model, 2, 1, 1, 1, 1, 1), placement=(Stage(ME, 0, 1), Stage(PEER, 1, 2)))


def _publish(publisher: ViewPublisher, state: ClusterState, commit: int) -> None:
    status = Status(ME, 1, Mode.MEMBER, ClusterId("c1"), "follower", 1, PEER, commit, commit, True)
    assert publisher.publish(Snapshot(0, ME, status, state))


def _ports(tmp_path: Path, model: str) -> tuple[ViewPublisher, Inbox, PeerCopy, trio.MemoryReceiveChannel[Input]]:
    publisher = ViewPublisher(ME)
    _publish(publisher, _state(model), 5)
    send, receive = trio.open_memory_channel[Input](8)
    copier = PeerCopy(publisher.view, ModelPlaces(tmp_path / "state", tmp_path / "root"), ssl.create_default_context())
    return publisher, Inbox(send), copier, receive


@pytest.mark.trio
async def test_a_local_stage_is_reported_fetched_once(tmp_path: Path) -> None:
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    (tmp_path / "root" / "tiny" / "config.json").write_text("{}")
    publisher, inbox, copier, receive = _ports(tmp_path, "tiny")
    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch.fetch_loop, publisher.view, inbox, copier)
            assert await receive.receive() == StageFilesFetched(3)
            # A new committed state with the same pending epoch: looked at, not reported again.
            _publish(publisher, dataclasses.replace(_state("tiny"), kv=(("k", "v"),)), 6)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()
            # The next epoch is.
            _publish(publisher, dataclasses.replace(_state("tiny"), placement_epoch=4), 7)
            assert await receive.receive() == StageFilesFetched(4)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_loop_waits_for_a_change_instead_of_polling(tmp_path: Path) -> None:
    """Outside a cluster nothing is fetched; the committed placement, once published, is."""
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    (tmp_path / "root" / "tiny" / "config.json").write_text("{}")
    publisher = ViewPublisher(ME)
    send, receive = trio.open_memory_channel[Input](8)
    copier = PeerCopy(publisher.view, ModelPlaces(tmp_path / "state", tmp_path / "root"), ssl.create_default_context())
    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch.fetch_loop, publisher.view, Inbox(send), copier)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()
            _publish(publisher, _state("tiny"), 5)
            assert await receive.receive() == StageFilesFetched(3)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_stage_nobody_has_is_reported_broken_after_its_tries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "BACKOFF_S", (0.01, 0.02))
    monkeypatch.setattr(fetch, "FETCH_ATTEMPTS_MAX", 3)
    publisher, inbox, copier, receive = _ports(tmp_path, "./nowhere")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch.fetch_loop, publisher.view, inbox, copier)
            assert await receive.receive() == WorkerCrashed(3)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_view_wakes_waiters_only_for_a_new_snapshot() -> None:
    publisher = ViewPublisher(ME)
    view: ClusterView = publisher.view
    state = _state("tiny")
    _publish(publisher, state, 5)
    first = view.current
    # The same content again is no new version: nobody is woken for nothing.
    assert not publisher.publish(Snapshot(0, ME, first.status, state))
    assert view.current is first
    got: list[Snapshot] = []
    async with trio.open_nursery() as nursery:
        async def wait() -> None:
            got.append(await view.changed(first.version))
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        _publish(publisher, state, 6)
    assert got == [view.current] and got[0].version == first.version + 1 and got[0].status.commit_index == 6  # type: ignore[union-attr]
