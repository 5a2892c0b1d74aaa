"""Raft consensus for one cluster: election, replication, commit, snapshots, reads.

Theory of operation
- One object per (node, cluster, incarnation). Inputs are ``step(message)``, ``tick()`` and
  the request methods (propose, read, transfer_leadership); every call takes ``now_ms``.
  Outputs accumulate in ``self.out`` (a RaftOutput) which the owner drains after each input.
- Ordering contract for the driver: everything in ``out`` that must be durable (hard state,
  log suffix from ``log_dirty_from``, snapshot) is persisted *before* any message of the
  same batch is sent and before applied entries are acted on. Because of that rule the
  leader may count its own log as matched as soon as it appends.
- PreVote and CheckQuorum (etcd-io/raft): a node campaigns only after a pre-election it
  would win; a follower that heard from a live leader within election_min_ms ignores vote
  requests (unless they come from a leader transfer); a leader that has not heard from a
  quorum within election_min_ms steps down.
- Membership is one change at a time: at most one uncommitted config entry, and only once
  an entry of the leader's own term has committed (Ongaro 2015). A configuration takes
  effect when appended (log.py). Learners replicate but never vote or count for commit.
- Linearizable reads use ReadIndex: the leader records its commit index, confirms it is
  still leader with a quorum heartbeat round, and the reader waits until it has applied
  that index.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from p2pmesh.core.cluster import apply_command
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core import validate
from p2pmesh.core.log import RaftLog
from p2pmesh.core.messages import (
    CONFIG_COMMANDS,
    AddLearner,
    Promote,
    AppendEntries,
    AppendResponse,
    ClusterState,
    Command,
    Config,
    Entry,
    ForwardProposal,
    Header,
    InstallSnapshot,
    Message,
    Noop,
    Peer,
    ReadIndexRequest,
    ReadIndexResponse,
    Snapshot,
    TimeoutNow,
    VoteRequest,
    VoteResponse,
)
from p2pmesh.core.settings import Settings


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRECANDIDATE = "precandidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


FOLLOWER, PRECANDIDATE, CANDIDATE, LEADER = Role.FOLLOWER, Role.PRECANDIDATE, Role.CANDIDATE, Role.LEADER
"""The roles as module constants, which the core compares with: Python 3.11 finds a member
named on its enum (``Role.LEADER``) through EnumType's __getattr__ hook, at about 850
instructions, several times per message (a sixteenth of the simulator's time)."""


@dataclass(frozen=True, slots=True)
class HardState:
    """What must survive a crash besides the log: Raft's currentTerm and votedFor."""

    term: int
    vote: Peer | None


@dataclass(slots=True)
class RaftOutput:
    """One batch of effects. Persist (hard_state, log suffix, snapshot) before sending."""

    messages: list[tuple[NodeId, Message]] = field(default_factory=list)
    hard_state: HardState | None = None
    log_dirty_from: int | None = None
    """Persist: truncate the stored log at this index, then store entries from here on."""
    snapshot: Snapshot | None = None
    applied: list[Entry] = field(default_factory=list)
    reads: list[tuple[int, bool]] = field(default_factory=list)
    """ReadIndex results for local readers: (ctx, ok). ok means the state is now readable."""
    role_changed: bool = False

    def is_empty(self) -> bool:
        """Nothing to persist, send or act on (``role_changed`` alone is only a hint)."""
        return (not (self.messages or self.applied or self.reads) and self.hard_state is None and self.snapshot is None
                and self.log_dirty_from is None)


@dataclass(slots=True)
class Progress:
    """The leader's view of one follower."""

    match: int = 0
    next: int = 1
    inflight: int = 0
    recent_active: bool = False
    acked_round: int = 0
    snapshot_sent: bool = False
    voter: bool = False
    """A voter of the leader's latest configuration, not a learner (etcd's IsLearner, the
    other way round): commits, reads and CheckQuorum count voters only, on every
    acknowledgement, and a flag spares comparing Peer values for it each time."""


@dataclass(slots=True)
class PendingRead:
    ctx: int
    index: int
    round: int
    requester: Peer | None
    """None: a local reader on the leader; otherwise the follower that asked."""


class Raft:
    """The consensus state machine of one node in one cluster."""

    def __init__(
        self,
        *,
        me: Peer,
        cluster: ClusterId,
        hard: HardState,
        log: RaftLog,
        settings: Settings,
        rng: random.Random,
        now_ms: int,
    ) -> None:
        self.me = me
        self.cluster = cluster
        self.settings = settings
        self.rng = rng
        self.term = hard.term
        self.vote = hard.vote
        self.log = log
        self.commit = log.snapshot.index
        self.applied = log.snapshot.index
        self.state: ClusterState = log.snapshot.state
        self.role = FOLLOWER
        self.leader: Peer | None = None
        self.leader_contact_ms: int | None = None
        self.out = RaftOutput()
        self.progress: dict[Peer, Progress] = {}
        self.votes: dict[Peer, bool] = {}
        self.pending_conf_index = 0
        self.term_start_index = 0
        self.transfer_to: Peer | None = None
        self.transfer_deadline_ms = 0
        self.read_round = 0
        self.reads: list[PendingRead] = []
        self.follower_reads: dict[int, int] = {}
        """ctx -> read index granted by the leader, waiting until applied reaches it."""
        self._voter_in: tuple[Config | None, bool] = (None, False)
        """(a configuration, whether this node is a voter in it): is_voter's last answer."""
        self._headers: dict[NodeId, Header] = {}
        """The last header sent to each node (by id, so no Peer is hashed on the hot path)."""
        self._sources: dict[NodeId, Peer] = {}
        """The last sender seen of each node id, at its incarnation: step looks a message's
        sender up rather than building a Peer per message (bounded by the nodes that can
        reach this Raft at all: the owner checked the cluster and the destination). A
        leader puts its progress keys here, so looking a sender's progress up finds the
        very object and compares no Peer values."""
        self.heartbeat_due_ms = 0
        self.check_quorum_due_ms = 0
        self.election_due_ms = 0
        self.reset_election_timer(now_ms)
        self._apply_committed()

    # ------------------------------------------------------------------------------
    # Queries

    @property
    def config(self) -> Config:
        return self.log.config()

    def is_voter(self, peer: Peer | None = None) -> bool:
        config = self.config
        if peer is not None:
            return peer in config.voters
        if config is not self._voter_in[0]:  # asked on every acknowledgement: once per configuration
            self._voter_in = (config, self.me in config.voters)
        return self._voter_in[1]

    def quorum(self) -> int:
        return len(self.config.voters) // 2 + 1

    def next_deadline_ms(self) -> int:
        if self.role is LEADER:
            due = min(self.heartbeat_due_ms, self.check_quorum_due_ms)
            if self.transfer_to is not None:
                due = min(due, self.transfer_deadline_ms)
            return due
        return self.election_due_ms

    def take_output(self) -> RaftOutput:
        out, self.out = self.out, RaftOutput()
        return out

    def has_output(self) -> bool:
        """Whether take_output has anything to persist, send or act on."""
        return not self.out.is_empty()

    def commit_founding(self, index: int) -> None:
        """Commit a new one-member cluster's founding entries up to ``index``: its only
        voter holds them, and the caller persists them before anything is sent."""
        self._commit_to(index)

    def log_persisted(self) -> None:
        """The caller wrote the whole log itself (a cluster switch): nothing to re-write."""
        self.out.log_dirty_from = None

    def header_to(self, to: Peer) -> Header:
        """The header of a message of this node's current term to ``to``."""
        return self._hdr(to)

    # ------------------------------------------------------------------------------
    # Timers

    def reset_election_timer(self, now_ms: int) -> None:
        s = self.settings
        self.election_due_ms = now_ms + self.rng.randint(s.election_min_ms, s.election_max_ms)

    def tick(self, now_ms: int) -> None:
        if self.role is LEADER:
            if self.transfer_to is not None and now_ms >= self.transfer_deadline_ms:
                self.transfer_to = None
            if now_ms >= self.check_quorum_due_ms:
                self.check_quorum_due_ms = now_ms + self.settings.election_min_ms
                if not self._quorum_active():
                    self.become_follower(self.term, None, now_ms)
                    return
            if now_ms >= self.heartbeat_due_ms:
                self.broadcast_append(now_ms, heartbeat=True)
            return
        if now_ms >= self.election_due_ms:
            self.reset_election_timer(now_ms)
            if self.is_voter():
                self.campaign(now_ms, prevote=True, transfer=False)

    def _quorum_active(self) -> bool:
        active = 1 if self.is_voter() else 0
        for pr in self.progress.values():
            if pr.recent_active and pr.voter:
                active += 1
            pr.recent_active = False
        return active >= self.quorum()

    # ------------------------------------------------------------------------------
    # Role changes

    def _set_hard(self, term: int, vote: Peer | None) -> None:
        if term != self.term or vote != self.vote:
            self.term = term
            self.vote = vote
            self.out.hard_state = HardState(term, vote)

    def become_follower(self, term: int, leader: Peer | None, now_ms: int) -> None:
        if term > self.term:
            self._set_hard(term, None)
        if self.role is not FOLLOWER:
            self.out.role_changed = True
        self.role = FOLLOWER
        if leader != self.leader:
            self.out.role_changed = True
        self.leader = leader
        self.transfer_to = None
        self.progress = {}
        self._fail_pending_reads()
        self.reset_election_timer(now_ms)

    def campaign(self, now_ms: int, *, prevote: bool, transfer: bool) -> None:
        self.out.role_changed = True
        self.leader = None
        self.votes = {self.me: True}
        if prevote:
            self.role = PRECANDIDATE
            term = self.term + 1
        else:
            self.role = CANDIDATE
            self._set_hard(self.term + 1, self.me)
            term = self.term
        self.reset_election_timer(now_ms)
        if self._tally() >= self.quorum():
            self._won_election(now_ms, prevote=prevote)
            return
        for peer in self.config.voters:
            if peer != self.me:
                self._send(
                    peer,
                    VoteRequest(self._hdr(peer, term), prevote, self.log.last_index, self.log.last_term, transfer),
                )

    def _tally(self) -> int:
        return sum(1 for p, granted in self.votes.items() if granted and p in self.config.voters)

    def _won_election(self, now_ms: int, *, prevote: bool) -> None:
        if prevote:
            self.campaign(now_ms, prevote=False, transfer=False)
        else:
            self.become_leader(now_ms)

    def become_leader(self, now_ms: int) -> None:
        self.role = LEADER
        self.leader = self.me
        self.out.role_changed = True
        self.transfer_to = None
        self.progress = {}
        voters = self.config.voters
        for peer in self._replication_targets():
            self.progress[peer] = Progress(next=self.log.last_index + 1, voter=peer in voters)
        self._sources.update((peer.node_id, peer) for peer in self.progress)  # (see _sources)
        self.check_quorum_due_ms = now_ms + self.settings.election_min_ms
        # Conservatively treat every entry we hold as possibly carrying a config change.
        self.pending_conf_index = self.log.last_index
        self.term_start_index = self.log.last_index + 1
        self._append(Noop())
        self.broadcast_append(now_ms, heartbeat=False)

    def _replication_targets(self) -> list[Peer]:
        cfg = self.config
        return [p for p in (*cfg.voters, *cfg.learners) if p != self.me]

    # ------------------------------------------------------------------------------
    # Requests from the owner

    def propose(self, command: Command, now_ms: int) -> int | None:
        """Append a command if we lead and the membership rules allow it.

        Returns the entry's index, or None when refused (not leader, a transfer in
        progress, proposals_pending_max entries not yet committed, or a config change
        while another is pending or before our own term has committed an entry).
        """
        if self.role is not LEADER or self.transfer_to is not None:
            return None
        if self.log.last_index - self.commit >= self.settings.proposals_pending_max:
            return None  # a minority leader or a flood of forwarded proposals: the log stays bounded
        if isinstance(command, CONFIG_COMMANDS) and not (self.config_change_allowed() and self._changes_config(command)):
            return None
        index = self._append(command)
        self.broadcast_append(now_ms, heartbeat=False)
        return index

    def _changes_config(self, command: Command) -> bool:
        """Refuse no-op config commands (a repeated removal, a promotion of a voter)."""
        peer = Peer(command.node_id, command.inc)  # type: ignore[union-attr]
        cfg = self.config
        if isinstance(command, AddLearner):
            return peer not in cfg.voters and peer not in cfg.learners
        if isinstance(command, Promote):
            return peer in cfg.learners
        return peer in cfg.voters or peer in cfg.learners

    def config_change_allowed(self) -> bool:
        return self.role is LEADER and self.pending_conf_index <= self.commit and self.commit >= self.term_start_index

    def _append(self, command: Command) -> int:
        entry = Entry(self.log.last_index + 1, self.term, command)
        self.log.append(entry)
        self._mark_dirty(entry.index)
        if isinstance(command, CONFIG_COMMANDS):
            self.pending_conf_index = entry.index
            self._sync_progress_with_config()
        self._maybe_commit()
        return entry.index

    def _mark_dirty(self, index: int) -> None:
        if self.out.log_dirty_from is None or index < self.out.log_dirty_from:
            self.out.log_dirty_from = index

    def _sync_progress_with_config(self) -> None:
        targets = set(self._replication_targets())
        voters = self.config.voters
        for peer in list(self.progress):
            if peer not in targets:
                del self.progress[peer]
        for peer in targets:
            if peer not in self.progress:
                self.progress[peer] = Progress(next=self.log.last_index)
            self.progress[peer].voter = peer in voters  # (a promoted learner keeps its progress)
        self._sources.update((peer.node_id, peer) for peer in self.progress)

    def transfer_leadership(self, target: Peer, now_ms: int) -> bool:
        if self.role is not LEADER or target == self.me or target not in self.config.voters:
            return False
        self.transfer_to = target
        self.transfer_deadline_ms = now_ms + self.settings.election_max_ms
        pr = self.progress[target]  # a voter other than us: a replication target
        if pr.match == self.log.last_index:
            self._send(target, TimeoutNow(self._hdr(target)))
        else:
            self._send_append(target, pr, now_ms)
        return True

    def read(self, ctx: int, now_ms: int) -> None:
        """Start a linearizable read; ``out.reads`` reports (ctx, ok) when decided."""
        if self.role is LEADER:
            self._leader_read(ctx, None, now_ms)
        elif self.leader is not None and len(self.follower_reads) < self.settings.reads_pending_max:
            self._send(self.leader, ReadIndexRequest(self._hdr(self.leader), ctx))
            self.follower_reads[ctx] = -1
        else:
            self.out.reads.append((ctx, False))

    def _leader_read(self, ctx: int, requester: Peer | None, now_ms: int) -> None:
        if self.commit < self.term_start_index or len(self.reads) >= self.settings.reads_pending_max:
            self._answer_read(ctx, requester, 0, ok=False)
            return
        self.read_round += 1
        self.reads.append(PendingRead(ctx, self.commit, self.read_round, requester))
        self._check_reads()
        if self.reads:
            self.broadcast_append(now_ms, heartbeat=True)

    def _check_reads(self) -> None:
        if not self.reads:
            return
        rounds = sorted((pr.acked_round for pr in self.progress.values() if pr.voter), reverse=True)
        if self.is_voter():
            rounds.insert(0, self.read_round)
        confirmed = rounds[self.quorum() - 1] if len(rounds) >= self.quorum() else 0
        still: list[PendingRead] = []
        for r in self.reads:
            if r.round <= confirmed:
                self._answer_read(r.ctx, r.requester, r.index, ok=True)
            else:
                still.append(r)
        self.reads = still

    def _answer_read(self, ctx: int, requester: Peer | None, index: int, *, ok: bool) -> None:
        if requester is None:
            self.out.reads.append((ctx, ok))
        else:
            self._send(requester, ReadIndexResponse(self._hdr(requester), ctx, index, ok))

    def _fail_pending_reads(self) -> None:
        for r in self.reads:
            self._answer_read(r.ctx, r.requester, 0, ok=False)
        self.reads = []
        for ctx in self.follower_reads:
            self.out.reads.append((ctx, False))
        self.follower_reads = {}

    # ------------------------------------------------------------------------------
    # Messages

    def _hdr(self, to: Peer, term: int | None = None) -> Header:
        term = self.term if term is None else term
        hdr = self._headers.get(to.node_id)
        if hdr is None or hdr.term != term or hdr.dst_inc != to.inc:
            # Headers are immutable values; reuse one per peer and term (a hot path).
            hdr = self._headers[to.node_id] = Header(self.cluster, self.me.node_id, self.me.inc, to.node_id, to.inc, term)
        return hdr

    def _send(self, to: Peer, message: Message) -> None:
        self.out.messages.append((to.node_id, message))

    def step(self, m: Message, now_ms: int) -> None:
        """Handle one Raft message addressed to us (the owner checked cluster and dst_inc)."""
        hdr: Header = m.hdr  # type: ignore[union-attr]
        src = self._sources.get(hdr.src)
        if src is None or src.inc != hdr.src_inc:
            src = self._sources[hdr.src] = Peer(hdr.src, hdr.src_inc)
        if isinstance(m, VoteRequest):
            self._on_vote_request(m, src, now_ms)
            return
        if hdr.term > self.term:
            if isinstance(m, VoteResponse) and m.prevote and m.granted:
                pass  # a granted pre-vote carries the term we would campaign at
            elif isinstance(m, (AppendEntries, InstallSnapshot)):
                self.become_follower(hdr.term, src, now_ms)
            else:
                self.become_follower(hdr.term, None, now_ms)
        elif hdr.term < self.term:
            if isinstance(m, (AppendEntries, InstallSnapshot)):
                # Tell a stale leader about the newer term so it steps down.
                self._send(src, AppendResponse(self._hdr(src), False, self.log.last_index, 0))
            return
        if isinstance(m, AppendEntries):
            self._on_append(m, src, now_ms)
        elif isinstance(m, AppendResponse):
            self._on_append_response(m, src, now_ms)
        elif isinstance(m, VoteResponse):
            self._on_vote_response(m, src, now_ms)
        elif isinstance(m, InstallSnapshot):
            self._on_snapshot(m, src, now_ms)
        elif isinstance(m, TimeoutNow):
            if self.is_voter() and self.role is not LEADER:
                # A transfer skips the pre-vote and is flagged so in-lease voters answer.
                self.campaign(now_ms, prevote=False, transfer=True)
        elif isinstance(m, ReadIndexRequest):
            if self.role is LEADER:
                self._leader_read(m.ctx, src, now_ms)
            else:
                self._send(src, ReadIndexResponse(self._hdr(src), m.ctx, 0, False))
        elif isinstance(m, ReadIndexResponse):
            self._on_read_response(m)
        elif isinstance(m, ForwardProposal):
            # Only a member at its current incarnation may forward: a removed one (or its old
            # incarnation) no longer writes to the cluster.
            member = src in self.config.voters or src in self.config.learners
            if self.role is LEADER and member and validate.forwarded_problem(m.command, src.node_id) is None:
                self.propose(m.command, now_ms)

    def _in_lease(self, now_ms: int) -> bool:
        return (
            self.leader is not None
            and self.leader_contact_ms is not None
            and now_ms - self.leader_contact_ms < self.settings.election_min_ms
        ) or self.role is LEADER

    def _on_vote_request(self, m: VoteRequest, src: Peer, now_ms: int) -> None:
        term = m.hdr.term
        if term > self.term and not m.transfer and self._in_lease(now_ms):
            return  # CheckQuorum stickiness: a live leader exists, ignore the disruption
        if term < self.term:
            self._send(src, VoteResponse(self._hdr(src), m.prevote, False))
            return
        if term > self.term and not m.prevote:
            self.become_follower(term, None, now_ms)
        up_to_date = self.log.is_up_to_date(m.last_index, m.last_term)
        if m.prevote:
            granted = up_to_date and term > self.term
            self._send(src, VoteResponse(self._hdr(src, term if granted else self.term), True, granted))
            return
        granted = up_to_date and self.vote in (None, src)
        if granted:
            self._set_hard(self.term, src)
            self.reset_election_timer(now_ms)
        self._send(src, VoteResponse(self._hdr(src), False, granted))

    def _on_vote_response(self, m: VoteResponse, src: Peer, now_ms: int) -> None:
        if m.prevote:
            if self.role is not PRECANDIDATE or (m.granted and m.hdr.term != self.term + 1):
                return
        elif self.role is not CANDIDATE:
            return
        self.votes[src] = m.granted
        if self._tally() >= self.quorum():
            self._won_election(now_ms, prevote=m.prevote)
            return
        rejected = sum(1 for p, g in self.votes.items() if not g and p in self.config.voters)
        if rejected >= self.quorum():
            self.become_follower(self.term, None, now_ms)

    def _heard_from_leader(self, src: Peer, now_ms: int) -> None:
        if self.role is not FOLLOWER or (self.leader is not src and self.leader != src):
            self.out.role_changed = True  # (src is the very Peer of the last message from it: see step)
        self.role = FOLLOWER
        self.leader = src
        self.leader_contact_ms = now_ms
        self.reset_election_timer(now_ms)

    def _on_append(self, m: AppendEntries, src: Peer, now_ms: int) -> None:
        self._heard_from_leader(src, now_ms)
        if m.prev_index < self.commit:
            self._send(src, AppendResponse(self._hdr(src), True, self.commit, m.ctx))
            return
        if self.log.term_at(m.prev_index) != m.prev_term:
            hint = min(self.log.last_index, m.prev_index - 1)
            self._send(src, AppendResponse(self._hdr(src), False, max(hint, self.commit), m.ctx))
            return
        for entry in m.entries:
            existing = self.log.term_at(entry.index)
            if existing == entry.term:
                continue
            if existing is not None:
                assert entry.index > self.commit, "leader tried to overwrite a committed entry"
                self.log.truncate_from(entry.index)
            self.log.append(entry)
            self._mark_dirty(entry.index)
        last_new = m.prev_index + len(m.entries)
        if m.commit > self.commit:
            self._commit_to(min(m.commit, last_new))
        self._send(src, AppendResponse(self._hdr(src), True, last_new, m.ctx))

    def _on_snapshot(self, m: InstallSnapshot, src: Peer, now_ms: int) -> None:
        self._heard_from_leader(src, now_ms)
        snap = m.snapshot
        if snap.index <= self.commit:
            self._send(src, AppendResponse(self._hdr(src), True, self.commit, 0))
            return
        if self.log.term_at(snap.index) == snap.term:
            # We already hold the snapshot's last entry: keep what follows it (Raft fig. 13
            # step 6). We may have acknowledged those entries; dropping them would let the
            # leader count entries we no longer hold.
            self.log.compact(snap)
            self.out.snapshot = snap
            self.commit = snap.index
            if self.applied < snap.index:
                self.applied = snap.index
                self.state = snap.state
            self._send(src, AppendResponse(self._hdr(src), True, self.log.last_index, 0))
            return
        self.log.reset(snap)
        self.commit = self.applied = snap.index
        self.state = snap.state
        self.out.snapshot = snap
        self.out.log_dirty_from = snap.index + 1
        self._send(src, AppendResponse(self._hdr(src), True, snap.index, 0))

    def _on_append_response(self, m: AppendResponse, src: Peer, now_ms: int) -> None:
        if self.role is not LEADER:
            return
        pr = self.progress.get(src)
        if pr is None:
            return
        pr.recent_active = True
        pr.inflight = max(0, pr.inflight - 1)
        if m.ctx > pr.acked_round:
            pr.acked_round = m.ctx
            self._check_reads()
        if m.success:
            pr.snapshot_sent = False
            if m.index > pr.match:
                pr.match = m.index
                self._maybe_commit()
            pr.next = max(pr.next, pr.match + 1)
            if self.transfer_to is not None and self.transfer_to == src and pr.match == self.log.last_index:
                self._send(src, TimeoutNow(self._hdr(src)))
        else:
            pr.snapshot_sent = False
            pr.next = max(pr.match + 1, min(pr.next - 1, m.index + 1))
        if pr.next <= self.log.last_index:
            self._send_append(src, pr, now_ms)

    def _on_read_response(self, m: ReadIndexResponse) -> None:
        if m.ctx not in self.follower_reads:
            return
        if not m.ok:
            del self.follower_reads[m.ctx]
            self.out.reads.append((m.ctx, False))
            return
        self.follower_reads[m.ctx] = m.index
        self._release_follower_reads()

    def _release_follower_reads(self) -> None:
        for ctx, index in list(self.follower_reads.items()):
            if 0 <= index <= self.applied:
                del self.follower_reads[ctx]
                self.out.reads.append((ctx, True))

    # ------------------------------------------------------------------------------
    # Replication

    def broadcast_append(self, now_ms: int, *, heartbeat: bool) -> None:
        self.heartbeat_due_ms = now_ms + self.settings.heartbeat_ms
        for peer, pr in self.progress.items():
            self._send_append(peer, pr, now_ms, heartbeat=heartbeat)

    def _send_append(self, peer: Peer, pr: Progress, now_ms: int, *, heartbeat: bool = False) -> None:
        if not heartbeat and pr.inflight >= self.settings.inflight_appends_max:
            return
        prev = pr.next - 1
        if prev < self.log.snapshot.index:
            if not pr.snapshot_sent or heartbeat:
                pr.snapshot_sent = True
                pr.inflight += 1
                self._send(peer, InstallSnapshot(self._hdr(peer), self.log.snapshot))
            return
        prev_term = self.log.term_at(prev)
        assert prev_term is not None
        entries = self.log.slice(pr.next, self.settings.entries_per_append_max) if pr.next <= self.log.last_index else ()
        if entries:
            pr.next = entries[-1].index + 1  # optimistic: pipeline the next batch
        pr.inflight += 1
        commit = min(self.commit, prev + len(entries))
        self._send(peer, AppendEntries(self._hdr(peer), prev, prev_term, entries, commit, self.read_round))

    def _maybe_commit(self) -> None:
        matches = [pr.match for pr in self.progress.values() if pr.voter]
        if self.is_voter():
            matches.append(self.log.last_index)
        q = self.quorum()
        if len(matches) < q:
            return
        matches.sort(reverse=True)
        candidate = matches[q - 1]
        # Raft §5.4.2: only entries of the current term commit by counting replicas.
        if candidate > self.commit and self.log.term_at(candidate) == self.term:
            self._commit_to(candidate)

    def _commit_to(self, index: int) -> None:
        if index <= self.commit:
            return
        self.commit = index
        self._apply_committed()

    def _apply_committed(self) -> None:
        while self.applied < self.commit:
            entry = self.log.entry(self.applied + 1)
            self.state = apply_command(self.state, entry.command)
            self.applied = entry.index
            self.out.applied.append(entry)
        if self.follower_reads:
            self._release_follower_reads()
        if self.role is LEADER and not self.is_voter() and self.commit >= self.log.last_config_index():
            # Our own removal committed: stop leading (etcd's StepDownOnRemoval).
            self.role = FOLLOWER
            self.leader = None
            self.out.role_changed = True
            self.progress = {}
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self.applied - self.log.snapshot.index < self.settings.snapshot_every_entries:
            return
        index = self.applied
        term = self.log.term_at(index)
        assert term is not None
        snap = Snapshot(index, term, self.log.config_at(index), self.state)
        self.log.compact(snap)
        self.out.snapshot = snap
