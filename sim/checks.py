"""Invariants, checked incrementally as the world runs (never only at the end).

Safety, checked on every Ready and every completed fsync:
- election safety: at most one leader per (cluster, term);
- entry uniqueness: one (cluster, index, term) names one command everywhere (with leaders
  that never overwrite their own entries, this is the Log Matching property);
- committed = durable on a quorum: when any node acts on an applied entry, a majority of
  the voters of the configuration at that index hold it *on synced disk*;
- state-machine safety: no two nodes apply different entries at one index;
- leader completeness (Raft §5.4): a new leader of term T holds every entry that was
  committed in a term below T (the term in which an entry was committed is the lowest term
  in which any node applied it: a node learns a commit index only from a leader of its own
  term, or is that leader);
- hard state across restarts: a rebooted incarnation never has a lower term than any
  message it sent, nor a different vote in a term it voted in;
- one pending membership change per leader, and config changes only once the leader has
  committed an entry of its own term;
- removed nodes can't disrupt: no in-lease member adopts a higher term from a node
  outside its configuration;
- reads are linearizable: a read that completes sees every write acknowledged before it
  was issued.
A violation raises InvariantViolated carrying the name of the invariant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.machine import Ready
from p2pmesh.core.messages import CONFIG_COMMANDS, AppendResponse, Entry, MarkDown, Peer, Put, VoteRequest, VoteResponse
from p2pmesh.core.raft import LEADER, Raft

from sim.node import SimNode


class WorldView(Protocol):
    """What the checker reads of the world (sim/world.py's World): its virtual clock and its
    nodes by id (their disks, to judge what is durable where)."""

    now_us: int
    by_id: dict[NodeId, SimNode]


class InvariantViolated(AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


@dataclass(slots=True)
class _HardSeen:
    term: int = 0
    votes: dict[int, NodeId] = field(default_factory=dict)


class Checker:
    def __init__(self, world: WorldView) -> None:
        self.world = world
        self.leaders: dict[tuple[ClusterId, int], NodeId] = {}
        self.entries: dict[tuple[ClusterId, int, int], object] = {}
        self.applied: dict[tuple[ClusterId, int], tuple[int, object]] = {}
        self.applied_max: dict[ClusterId, int] = {}
        self.commit_term: dict[tuple[ClusterId, int], int] = {}
        """(cluster, index) -> the lowest term in which a node applied that entry: an upper
        bound of the term it was committed in, so leader completeness never judges a leader
        by an entry committed in its own term or later."""
        self.sent_hard: dict[tuple[NodeId, int], _HardSeen] = {}
        self.puts_acked: dict[ClusterId, dict[str, int]] = {}
        """cluster -> key -> virtual time (us) the write was acknowledged to its client."""
        self.puts_pending: dict[tuple[NodeId, str], str] = {}
        self.reads_issued: dict[tuple[NodeId, int], int] = {}
        self.reads_ok = 0
        self.markdowns: list[tuple[int, NodeId]] = []
        self.forbid_markdown = False
        self._was_leader: set[tuple[ClusterId, NodeId, int, int]] = set()
        self._producer: dict[int, tuple[Raft, int]] = {}

    def fail(self, invariant: str, detail: str) -> None:
        raise InvariantViolated(invariant, detail)

    # ------------------------------------------------------------------------------
    # Hooks called by the world

    def on_boot(self, node: SimNode) -> None:
        m = node.machine
        assert m is not None
        seen = self.sent_hard.get((node.node_id, m.inc))
        if seen is None or m.raft is None:
            return
        r = m.raft
        if r.term < seen.term:
            self.fail("term-monotonic", f"{node.name} rebooted at term {r.term} after sending term {seen.term}")
        voted = seen.votes.get(r.term)
        if voted is not None and (r.vote is None or r.vote.node_id != voted):
            self.fail("vote-durable", f"{node.name} rebooted in term {r.term} with vote {r.vote} after voting for {voted}")

    def after_handle(self, node: SimNode, ready: Ready) -> None:
        m = node.machine
        assert m is not None
        r = m.raft
        if r is None:
            self._producer.pop(id(ready), None)  # ids are reused: never judge by a stale entry
            return
        if ready.applied or ready.reads:
            # Remember which log produced this Ready, and its term: its applied entries and
            # reads are judged when its fsync completes, by which time the node may have
            # switched to another cluster's log or moved to a later term (the entries it
            # applies were committed by this term). A stale entry left under a reused id
            # is overwritten here, or belongs to a Ready with nothing to judge.
            self._producer[id(ready)] = (r, r.term)
        cluster = r.cluster
        for e in ready.log_entries:
            key = (cluster, e.index, e.term)
            known = self.entries.get(key)
            if known is None:
                self.entries[key] = e.command
            elif known is not e.command and known != e.command:  # (usually the very object: messages travel as objects)
                self.fail("log-matching", f"{node.name} holds a different entry at index {e.index} term {e.term}")
        if r.role is LEADER:
            self._check_leader(node, r, ready)

    def _check_leader(self, node: SimNode, r: Raft, ready: Ready) -> None:
        stamp = (r.cluster, node.node_id, r.me.inc, r.term)
        if stamp not in self._was_leader:
            # First seen leading this term: judged once (the holder of a term never changes).
            holder = self.leaders.setdefault((r.cluster, r.term), node.node_id)
            if holder != node.node_id:
                self.fail("election-safety", f"two leaders in term {r.term}: {holder[:8]} and {node.node_id[:8]}")
            self._was_leader.add(stamp)
            self._check_leader_completeness(node, r)
        if r.pending_conf_index > r.commit and r.log.term_at(r.pending_conf_index) == r.term:
            # This leader appended a config entry that is still uncommitted: it must be the
            # only uncommitted one, and the leader must have committed its term first.
            start = r.log.first_index + max(0, r.commit - r.log.snapshot.index)
            own = [e for e in r.log.entries[start - r.log.first_index :] if isinstance(e.command, CONFIG_COMMANDS)]
            if len(own) > 1:
                self.fail("one-pending-config-change", f"{node.name} has {len(own)} uncommitted config entries")
        if r.commit < r.term_start_index:
            for e in ready.log_entries:
                if e.term == r.term and isinstance(e.command, CONFIG_COMMANDS):
                    self.fail("config-after-own-term-commit", f"{node.name} appended a config change before committing its term")

    def _check_leader_completeness(self, node: SimNode, r: Raft) -> None:
        """Raft's Leader Completeness (§5.4): an entry committed in term C is in the log of
        every leader of a term above C. A leader of term T may lack an entry committed in T
        or later: it can win with vote grants delivered late, after a higher term committed
        a conflicting entry, and steps down at that term's next message (seed 1147)."""
        cluster, term, log = r.cluster, r.term, r.log
        upto = self.applied_max.get(cluster, 0)
        last = log.last_index
        for index in range(upto, log.snapshot.index, -1):
            ct = self.commit_term.get((cluster, index))
            if ct is not None and ct < term:
                if index > last:
                    self.fail("leader-completeness", f"{node.name} leads term {term} with log ending at {last} < {index}")
                break
        for index in range(log.snapshot.index + 1, min(upto, last) + 1):
            ct = self.commit_term.get((cluster, index))
            if ct is not None and ct < term and log.term_at(index) != self.applied[(cluster, index)][0]:
                self.fail("leader-completeness", f"{node.name} leads term {term} without committed entry {index}")

    def after_sync(self, node: SimNode, ready: Ready) -> None:
        m = node.machine
        produced = self._producer.pop(id(ready), None)
        if m is None:
            return
        synced = node.disk.synced
        hard = synced.hard
        seen: _HardSeen | None = None
        seen_inc = -1
        for _, msg in ready.messages:
            # The persistence contract: what a message asserts is on synced disk first.
            hdr = getattr(msg, "hdr", None)
            if hdr is None:
                continue
            kind = type(msg)
            if (kind is VoteRequest or kind is VoteResponse) and msg.prevote:
                continue  # pre-votes name a term the sender has not (and need not) adopt
            term = hdr.term
            if hard is None or hard.term < term:
                self.fail("persist-before-send", f"{node.name} sent term {term} before persisting it")
            granted = kind is VoteResponse and msg.granted
            if kind is AppendResponse:
                if msg.success and msg.index > 0 and synced.entry_term(msg.index) is None:
                    self.fail("persist-before-send", f"{node.name} acknowledged index {msg.index} before persisting it")
            elif granted and (hard.term != term or hard.vote is None or hard.vote.node_id != hdr.dst):
                self.fail("persist-before-send", f"{node.name} granted a vote in term {term} before persisting it")
            if hdr.src_inc != seen_inc:  # a Ready's messages come from one incarnation
                seen_inc = hdr.src_inc
                seen = self.sent_hard.get((node.node_id, seen_inc))
                if seen is None:
                    seen = self.sent_hard[(node.node_id, seen_inc)] = _HardSeen()
            assert seen is not None
            if term > seen.term:
                seen.term = term
            if granted:
                seen.votes[term] = hdr.dst
        if produced is None:
            return
        r, term = produced
        for e in ready.applied:
            self._check_applied(node, r, e, term)
        for ctx, ok in ready.reads:
            issued = self.reads_issued.pop((node.node_id, ctx), None)
            if ok and issued is not None:
                self.reads_ok += 1
                visible = dict(r.state.kv)
                for key, acked_us in self.puts_acked.get(r.cluster, {}).items():
                    if acked_us < issued and key not in visible:
                        self.fail("linearizable-read", f"{node.name} read at ctx {ctx} misses write {key} acknowledged before it")

    def _check_applied(self, node: SimNode, r: Raft, e: Entry, term: int) -> None:
        key = (r.cluster, e.index)
        rec = self.applied.get(key)
        if rec is None:
            self._check_durable_quorum(node, r, e)
            self.applied[key] = (e.term, e.command)
            self.commit_term[key] = term
            if e.index > self.applied_max.get(r.cluster, 0):
                self.applied_max[r.cluster] = e.index
        elif rec != (e.term, e.command):
            self.fail("state-machine-safety", f"{node.name} applied a different entry at index {e.index}")
        elif term < self.commit_term[key]:
            self.commit_term[key] = term
        cmd = e.command
        if isinstance(cmd, Put):
            if self.puts_pending.pop((node.node_id, cmd.key), None) is not None:
                self.puts_acked.setdefault(r.cluster, {}).setdefault(cmd.key, self.world.now_us)
        elif isinstance(cmd, MarkDown) and r.role is LEADER:
            self.markdowns.append((self.world.now_us, cmd.node_id))
            if self.forbid_markdown:
                self.fail("no-false-down", f"{cmd.node_id[:8]} marked down although it never went silent")

    def _check_durable_quorum(self, node: SimNode, r: Raft, e: Entry) -> None:
        if e.index <= 2 and e.term == 1:
            return  # the bootstrap entries of a founder's log, committed by construction
        # With one-at-a-time changes a leader commits under the latest configuration in its
        # log (thesis §4.1); its majorities intersect those of the configuration at the
        # entry's index, so a majority of either one is a valid commit. The latest one when
        # the entry is applied may be newer than the one it was committed under: the leader
        # can append the next change in the very input that commits (seed 9211: committed
        # under 5 voters, applied once a removal to 4 was appended), so the configurations
        # between the entry's index and the end of the log count too.
        worst: tuple[int, int] = (0, 0)
        log = r.log
        for config in (log.config_at(e.index), log.config()):
            if self._durable_under(config, r.cluster, e):
                return
            worst = (sum(1 for v in config.voters if self._holds(v, r.cluster, e.index, e.term)), len(config.voters))
        for i in range(e.index + 1, log.last_index):
            if self._durable_under(log.config_at(i), r.cluster, e):
                return
        self.fail(
            "committed-is-durable",
            f"{node.name} applied index {e.index} held durably by {worst[0]} of {worst[1]} voters",
        )

    def _durable_under(self, config: object, cluster: ClusterId, e: Entry) -> bool:
        voters = config.voters  # type: ignore[attr-defined]
        holders = sum(1 for voter in voters if self._holds(voter, cluster, e.index, e.term))
        return holders >= len(voters) // 2 + 1

    def _holds(self, voter: Peer, cluster: ClusterId, index: int, term: int) -> bool:
        peer = self.world.by_id.get(voter.node_id)
        if peer is None:
            return False
        img = peer.disk.synced
        if img.hard is None or img.hard.inc != voter.inc:
            # An incarnation that was wiped or abandoned its log: judge by what it held.
            img = peer.disk.retired.get(voter.inc, img)
        if img.hard is None or img.hard.cluster != cluster or img.hard.inc != voter.inc:
            return False
        return img.entry_term(index) in (term, -1)

    # ------------------------------------------------------------------------------
    # Client history

    def on_put_issued(self, node: SimNode, key: str, value: str) -> None:
        self.puts_pending[(node.node_id, key)] = value

    def on_read_issued(self, node: SimNode, ctx: int) -> None:
        self.reads_issued[(node.node_id, ctx)] = self.world.now_us
