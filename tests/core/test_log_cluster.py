"""RaftLog bookkeeping and the pure functions of cluster.py."""
from __future__ import annotations

import dataclasses
from unittest.mock import patch

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pmesh.core.cluster import (
    KV_KEYS_MAX,
    _replace,
    apply_command,
    apply_config_command,
    config_of,
    empty_state,
    find_member,
)
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.log import RaftLog
from p2pmesh.core.validate import problem
from p2pmesh.core.messages import (
    AddLearner,
    Capabilities,
    ClusterState,
    Command,
    Config,
    Entry,
    Header,
    InstallSnapshot,
    MarkDown,
    MarkUp,
    Member,
    Noop,
    Peer,
    Promote,
    Put,
    RemoveMember,
    SetRing,
    Snapshot,
    UpdateMember,
)

CL = ClusterId("c1")
CAPS = Capabilities(2**35, "M3 Ultra")
A, B, C = NodeId("a" * 32), NodeId("b" * 32), NodeId("c" * 32)
PA, PB, PC = Peer(A, 1), Peer(B, 2), Peer(C, 3)
EMPTY_CFG = Config((), ())


def base(index: int = 0, term: int = 0, config: Config = EMPTY_CFG) -> Snapshot:
    return Snapshot(index, term, config, empty_state(CL))


def add(p: Peer) -> AddLearner:
    return AddLearner(p.node_id, p.inc, (f"addr-{p.node_id[0]}",), CAPS)


def founder_entries() -> list[Entry]:
    """A, B and C added and promoted in term 1 (indices 1-6), then two puts in term 2."""
    return [
        Entry(1, 1, add(PA)),
        Entry(2, 1, Promote(A, 1)),
        Entry(3, 1, add(PB)),
        Entry(4, 1, Promote(B, 2)),
        Entry(5, 1, add(PC)),
        Entry(6, 1, Promote(C, 3)),
        Entry(7, 2, Put("x", "1")),
        Entry(8, 2, Put("y", "2")),
    ]


# --------------------------------------------------------------------------------------
# RaftLog


def test_empty_log() -> None:
    log = RaftLog(base())
    assert log.first_index == 1
    assert log.last_index == 0
    assert log.last_term == 0
    assert log.term_at(0) == 0
    assert log.term_at(1) is None
    assert log.config() == EMPTY_CFG
    assert log.last_config_index() == 0
    assert log.slice(1, 10) == ()


def test_append_and_term_at() -> None:
    log = RaftLog(base())
    for e in founder_entries():
        log.append(e)
    assert log.last_index == 8
    assert log.last_term == 2
    assert [log.term_at(i) for i in range(0, 10)] == [0, 1, 1, 1, 1, 1, 1, 2, 2, None]
    assert log.term_at(-1) is None
    assert log.entry(7) == Entry(7, 2, Put("x", "1"))
    assert log.slice(3, 2) == tuple(founder_entries()[2:4])
    assert log.slice(7, 100) == tuple(founder_entries()[6:])


def test_append_must_be_contiguous() -> None:
    log = RaftLog(base())
    log.append(Entry(1, 1, Noop()))
    with pytest.raises(AssertionError):
        log.append(Entry(3, 1, Noop()))
    with pytest.raises(AssertionError):
        log.append(Entry(1, 1, Noop()))
    assert log.last_index == 1


def test_config_takes_effect_on_append() -> None:
    log = RaftLog(base())
    log.append(Entry(1, 1, add(PA)))
    assert log.config() == Config((), (PA,))
    log.append(Entry(2, 1, Promote(A, 1)))
    assert log.config() == Config((PA,), ())
    log.append(Entry(3, 1, Put("k", "v")))
    assert log.config() == Config((PA,), ())
    assert log.last_config_index() == 2


def test_constructor_entries_build_the_same_configs_as_appends() -> None:
    entries = founder_entries()
    built = RaftLog(base(), entries)
    appended = RaftLog(base())
    for e in entries:
        appended.append(e)
    assert built.entries == appended.entries
    for i in range(0, 9):
        assert built.config_at(i) == appended.config_at(i)
    assert built.config() == Config((PA, PB, PC), ())
    assert built.last_config_index() == 6


def test_config_at_each_index() -> None:
    log = RaftLog(base(), founder_entries())
    assert log.config_at(0) == EMPTY_CFG
    assert log.config_at(1) == Config((), (PA,))
    assert log.config_at(2) == Config((PA,), ())
    assert log.config_at(3) == Config((PA,), (PB,))
    assert log.config_at(4) == Config((PA, PB), ())
    assert log.config_at(5) == Config((PA, PB), (PC,))
    assert log.config_at(6) == Config((PA, PB, PC), ())
    assert log.config_at(8) == Config((PA, PB, PC), ())
    assert log.config_at(1000) == log.config()


