"""The history of a chaos run and its verdict, the same for real agents and the simulator.

Both sides record the same things (sim/observations.py: reads, acknowledged writes, log
samples), on their own clock (seconds since the fault phase started; wall time for
scripts/chaos.py, virtual time for sim/chaos_scenario.py), into a ``History``.

``judge`` turns a history and the end state into a ``Verdict``: the names of the violated
invariants (``INVARIANTS``), empty when the run passed; the reads are judged by
sim/linearizability.py. Pure: no I/O.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from sim.linearizability import check_reads
from sim.observations import Ack, LogSample, MemberView, ReadOp, Violation

INVARIANTS = (
    "log-divergence",  # one (cluster, index) reported with two different (term, digest)
    "log-regressed",  # one incarnation's commit index went down within a process (entries vanished)
    "committed-lost",  # the cluster after healing is not the one that formed, or misses committed entries
    "read-stale",  # a read older than one completed before it began (sim/linearizability.py)
    "read-divergent",  # two reads of one (cluster, index) with different memberships
    "read-sees-removed",  # a read lists a member whose confirmed leave completed before it began
    "read-uncommitted",  # a read's index beyond what its cluster ever committed
    "request-unclear",  # a request that neither completed correctly nor failed with a clear error
    "convergence",  # not one healthy cluster of every running host within the bound after healing
    "agent-exit",  # an agent process ended by itself (the simulator's analogue: core-exception)
)
"""The chaos verdict's vocabulary. The simulator adds the invariants of sim/checks.py it
checks on every event (election-safety, committed-is-durable, ...), which real processes
cannot observe."""


@dataclass(slots=True)
class History:
    reads: list[ReadOp] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    samples: list[LogSample] = field(default_factory=list)

    def to_json(self) -> str:
        """The history as one JSON object (scripts/chaos.py --history writes it)."""
        return json.dumps({
            "reads": [{**asdict(r), "view": None if r.view is None else
                       {"cluster": r.view.cluster, "index": r.view.index, "members": sorted(map(list, r.view.members))}}
                      for r in self.reads],
            "acks": [asdict(a) for a in self.acks],
            "samples": [asdict(s) for s in self.samples],
        }) + "\n"

    @classmethod
    def from_json(cls, text: str) -> History:
        raw = json.loads(text)
        h = cls()
        for r in raw["reads"]:
            v = r.pop("view")
            view = None if v is None else MemberView(v["cluster"], v["index"], frozenset(tuple(m) for m in v["members"]))
            h.reads.append(ReadOp(**r, view=view))
        for a in raw["acks"]:
            removed = None if a["removed"] is None else (str(a["removed"][0]), int(a["removed"][1]))
            h.acks.append(Ack(a["at_s"], a["cluster"], a["index"], removed))
        for s in raw["samples"]:
            h.samples.append(LogSample(**{**s, "entries": tuple((int(i), int(t), str(d)) for i, t, d in s["entries"])}))
        return h

    def counts(self) -> dict[str, int]:
        ok = sum(1 for r in self.reads if r.view is not None)
        return {
            "reads": len(self.reads),
            "reads_ok": ok,
            "reads_failed": sum(1 for r in self.reads if r.error is not None),
            "reads_unclear": sum(1 for r in self.reads if r.unclear is not None),
            "acks": len(self.acks),
            "log_samples": len(self.samples),
            "entries_seen": len({(s.cluster, e[0]) for s in self.samples for e in s.entries}),
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    violations: tuple[Violation, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The violated invariants, sorted: what two worlds must agree on."""
        return tuple(sorted({v.invariant for v in self.violations}))

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True, slots=True)
class EndState:
    """How the run ended, as each side's convergence check saw it."""

    converged: bool
    detail: str = ""
    cluster: str | None = None
    """The cluster every running host was in at the end (None if there was no such one)."""
    commit: int = 0
    initial_cluster: str | None = None


DETAILS_PER_INVARIANT_MAX = 5


def check_log(samples: list[LogSample]) -> list[Violation]:
    """Committed entries are never lost or reordered: one (cluster, index) is one (term,
    digest) wherever and whenever it is reported, and each process's commit only grows."""
    out: list[Violation] = []
    seen: dict[tuple[str, int], tuple[int, str, int]] = {}
    commit: dict[tuple[int, int, str, int], int] = {}
    for s in sorted(samples, key=lambda s: s.at_s):
        key = (s.host, s.proc, s.cluster, s.inc)
        before = commit.get(key, 0)
        if s.commit < before:
            out.append(Violation("log-regressed", f"h{s.host} (process {s.proc}) commit went from {before} to {s.commit} "
                                 f"at {s.at_s:.2f}s"))
        commit[key] = max(before, s.commit)
        for index, term, digest in s.entries:
            known = seen.setdefault((s.cluster, index), (term, digest, s.host))
            if known[:2] != (term, digest):
                out.append(Violation("log-divergence", f"index {index} of cluster {s.cluster[:8]}: h{known[2]} reported "
                                     f"term {known[0]} {known[1]}, h{s.host} term {term} {digest} at {s.at_s:.2f}s"))
    return out


def check_end(history: History, end: EndState) -> list[Violation]:
    out: list[Violation] = []
    if not end.converged:
        out.append(Violation("convergence", end.detail or "not converged within the bound"))
        return out
    if end.initial_cluster is not None and end.cluster != end.initial_cluster:
        out.append(Violation("committed-lost", f"the cluster that formed ({end.initial_cluster[:8]}) did not survive; "
                             f"the hosts ended in {str(end.cluster)[:8]}"))
        return out
    top = max((s.commit for s in history.samples if s.cluster == end.cluster), default=0)
    if top > end.commit:
        out.append(Violation("committed-lost", f"index {top} was reported committed but the healed cluster's commit is "
                             f"{end.commit}"))
    for r in history.reads:
        if r.view is not None and r.view.cluster == end.cluster and r.view.index > end.commit:
            out.append(Violation("read-uncommitted", f"h{r.host} answered index {r.view.index} at {r.complete_s:.2f}s; "
                                 f"the cluster's commit is {end.commit}"))
    return out


def check_requests(history: History) -> list[Violation]:
    return [Violation("request-unclear", f"h{r.host} read invoked at {r.invoke_s:.2f}s: {r.unclear}")
            for r in history.reads if r.unclear is not None]


def judge(history: History, end: EndState) -> Verdict:
    """Every check of the history and the end state; at most a few details per invariant."""
    found = [*check_log(history.samples), *check_reads(history.reads, history.acks, history.samples),
             *check_requests(history), *check_end(history, end)]
    kept: list[Violation] = []
    per: dict[str, int] = {}
    for v in found:
        per[v.invariant] = per.get(v.invariant, 0) + 1
        if per[v.invariant] <= DETAILS_PER_INVARIANT_MAX:
            kept.append(v)
    return Verdict(tuple(kept))
