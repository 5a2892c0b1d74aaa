"""A member's committed addresses follow the Mac (AddressesChanged -> UpdateMember): peers
dial, and LAN hops of the MLX hostfile use, the committed addresses, so a Mac that moved
to another address must not be left behind at the old one. They were fixed at join."""
from __future__ import annotations

from p2pmesh.core.cluster import find_member
from p2pmesh.core.machine import AddressesChanged
from p2pmesh.core.messages import UpdateMember
from p2pmesh.core.validate import ADDRESSES_MAX, command_problem, forwarded_problem
from tests.core.test_machine import a_follower, formed, leader_of


def _committed(d, node):  # type: ignore[no-untyped-def]
    m = find_member(leader_of(d).raft.state, node)  # type: ignore[union-attr]
    assert m is not None
    return m.addresses


def test_a_follower_that_moved_is_committed_at_its_new_address() -> None:
    d, ids = formed(3)
    moved = a_follower(d)
    assert _committed(d, moved.node_id) == moved.facts.addresses
    new = ("192.168.7.20:7741", "[fe80::1%en0]:7741")
    d.handle(moved.node_id, AddressesChanged(new))
    assert d.run_until(lambda: all(find_member(m.raft.state, moved.node_id).addresses == new  # type: ignore[union-attr]
                                   for m in d.machines.values()), 3_000)
    assert find_member(leader_of(d).raft.state, moved.node_id).inc == moved.inc  # type: ignore[union-attr]  # same member


def test_the_leader_publishes_its_own_move_and_an_unchanged_list_proposes_nothing() -> None:
    d, ids = formed(3)
    leader = leader_of(d)
    applied = leader.raft.applied  # type: ignore[union-attr]
    d.handle(leader.node_id, AddressesChanged(leader.facts.addresses))  # the same: nothing to publish
    d.run(500)
    assert not any(isinstance(e.command, UpdateMember) for e in leader.raft.log.entries if e.index > applied)  # type: ignore[union-attr]
    d.handle(leader.node_id, AddressesChanged(("10.9.9.9:7741",)))
    assert d.run_until(lambda: _committed(d, leader.node_id) == ("10.9.9.9:7741",), 3_000)


def test_an_address_list_is_bounded_and_only_a_member_itself_may_move_itself() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    d.handle(f.node_id, AddressesChanged(tuple(f"10.0.{i}.1:7741" for i in range(ADDRESSES_MAX + 10))))
    assert d.run_until(lambda: len(_committed(d, f.node_id)) == ADDRESSES_MAX, 3_000)
    cmd = UpdateMember(f.node_id, f.inc, ("10.1.1.1:7741",), f.facts.caps)
    assert forwarded_problem(cmd, f.node_id) is None
    assert forwarded_problem(cmd, ids[0] if ids[0] != f.node_id else ids[1]) == "a member may only speak for itself"
    assert command_problem(UpdateMember(f.node_id, f.inc, ("x" * 300,), f.facts.caps)) is not None


def test_a_member_restarted_with_another_data_port_is_committed_with_it() -> None:
    """Its incarnation (and so its member record) survives a restart; the data port it
    advertises must follow, since every member renders its ranks at that port."""
    from dataclasses import replace

    d, ids = formed(3)
    f = a_follower(d)
    f.facts.caps = replace(f.facts.caps, data_port=47150)  # what Machine.boot sets from the new --data-port
    assert d.run_until(lambda: all(find_member(m.raft.state, f.node_id).caps.data_port == 47150  # type: ignore[union-attr]
                                   for m in d.machines.values()), 3_000)
    assert _committed(d, f.node_id) == f.facts.addresses  # the addresses are kept as they were
    assert command_problem(UpdateMember(f.node_id, f.inc, f.facts.addresses, replace(f.facts.caps, data_port=70000))) is not None
