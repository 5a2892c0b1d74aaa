"""The chaos history checkers (sim/linearizability.py, sim/history.py) on hand-made
histories: each invariant passes a correct history and fails the smallest violating one."""
from __future__ import annotations

from sim.history import EndState, History, check_log, judge
from sim.linearizability import check_reads
from sim.observations import Ack, LogSample, MemberView, ReadOp

A, B, C = ("a" * 32, 1, True, True), ("b" * 32, 2, True, True), ("c" * 32, 3, True, True)
ONE = frozenset({A, B, C})
TWO = frozenset({A, B})


def read(host: int, invoke: float, complete: float, index: int, members: frozenset = ONE, cluster: str = "k1") -> ReadOp:  # type: ignore[type-arg]
    return ReadOp(host, invoke, complete, view=MemberView(cluster, index, members))


def names(violations: list) -> list[str]:  # type: ignore[type-arg]
    return sorted({v.invariant for v in violations})


def test_reads_in_real_time_order_pass() -> None:
    reads = [read(0, 0.0, 1.0, 5), read(1, 1.5, 2.0, 5), read(2, 2.5, 3.0, 7)]
    assert check_reads(reads, []) == []


def test_a_read_older_than_one_completed_before_it_is_stale() -> None:
    reads = [read(0, 0.0, 1.0, 7), read(1, 1.5, 2.0, 5)]
    assert names(check_reads(reads, [])) == ["read-stale"]


def test_concurrent_reads_may_answer_in_either_order() -> None:
    # The second read began before the first completed: either order is linearizable.
    reads = [read(0, 0.0, 2.0, 7), read(1, 1.0, 3.0, 5)]
    assert check_reads(reads, []) == []


def test_an_event_at_the_very_instant_a_read_began_does_not_bind_it() -> None:
    reads = [read(0, 0.0, 1.0, 7), read(1, 1.0, 2.0, 5)]
    assert check_reads(reads, []) == []


def test_a_read_older_than_a_commit_acknowledged_before_it_is_stale() -> None:
    reads = [read(1, 3.0, 3.5, 5)]
    assert names(check_reads(reads, [Ack(2.0, "k1", 6)])) == ["read-stale"]
    assert check_reads(reads, [Ack(3.2, "k1", 6)]) == []  # acknowledged while it ran: fine


def test_a_log_sample_binds_later_reads_like_an_acknowledgement() -> None:
    reads = [read(1, 3.0, 3.5, 5)]
    sample = LogSample(2.0, 0, 100, "k1", 9, commit=8)
    assert names(check_reads(reads, [], [sample])) == ["read-stale"]


def test_reads_of_another_cluster_are_another_register() -> None:
    reads = [read(0, 0.0, 1.0, 40), read(1, 2.0, 2.5, 3, cluster="standalone")]
    assert check_reads(reads, []) == []


def test_two_memberships_at_one_index_diverge() -> None:
    reads = [read(0, 0.0, 1.0, 5, ONE), read(1, 0.0, 1.0, 5, TWO)]
    assert names(check_reads(reads, [])) == ["read-divergent"]


def test_a_member_listed_after_its_confirmed_leave_is_a_violation() -> None:
    ack = Ack(2.0, "k1", 0, ("c" * 32, 3))
    assert names(check_reads([read(0, 2.5, 3.0, 9, ONE)], [ack])) == ["read-sees-removed"]
    assert check_reads([read(0, 2.5, 3.0, 9, TWO)], [ack]) == []
    assert check_reads([read(0, 1.5, 3.0, 9, ONE)], [ack]) == []  # began before the leave ended
    rejoined = frozenset({A, B, ("c" * 32, 4, False, True)})  # the same Mac, a new incarnation
    assert check_reads([read(0, 2.5, 3.0, 12, rejoined)], [ack]) == []


def test_failed_reads_are_not_judged_by_value() -> None:
    reads = [read(0, 0.0, 1.0, 7), ReadOp(1, 1.5, 2.0, error="no leader confirmed the read")]
    assert check_reads(reads, []) == []


def test_the_log_check_catches_a_changed_entry_and_a_shrinking_commit() -> None:
    good = [LogSample(1.0, 0, 100, "k1", 9, 2, ((1, 1, "x"), (2, 1, "y"))),
            LogSample(1.5, 1, 200, "k1", 8, 3, ((1, 1, "x"), (2, 1, "y"), (3, 2, "z")))]
    assert check_log(good) == []
    changed = [*good, LogSample(2.0, 2, 300, "k1", 7, 3, ((3, 3, "w"),))]
    assert names(check_log(changed)) == ["log-divergence"]
    shrunk = [*good, LogSample(2.0, 1, 200, "k1", 8, 1)]
    assert names(check_log(shrunk)) == ["log-regressed"]
    # A restarted process (another pid) or a fresh incarnation starts over: not a regression.
    assert check_log([*good, LogSample(2.0, 1, 201, "k1", 8, 0), LogSample(2.5, 0, 100, "k1", 10, 0)]) == []


def test_judge_checks_the_end_state() -> None:
    h = History(reads=[read(0, 0.0, 1.0, 7)], samples=[LogSample(1.0, 0, 100, "k1", 9, 7)])
    assert judge(h, EndState(True, cluster="k1", commit=7, initial_cluster="k1")).ok
    assert judge(h, EndState(False, "stuck")).names == ("convergence",)
    assert judge(h, EndState(True, cluster="k2", commit=50, initial_cluster="k1")).names == ("committed-lost",)
    assert judge(h, EndState(True, cluster="k1", commit=6, initial_cluster="k1")).names == ("committed-lost", "read-uncommitted")
    unclear = History(reads=[ReadOp(0, 0.0, 1.0, unclear="KeyError: 'members'")])
    assert judge(unclear, EndState(True, cluster="k1", commit=1, initial_cluster="k1")).names == ("request-unclear",)


def test_a_history_survives_its_json_form() -> None:
    h = History(reads=[read(0, 0.0, 1.0, 7), ReadOp(1, 1.0, 2.0, error="e")], acks=[Ack(2.0, "k1", 0, ("c" * 32, 3))],
                samples=[LogSample(1.0, 0, 100, "k1", 9, 2, ((1, 1, "x"), (2, 1, "y")))])
    assert History.from_json(h.to_json()) == h
