"""Planted bugs: deliberate mistakes applied to the core by subclassing, never by flags
inside p2pmesh/. Each one must make a sweep report a violation (tests/sim checks it), which
shows the invariants and the fault schedule have teeth.
"""
from __future__ import annotations

from collections.abc import Callable

from p2pmesh.core.machine import Machine
from p2pmesh.core.messages import AppendEntries, Peer, VoteRequest, VoteResponse
from p2pmesh.core.raft import Raft, Role


class _VoteNotPersisted(Raft):
    """Keeps a vote granted within the current term in memory only."""

    def _set_hard(self, term: int, vote: Peer | None) -> None:
        if term == self.term:
            self.vote = vote
            return
        super()._set_hard(term, vote)


class _AckBeforePersist(Raft):
    """A follower acknowledges entries and persists them only with its next batch."""

    _late: int | None = None

    def step(self, m: object, now_ms: int) -> None:
        if self._late is not None:
            Raft._mark_dirty(self, self._late)
            self._late = None
        super().step(m, now_ms)  # type: ignore[arg-type]

    def _mark_dirty(self, index: int) -> None:
        if self.role is Role.LEADER:
            super()._mark_dirty(index)
        elif self._late is None or index < self._late:
            self._late = index


class _ConfigBeforeOwnTerm(Raft):
    """Allows a membership change before the new leader committed an entry of its term."""

    def config_change_allowed(self) -> bool:
        return self.role is Role.LEADER and self.pending_conf_index <= self.commit

    def become_leader(self, now_ms: int) -> None:
        super().become_leader(now_ms)
        self.pending_conf_index = 0


class _MultiplePendingConfig(Raft):
    """Allows a second membership change while one is still uncommitted."""

    def config_change_allowed(self) -> bool:
        return self.role is Role.LEADER and self.commit >= self.term_start_index


class _LearnerCountsInQuorum(Raft):
    """Counts learners' acknowledgements toward commit."""

    def _maybe_commit(self) -> None:
        matches = [pr.match for pr in self.progress.values()]
        if self.is_voter():
            matches.append(self.log.last_index)
        q = self.quorum()
        if len(matches) < q:
            return
        matches.sort(reverse=True)
        candidate = matches[q - 1]
        if candidate > self.commit and self.log.term_at(candidate) == self.term:
            self._commit_to(candidate)


class _StaleTermAppendAccepted(Raft):
    """Accepts AppendEntries from a leader of an older term (and acknowledges it in that
    term, so the deposed leader counts the acknowledgement)."""

    def step(self, m: object, now_ms: int) -> None:
        if isinstance(m, AppendEntries) and m.hdr.term < self.term:
            current = self.term
            self.term = m.hdr.term
            self._on_append(m, Peer(m.hdr.src, m.hdr.src_inc), now_ms)
            self.term = current
            return
        super().step(m, now_ms)  # type: ignore[arg-type]


class _VoteWithoutAdoptingTerm(Raft):
    """Grants a vote for a higher term without stepping down to (and recording) it."""

    def _on_vote_request(self, m: VoteRequest, src: Peer, now_ms: int) -> None:
        if m.hdr.term > self.term and not m.prevote and not self._in_lease(now_ms):
            if self.log.is_up_to_date(m.last_index, m.last_term):
                self._send(src, VoteResponse(self._hdr(src, m.hdr.term), False, True))
                return
        super()._on_vote_request(m, src, now_ms)


class _ApplyUncommitted(Raft):
    """A follower applies everything it received, committed or not."""

    def _on_append(self, m: AppendEntries, src: Peer, now_ms: int) -> None:
        super()._on_append(m, src, now_ms)
        last = m.prev_index + len(m.entries)
        if last > self.commit and self.log.term_at(last) == (m.entries[-1].term if m.entries else None):
            self._commit_to(last)


class _ReadWithoutQuorum(Raft):
    """Serves reads from the leader's local state without confirming leadership."""

    def _leader_read(self, ctx: int, requester: Peer | None, now_ms: int) -> None:
        self._answer_read(ctx, requester, self.commit, ok=True)


class _ReuseNodeId(Machine):
    """Starts every fresh log under the same incarnation (node-id reuse after a wipe)."""

    def _new_inc(self) -> int:
        return 1


def _with_raft(raft_class: type[Raft]) -> type[Machine]:
    return type(f"Machine_{raft_class.__name__.lstrip('_')}", (Machine,), {"raft_class": raft_class})


PLANTS: dict[str, Callable[[], type[Machine]]] = {
    "vote-not-persisted": lambda: _with_raft(_VoteNotPersisted),
    "ack-before-persist": lambda: _with_raft(_AckBeforePersist),
    "config-before-own-term-commit": lambda: _with_raft(_ConfigBeforeOwnTerm),
    "multiple-pending-config": lambda: _with_raft(_MultiplePendingConfig),
    "learner-counts-in-quorum": lambda: _with_raft(_LearnerCountsInQuorum),
    "stale-term-append-accepted": lambda: _with_raft(_StaleTermAppendAccepted),
    "vote-without-adopting-term": lambda: _with_raft(_VoteWithoutAdoptingTerm),
    "apply-uncommitted": lambda: _with_raft(_ApplyUncommitted),
    "read-without-quorum": lambda: _with_raft(_ReadWithoutQuorum),
    "reuse-node-id": lambda: _ReuseNodeId,
}


def machine_class_for(plant: str | None) -> type[Machine]:
    if plant is None:
        return Machine
    try:
        return PLANTS[plant]()
    except KeyError:
        raise ValueError(f"unknown plant {plant!r}; `python -m sim plants` lists them") from None
