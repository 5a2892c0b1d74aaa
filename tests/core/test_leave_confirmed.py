"""A graceful leave ends, confirmed, only once the cluster committed the removal: the chaos
tool (scripts/chaos.py) takes a confirmed leave as an acknowledged write, after which no
linearizable read may list the incarnation that left (Machine.leave_confirmed)."""
from __future__ import annotations

from p2pmesh.core.machine import LeaveRequested
from p2pmesh.core.messages import RemoveMember
from tests.core.test_machine import a_follower, formed, leader_of


def _removal_index(entries: list, node: str, inc: int) -> int | None:  # type: ignore[type-arg]
    for e in entries:
        if isinstance(e.command, RemoveMember) and e.command.node_id == node and e.command.inc == inc:
            return e.index
    return None


def test_a_leaver_stops_only_after_its_removal_is_committed() -> None:
    d, _ = formed(3)
    f = a_follower(d)
    leader = leader_of(d)
    node, inc = f.node_id, f.inc
    seen: list[tuple[int | None, int]] = []
    process = d._process

    def watch(who, ready):  # type: ignore[no-untyped-def]
        if who == node and ready.left:
            r = leader.raft
            assert r is not None
            seen.append((_removal_index(r.log.entries, node, inc), r.commit))
        process(who, ready)

    d._process = watch  # type: ignore[method-assign]
    d.handle(node, LeaveRequested())
    assert d.run_until(lambda: node not in d.machines, d.settings.leave_timeout_ms + 1_000)
    assert len(seen) == 1
    index, commit = seen[0]
    assert index is not None and index <= commit, f"left with removal at {index} but the leader's commit at {commit}"
    assert f.leave_confirmed


def test_a_leave_nobody_confirms_is_reported_unconfirmed() -> None:
    d, ids = formed(3)
    f = a_follower(d)
    d.cut.update(ids)  # nobody hears anybody: no leader can confirm
    d.handle(f.node_id, LeaveRequested())
    assert d.run_until(lambda: f.node_id not in d.machines, d.settings.leave_timeout_ms + 1_000)
    assert not f.leave_confirmed
    kinds = [e.kind for fx in d.effects[f.node_id] for e in fx.events]
    assert "leave not confirmed" in kinds
