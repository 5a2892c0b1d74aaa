"""Timing and limits of the membership layer, one frozen value passed to every node.

Defaults suit Thunderbolt-class links (0.1-1 ms): heartbeat 50 ms, randomized election
timeout 150-300 ms (Raft paper §9.3). Failure detection is separate from elections: a
member is marked down after ``down_after_ms`` of silence toward the leader, and removed
from the voters only after ``remove_after_ms`` (minutes, so a sleeping Mac is not dropped).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    heartbeat_ms: int = 50
    election_min_ms: int = 150
    election_max_ms: int = 300
    entries_per_append_max: int = 64
    inflight_appends_max: int = 4
    """AppendEntries a leader has unanswered toward one follower at most (heartbeats aside):
    with ``entries_per_append_max``, what a slow follower can have in flight."""
    snapshot_every_entries: int = 512
    """Compact the log once this many applied entries sit after the last snapshot."""
    hello_ms: int = 200
    """How often a node greets peers that are not in its cluster (formation and merges)."""
    peer_silent_ms: int = 1_500
    """A discovered peer silent this long is forgotten by formation logic."""
    formation_wait_ms: int = 400
    """An unformed node waits this long after start before it may bootstrap a cluster."""
    down_after_ms: int = 1_000
    """Silence toward the leader after which a member is marked down (committed)."""
    remove_after_ms: int = 180_000
    """Down this long and a member is removed from the configuration."""
    promote_lag_entries: int = 8
    """A learner within this many entries of the leader's commit index gets promoted."""
    standalone_after_ms: int = 3_000
    """A member without a working leader this long joins a healthy cluster it sees, or
    continues as a standalone cluster of its own (see docs/architecture.md)."""
    leave_timeout_ms: int = 5_000
    """A graceful leave that no leader confirms within this time stops anyway."""
    drain_timeout_ms: int = 60_000
    """A leaving Mac that holds model layers waits at most this long for a placement
    without it to take over (make before break) before it leaves anyway."""
    measure_grace_ms: int = 10_000
    """While nothing serves, the leader plans a model's first placement once every candidate
    has measured it (or failed to), or this long after the first measurement: a plan made on
    the first measurement alone is replaced moments later, its workers started and its files
    fetched (hub downloads too) for nothing."""
    proposals_pending_max: int = 1_024
    """Uncommitted entries a leader holds at most; further proposals are refused until
    some commit (bounds the log against a flood of forwarded proposals)."""
    reads_pending_max: int = 1_024
    peers_known_max: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_ms < self.election_min_ms <= self.election_max_ms:
            raise ValueError("need 0 < heartbeat_ms < election_min_ms <= election_max_ms")
