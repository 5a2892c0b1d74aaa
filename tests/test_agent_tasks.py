"""The agent's tasks driven through real ports (agent/ports.py), with no agent and no core:
the test publishes committed states to a ClusterView and reads what the task puts into the
Inbox. Each task wakes on a new snapshot, not on a timer."""
from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio
import trio.testing

from p2pmesh.agent.models import ModelError
from p2pmesh.agent.ports import Inbox, Snapshot, ViewPublisher
from p2pmesh.agent.tasks import links, measure
from p2pmesh.agent.tasks.peer_copy import ModelPlaces, PeerCopy
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, Measure, ModelInfo
from p2pmesh.core.node_io import Input, Mode, ModelMeasured, Status

ME = NodeId("me")


def _publish(publisher: ViewPublisher, commit: int, model: str | None, ring_epoch: int = 1) -> None:
    info = ModelInfo(model, 2, 1, 1, 1, 1, 1) if model is not None else None
    state = ClusterState(ClusterId("c1"), (), ring_epoch, (ME,), (), model=info)
    status = Status(ME, 1, Mode.MEMBER, ClusterId("c1"), "standalone", 1, ME, commit, commit, True)
    assert publisher.publish(Snapshot(0, ME, status, state))


@pytest.mark.trio
async def test_the_committed_model_is_measured_once_and_the_offer_capped(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    async def fake_measure(copier: PeerCopy, name: str) -> Measure:
        measured.append(name)
        return Measure(name, 64 << 30, 2.5, 0.5)

    monkeypatch.setattr(measure, "_measure", fake_measure)
    publisher = ViewPublisher(ME)
    send, receive = trio.open_memory_channel[Input](8)
    copier = PeerCopy(publisher.view, ModelPlaces(tmp_path), ssl.create_default_context())
    config = measure.MeasureConfig(memory_limit_bytes=8 << 30)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(measure.measure_loop, publisher.view, Inbox(send), copier, config)
            await trio.testing.wait_all_tasks_blocked()
            assert measured == []  # no model committed: nothing to do, and no timer running
            _publish(publisher, 3, "tiny")
            assert await receive.receive() == ModelMeasured(Measure("tiny", 8 << 30, 2.5, 0.5))
            _publish(publisher, 4, "tiny")  # another entry, the same model: not measured again
            await trio.testing.wait_all_tasks_blocked()
            assert measured == ["tiny"]
            _publish(publisher, 5, "other")
            assert await receive.receive() == ModelMeasured(Measure("other", 8 << 30, 2.5, 0.5))
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_layer_time_set_by_the_user_keeps_the_measured_fixed_share(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_measure(copier: PeerCopy, name: str) -> Measure:
        return Measure(name, 64 << 30, 2.5, 0.5)

    monkeypatch.setattr(measure, "_measure", fake_measure)
    publisher = ViewPublisher(ME)
    send, receive = trio.open_memory_channel[Input](8)
    copier = PeerCopy(publisher.view, ModelPlaces(tmp_path), ssl.create_default_context())
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(measure.measure_loop, publisher.view, Inbox(send), copier, measure.MeasureConfig(layer_ms=1.0))
            _publish(publisher, 3, "tiny")
            assert await receive.receive() == ModelMeasured(Measure("tiny", 64 << 30, 1.0, 0.2))
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("line, fixed", [
    (b'{"layer_ms": 2.0, "layer_fixed_ms": 0.5, "memory_bytes": 10}', 0.5),
    (b'{"layer_ms": 2.0, "memory_bytes": 10}', 0.0),  # a worker that does not measure it
    (b'{"layer_ms": 2.0, "layer_fixed_ms": 3.0, "memory_bytes": 10}', 2.0),
    (b'{"layer_ms": 2.0, "layer_fixed_ms": -1, "memory_bytes": 10}', 0.0),
    (b'{"layer_ms": 2.0, "layer_fixed_ms": NaN, "memory_bytes": 10}', 0.0),
])
def test_the_measuring_worker_s_line_is_parsed_with_its_fixed_part(line: bytes, fixed: float) -> None:
    assert measure.parse_measure("m", b"log line\n" + line + b"\n") == Measure("m", 10, 2.0, fixed)


@pytest.mark.parametrize("out", [b"", b"not json", b'{"layer_ms": 2.0}', b'{"layer_ms": "x", "memory_bytes": 1}', b"[1]"])
def test_a_measuring_worker_without_a_result_is_a_model_error(out: bytes) -> None:
    with pytest.raises(ModelError, match="printed no result"):
        measure.parse_measure("m", out)


@pytest.mark.trio
async def test_ring_tasks_run_once_per_committed_ring_epoch() -> None:
    publisher = ViewPublisher(ME)
    epochs: list[int] = []

    async def follow() -> None:
        async for _, state in links._ring_epochs(publisher.view):
            epochs.append(state.ring_epoch)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow)
            _publish(publisher, 1, None, ring_epoch=1)
            await trio.testing.wait_all_tasks_blocked()
            _publish(publisher, 2, None, ring_epoch=1)
            await trio.testing.wait_all_tasks_blocked()
            _publish(publisher, 3, None, ring_epoch=2)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert epochs == [1, 2]


@pytest.mark.trio
async def test_a_full_inbox_is_reported_not_raised() -> None:
    send, receive = trio.open_memory_channel[Input](1)
    inbox = Inbox(send)
    status_free = inbox.put_nowait(ModelMeasured(Measure("a", 1, 1.0)))
    assert status_free and not inbox.put_nowait(ModelMeasured(Measure("b", 1, 1.0)))
    assert receive.receive_nowait() == ModelMeasured(Measure("a", 1, 1.0))