def test_truncate_from_rolls_back_configs() -> None:
    log = RaftLog(base(), founder_entries())
    log.truncate_from(5)
    assert log.last_index == 4
    assert log.last_term == 1
    assert log.config() == Config((PA, PB), ())
    assert log.last_config_index() == 4
    assert log.term_at(5) is None
    # A different suffix can then be appended, with its own config history.
    log.append(Entry(5, 3, RemoveMember(B, 2, "gone")))
    assert log.config() == Config((PA,), ())
    log.truncate_from(5)
    assert log.config() == Config((PA, PB), ())
    log.truncate_from(1)
    assert log.config() == EMPTY_CFG
    assert log.last_index == 0
    assert log.last_config_index() == 0


def test_truncate_keeps_configs_before_the_cut() -> None:
    log = RaftLog(base(), founder_entries())
    log.truncate_from(7)  # only puts removed
    assert log.config() == Config((PA, PB, PC), ())
    assert log.last_config_index() == 6
    assert log.last_index == 6


def test_truncate_never_below_the_snapshot() -> None:
    log = RaftLog(base(), founder_entries())
    log.compact(Snapshot(4, 1, log.config_at(4), empty_state(CL)))
    with pytest.raises(AssertionError):
        log.truncate_from(4)
    log.truncate_from(5)
    assert log.last_index == 4
    assert log.config() == Config((PA, PB), ())


def test_compact_keeps_later_entries_and_configs() -> None:
    entries = founder_entries()
    log = RaftLog(base(), entries)
    snap = Snapshot(4, 1, log.config_at(4), empty_state(CL))
    log.compact(snap)
    assert log.snapshot == snap
    assert log.first_index == 5
    assert log.last_index == 8
    assert log.entries == entries[4:]
    assert log.term_at(4) == 1  # the snapshot's own term
    assert log.term_at(3) is None  # compacted away
    assert log.term_at(5) == 1
    assert log.entry(5) == entries[4]
    assert log.slice(5, 2) == tuple(entries[4:6])
    # Configs after the snapshot survive; before it the snapshot's config answers.
    assert log.config_at(4) == Config((PA, PB), ())
    assert log.config_at(5) == Config((PA, PB), (PC,))
    assert log.config() == Config((PA, PB, PC), ())
    assert log.last_config_index() == 6


def test_compact_everything() -> None:
    log = RaftLog(base(), founder_entries())
    snap = Snapshot(8, 2, log.config_at(8), empty_state(CL))
    log.compact(snap)
    assert log.entries == []
    assert log.last_index == 8
    assert log.last_term == 2
    assert log.config() == Config((PA, PB, PC), ())
    assert log.last_config_index() == 8  # no config entry left: the snapshot's index
    log.append(Entry(9, 3, Noop()))
    assert log.last_index == 9 and log.term_at(9) == 3


def test_compact_twice_and_bounds() -> None:
    log = RaftLog(base(), founder_entries())
    log.compact(Snapshot(3, 1, log.config_at(3), empty_state(CL)))
    log.compact(Snapshot(6, 1, log.config_at(6), empty_state(CL)))
    assert log.first_index == 7
    assert [e.index for e in log.entries] == [7, 8]
    with pytest.raises(AssertionError):
        log.compact(Snapshot(6, 1, log.config_at(6), empty_state(CL)))  # not beyond the current one
    with pytest.raises(AssertionError):
        log.compact(Snapshot(9, 2, log.config(), empty_state(CL)))  # an index we do not hold


def test_log_built_on_a_snapshot() -> None:
    cfg = Config((PA, PB), ())
    log = RaftLog(base(10, 4, cfg), [Entry(11, 4, Noop()), Entry(12, 5, add(PC))])
    assert log.first_index == 11
    assert log.last_index == 12
    assert log.term_at(10) == 4
    assert log.term_at(9) is None
    assert log.config_at(10) == cfg
    assert log.config_at(11) == cfg
    assert log.config_at(12) == Config((PA, PB), (PC,))


def test_reset_replaces_everything() -> None:
    log = RaftLog(base(), founder_entries())
    snap = Snapshot(20, 7, Config((PC,), ()), empty_state(CL))
    log.reset(snap)
    assert log.entries == []
    assert log.first_index == 21
    assert log.last_index == 20
    assert log.last_term == 7
    assert log.config() == Config((PC,), ())
    assert log.last_config_index() == 20


