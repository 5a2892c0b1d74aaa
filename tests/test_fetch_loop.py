"""p2pmesh/fetch.py's loop: it reports a stage's files once they are on disk, and a stage it
cannot get is reported broken after its bounded tries (so the leader restarts or re-plans
it rather than waiting for ever)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from p2pmesh import fetch
from p2pmesh.core.machine import Mode, StageFilesFetched, WorkerCrashed
from p2pmesh.core.messages import ModelInfo, Stage


def _agent(tmp_path: Path, model: str, send: trio.MemorySendChannel) -> SimpleNamespace:  # type: ignore[type-arg]
    state = SimpleNamespace(placement_epoch=3, active_epoch=2, fetched=(), model=ModelInfo(model, 2, 1, 1, 1, 1, 1),
                            placement=(Stage("me", 0, 1), Stage("peer", 1, 2)), ring=("me", "peer"), members=())
    machine = SimpleNamespace(raft=SimpleNamespace(state=state), mode=Mode.MEMBER, node_id="me", cluster="c1")
    config = SimpleNamespace(model_root=tmp_path / "root", state_dir=tmp_path / "state")
    return SimpleNamespace(machine=machine, config=config, inbox_send=send, identity=SimpleNamespace(node_id="me"),
                           copy_locks={})


@pytest.mark.trio
async def test_a_local_stage_is_reported_fetched_once(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    # A local directory is checked without threads, so the mock clock only ever jumps to the
    # loop's own polls: ten of them pass in no real time.
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    (tmp_path / "root" / "tiny" / "config.json").write_text("{}")
    send, receive = trio.open_memory_channel[object](8)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch.fetch_loop, _agent(tmp_path, "tiny", send))
            assert await receive.receive() == StageFilesFetched(3)
            await trio.sleep(10 * fetch.POLL_S)  # ten more polls: reported once per epoch
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_stage_nobody_has_is_reported_broken_after_its_tries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "BACKOFF_S", (0.01, 0.02))
    monkeypatch.setattr(fetch, "FETCH_ATTEMPTS_MAX", 3)
    send, receive = trio.open_memory_channel[object](8)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch.fetch_loop, _agent(tmp_path, "./nowhere", send))
            assert await receive.receive() == WorkerCrashed(3)
            nursery.cancel_scope.cancel()
