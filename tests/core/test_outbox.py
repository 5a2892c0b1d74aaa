"""The Ready/advance handshake (core/outbox.py): a Ready carries consensus output only, its
Effects come from ``advance`` once the driver made it durable, the core records what is on
disk (``Status.durable_index``), and a driver that breaks the order gets a typed error."""
from __future__ import annotations

import random

import pytest

from p2pmesh.core.errors import LocalProtocolError
from p2pmesh.core.machine import Machine, PeerDiscovered, Ready, TimerFired
from p2pmesh.core.node_io import NO_EFFECTS
from p2pmesh.core.outbox import ReadyCode, ReadyError
from p2pmesh.core.settings import Settings
from tests.core.test_machine import a_follower, formed, node_ids

S = Settings()


def _pipelined_formation() -> tuple[Machine, Ready, Ready, Ready]:
    """A lone node, none of its Readies advanced: its boot (hard state), a Hello to a peer it
    discovered (messages only), and the founding of its one-member cluster (hard state,
    snapshot, log)."""
    me, other = node_ids(2)
    m, booted = Machine.boot(node_id=me, persisted=None, settings=S, rng=random.Random(1), now_ms=0, pipelined=True)
    hello = m.handle(PeerDiscovered(other, ("10.0.0.2",)), 1)
    founded = m.handle(TimerFired(), S.formation_wait_ms + 10)
    assert booted.durable_part() and not hello.durable_part() and hello.messages
    assert founded.log_entries and m.status().role == "standalone"
    return m, booted, hello, founded


def test_a_strict_driver_must_advance_before_the_next_input() -> None:
    m, ready = Machine.boot(node_id=node_ids(1)[0], persisted=None, settings=S, rng=random.Random(2), now_ms=0)
    with pytest.raises(ReadyError) as caught:
        m.handle(TimerFired(), 1)
    assert caught.value.code is ReadyCode.NOT_ADVANCED and caught.value.code == "ready_not_advanced"
    assert isinstance(caught.value, LocalProtocolError)  # the driver's bug, not a peer's
    assert m.now_ms == 0  # refused before the input touched anything
    assert m.advance(ready) == NO_EFFECTS  # a fresh node's first Ready: its hard state only
    m.handle(TimerFired(), 1)


def test_advancing_twice_or_a_stranger_is_refused_and_an_empty_ready_is_free() -> None:
    m, ready = Machine.boot(node_id=node_ids(1)[0], persisted=None, settings=S, rng=random.Random(3), now_ms=0)
    m.advance(ready)
    with pytest.raises(ReadyError) as twice:
        m.advance(ready)
    assert twice.value.code is ReadyCode.UNKNOWN
    other, theirs = Machine.boot(node_id=node_ids(2)[1], persisted=None, settings=S, rng=random.Random(4), now_ms=0)
    with pytest.raises(ReadyError) as stranger:
        m.advance(theirs)
    assert stranger.value.code is ReadyCode.UNKNOWN
    assert m.advance(Ready()) == NO_EFFECTS  # nothing to record, nothing held
    other.advance(theirs)


def test_effects_come_from_advance_and_the_ready_has_none() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    node = f.node_id
    d.crash(node)
    m, ready = Machine.boot(node_id=node, persisted=d.disks[node].load(), settings=S, rng=random.Random(5), now_ms=d.now)
    assert not hasattr(ready, "events") and not hasattr(ready, "submits") and not hasattr(ready, "client")
    effects = m.advance(ready)
    assert [e.kind for e in effects.events] == ["restarted"]
    assert effects.submits == () and effects.client == ()


def test_durable_index_follows_what_the_driver_saved() -> None:
    d, ids = formed(3)
    for node in ids:
        m = d.machines[node]
        assert m.raft is not None and m.status().durable_index == m.raft.log.last_index > 0
    m, booted, hello, founded = _pipelined_formation()
    assert m.raft is not None
    # The one-member cluster has committed its founding entries; none of them is on disk.
    assert m.status().commit_index == m.raft.log.last_index and m.status().durable_index == 0
    m.advance(booted)
    m.advance(hello)
    assert m.status().durable_index == 0
    effects = m.advance(founded)
    assert m.status().durable_index == founded.log_entries[-1].index == m.raft.log.last_index
    assert "cluster formed" in [e.kind for e in effects.events]


def test_a_pipelined_driver_advances_durable_readies_in_order() -> None:
    m, booted, hello, founded = _pipelined_formation()
    before = m.effects_of(founded)
    with pytest.raises(ReadyError) as caught:
        m.advance(founded)  # its durable part was written after the boot's
    assert caught.value.code is ReadyCode.OUT_OF_ORDER
    assert m.effects_of(founded) == before and m.status().durable_index == 0  # nothing released
    assert m.advance(hello) == NO_EFFECTS  # messages only: nothing of it waits for the disk
    m.advance(booted)
    assert m.advance(founded) == before
    with pytest.raises(ReadyError):
        m.advance(founded)