@pytest.mark.parametrize(
    ("last_index", "last_term", "expected"),
    [
        (8, 2, True),  # identical
        (9, 2, True),  # longer, same term
        (7, 2, False),  # shorter, same term
        (1, 3, True),  # higher last term wins whatever the length
        (100, 1, False),  # lower last term loses whatever the length
        (0, 0, False),
    ],
)
def test_is_up_to_date(last_index: int, last_term: int, expected: bool) -> None:
    log = RaftLog(base(), founder_entries())
    assert log.is_up_to_date(last_index, last_term) is expected


# --------------------------------------------------------------------------------------
# apply_config_command


def test_add_learner_then_promote_then_remove() -> None:
    cfg = apply_config_command(EMPTY_CFG, add(PB))
    assert cfg == Config((), (PB,))
    cfg = apply_config_command(cfg, add(PA))
    assert cfg == Config((), (PA, PB))  # sorted by node id
    cfg = apply_config_command(cfg, Promote(B, 2))
    assert cfg == Config((PB,), (PA,))
    cfg = apply_config_command(cfg, RemoveMember(B, 2, "x"))
    assert cfg == Config((), (PA,))
    cfg = apply_config_command(cfg, RemoveMember(A, 1, "x"))
    assert cfg == EMPTY_CFG


def test_promote_of_unknown_peer_is_a_noop() -> None:
    cfg = Config((PA,), ())
    assert apply_config_command(cfg, Promote(B, 2)) == cfg
    # A different incarnation of a learner is not that learner.
    cfg = Config((PA,), (PB,))
    assert apply_config_command(cfg, Promote(B, 99)) == cfg


def test_promote_of_a_voter_keeps_it_a_voter_once() -> None:
    cfg = Config((PA, PB), ())
    assert apply_config_command(cfg, Promote(A, 1)) == cfg


def test_remove_needs_the_right_incarnation() -> None:
    cfg = Config((PA, PB), (PC,))
    assert apply_config_command(cfg, RemoveMember(A, 999, "stale")) == cfg
    assert apply_config_command(cfg, RemoveMember(C, 3, "x")) == Config((PA, PB), ())


def test_add_learner_of_a_new_incarnation_keeps_the_old_one() -> None:
    # The configuration is about (node, incarnation) pairs: the machine removes the old one.
    cfg = Config((PA,), ())
    cfg = apply_config_command(cfg, AddLearner(A, 5, (), CAPS))
    assert cfg == Config((PA,), (Peer(A, 5),))


def test_add_learner_of_an_existing_learner_is_idempotent() -> None:
    cfg = Config((PA,), (PB,))
    assert apply_config_command(cfg, add(PB)) == cfg


def test_add_learner_of_an_existing_voter_does_not_drop_it() -> None:
    cfg = Config((PA, PB), ())
    after = apply_config_command(cfg, add(PA))
    assert PA in after.voters or PA in after.learners


def test_config_results_are_sorted_and_deduplicated() -> None:
    cfg = Config((), ())
    for p in (PC, PA, PB, PA):
        cfg = apply_config_command(cfg, add(p))
    assert cfg.learners == (PA, PB, PC)
    for p in (PC, PA, PB, PC):
        cfg = apply_config_command(cfg, Promote(p.node_id, p.inc))
    assert cfg.voters == (PA, PB, PC)
    assert cfg.learners == ()


# --------------------------------------------------------------------------------------
# apply_command


def replay(commands: list[Command], state: ClusterState | None = None) -> ClusterState:
    state = state or empty_state(CL)
    for cmd in commands:
        state = apply_command(state, cmd)
    return state


def test_empty_state() -> None:
    s = empty_state(CL)
    assert s == ClusterState(CL, (), 0, (), ())


def test_noop_leaves_state_unchanged() -> None:
    s = replay([add(PA)])
    assert apply_command(s, Noop()) is s


def test_members_lifecycle() -> None:
    s = replay([add(PB), add(PA)])
    assert [m.node_id for m in s.members] == [A, B]  # sorted
    a = find_member(s, A)
    assert a == Member(A, 1, voter=False, up=True, addresses=("addr-a",), caps=CAPS)
    s = apply_command(s, Promote(A, 1))
    assert find_member(s, A).voter is True  # type: ignore[union-attr]
    s = apply_command(s, MarkDown(A, 1))
    assert find_member(s, A).up is False  # type: ignore[union-attr]
    s = apply_command(s, MarkUp(A, 1))
    assert find_member(s, A).up is True  # type: ignore[union-attr]
    new_caps = Capabilities(1, "M4 Pro")
    s = apply_command(s, UpdateMember(A, 1, ("10.1.1.1",), new_caps))
    a = find_member(s, A)
    assert a is not None and a.addresses == ("10.1.1.1",) and a.caps == new_caps and a.voter and a.up
    s = apply_command(s, RemoveMember(A, 1, "left"))
    assert find_member(s, A) is None
    assert [m.node_id for m in s.members] == [B]
    assert config_of(s) == Config((), (PB,))


def test_commands_for_a_stale_incarnation_change_nothing() -> None:
    s = replay([add(PA), Promote(A, 1)])
    for cmd in (Promote(A, 2), MarkDown(A, 2), MarkUp(A, 2), UpdateMember(A, 2, (), CAPS), RemoveMember(A, 2, "x")):
        assert apply_command(s, cmd) == s
    # and for members that do not exist
    for cmd in (Promote(C, 3), MarkDown(C, 3), RemoveMember(C, 3, "x")):
        assert apply_command(s, cmd) == s


def test_add_learner_replaces_an_older_incarnation() -> None:
    s = replay([add(PA), Promote(A, 1)])
    s = apply_command(s, AddLearner(A, 9, ("new",), CAPS))
    assert s.members == (Member(A, 9, False, True, ("new",), CAPS),)


def test_remove_member_drops_it_from_the_ring() -> None:
    s = replay([add(PA), add(PB), SetRing(3, (A, B))])
    assert (s.ring_epoch, s.ring) == (3, (A, B))
    s = apply_command(s, RemoveMember(A, 1, "x"))
    assert s.ring == (B,)
    assert s.ring_epoch == 3


def test_put_and_overwrite_are_sorted() -> None:
    s = replay([Put("b", "1"), Put("a", "2"), Put("b", "3")])
    assert s.kv == (("a", "2"), ("b", "3"))


def test_put_respects_the_key_limit_but_allows_overwrites() -> None:
    s = empty_state(CL)
    s = ClusterState(CL, (), 0, (), tuple((f"k{i:05d}", "v") for i in range(KV_KEYS_MAX)))
    full = apply_command(s, Put("new", "v"))
    assert full == s
    updated = apply_command(s, Put("k00000", "w"))
    assert dict(updated.kv)["k00000"] == "w"
    assert len(updated.kv) == KV_KEYS_MAX


@given(st.lists(st.tuples(st.sampled_from(["", "a", "b", "k1", "k10", "k2", "é", "z"]), st.text(max_size=3)), max_size=40),
       st.integers(1, 6))
def test_puts_keep_the_keys_sorted_and_unique_as_a_dict_would(puts: list[tuple[str, str]], limit: int) -> None:
    # apply_command inserts by binary search; the reference is a dict sorted afterwards.
    s, want = empty_state(CL), {}
    with patch("p2pmesh.core.cluster.KV_KEYS_MAX", limit):
        for key, value in puts:
            s = apply_command(s, Put(key, value))
            if key in want or len(want) < limit:
                want[key] = value
            assert s.kv == tuple(sorted(want.items()))


def test_a_snapshot_whose_keys_are_not_sorted_and_unique_is_refused() -> None:
    def snap(kv: tuple[tuple[str, str], ...]) -> InstallSnapshot:
        state = ClusterState(CL, (), 0, (), kv)
        return InstallSnapshot(Header(CL, A, 1, B, 1, 2), Snapshot(5, 2, EMPTY_CFG, state))

    assert problem(snap((("a", "1"), ("b", "2")))) is None
    assert problem(snap((("b", "1"), ("a", "2")))) == "snapshot keys are not sorted and unique"
    assert problem(snap((("a", "1"), ("a", "2")))) == "snapshot keys are not sorted and unique"


def test_fast_replace_matches_dataclasses_replace_and_refuses_unknown_fields() -> None:
    state = ClusterState(CL, (Member(A, 1, voter=True, up=True, addresses=("10.0.0.1",), caps=CAPS),), 3, (A,), (("k", "v"),))
    assert _replace(state, kv=(), ring_epoch=4) == dataclasses.replace(state, kv=(), ring_epoch=4)
    member = state.members[0]
    assert _replace(member, up=False) == dataclasses.replace(member, up=False) and member.up
    with pytest.raises(TypeError, match="no field"):
        _replace(state, voters=())


def test_config_of_state_matches_log_config_for_the_same_commands() -> None:
    entries = founder_entries()
    log = RaftLog(base(), entries)
    state = replay([e.command for e in entries])
    assert config_of(state) == log.config()
    assert dict(state.kv) == {"x": "1", "y": "2"}


def test_apply_command_is_pure() -> None:
    s = replay([add(PA)])
    before = s
    apply_command(s, Put("k", "v"))
    apply_command(s, RemoveMember(A, 1, "x"))
    assert s == before
    assert s.kv == ()
    assert len(s.members) == 1


def test_apply_unknown_command_is_an_assertion() -> None:
    with pytest.raises(AssertionError):
        apply_command(empty_state(CL), "not a command")  # type: ignore[arg-type]
