"""A linearizability checker for the membership register, as the chaos tool observes it.

The register is a cluster's committed state, read through the control op ``members``. Every
committed entry is a write, and every read answers a version: the reader's applied index
(sim/observations.py ``MemberView``). Because each answer names its version, linearizability
needs no search over interleavings (what Knossos or Porcupine do for registers whose values
carry no version); it comes down to three checks, per cluster (a standalone or merged
cluster is another register: its reads name another cluster id):

- ``read-stale`` (real-time order): a read invoked after another read completed, or after
  a commit was acknowledged (a confirmed leave, or a log sample showing the index
  committed), answers a version no older;
- ``read-divergent`` (one value per version): two reads of the same version answer the
  same membership;
- ``read-sees-removed``: a read invoked after a confirmed leave completed does not list
  the incarnation that left.

Reads that failed are not judged here (their clearness is: sim/history.py). Pure: no I/O.
Times are compared strictly: an event at the very instant a read was invoked is not
"before" it.
"""
from __future__ import annotations

from sim.observations import Ack, LogSample, ReadOp, Violation

_START, _DONE = 0, 1
"""At equal times a read's start sorts before any completion: only what finished strictly
earlier binds it."""


def check_reads(reads: list[ReadOp], acks: list[Ack], samples: list[LogSample] = ()) -> list[Violation]:  # type: ignore[assignment]
    out: list[Violation] = []
    events: list[tuple[float, int, int, object]] = []
    for i, r in enumerate(reads):
        if r.view is None:
            continue
        events.append((r.invoke_s, _START, i, r))
        events.append((r.complete_s, _DONE, i, r))
    for i, a in enumerate(acks):
        events.append((a.at_s, _DONE, len(reads) + i, a))
    for i, s in enumerate(samples):
        # A sample is the agent's own answer: by the time it arrived, its commit was durable
        # on a majority, so a read invoked later must see at least that index.
        events.append((s.at_s, _DONE, len(reads) + len(acks) + i, Ack(s.at_s, s.cluster, s.commit)))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    floor: dict[str, tuple[int, str]] = {}
    """cluster -> (highest version completed so far, what completed it)."""
    removed: dict[str, dict[tuple[str, int], float]] = {}
    bound: dict[int, tuple[tuple[int, str], dict[tuple[str, int], float]]] = {}
    for at, phase, i, item in events:
        if phase == _START:
            assert isinstance(item, ReadOp) and item.view is not None
            c = item.view.cluster
            bound[i] = (floor.get(c, (0, "")), dict(removed.get(c, {})))
            continue
        if isinstance(item, ReadOp):
            assert item.view is not None
            c, version, why = item.view.cluster, item.view.index, f"a read at h{item.host} completed at {at:.2f}s"
            lower, gone = bound.pop(i)
            if version < lower[0]:
                out.append(Violation("read-stale", f"h{item.host} read invoked at {item.invoke_s:.2f}s answered index "
                                     f"{version} of cluster {c[:8]}, older than index {lower[0]} ({lower[1]})"))
            for node_id, inc, _, _ in item.view.members:
                if (node_id, inc) in gone:
                    out.append(Violation("read-sees-removed", f"h{item.host} read invoked at {item.invoke_s:.2f}s lists "
                                         f"{node_id[:8]}/{inc}, whose leave was confirmed at {gone[(node_id, inc)]:.2f}s"))
        else:
            assert isinstance(item, Ack)
            c, version, why = item.cluster, item.index, f"committed as acknowledged at {at:.2f}s"
            if item.removed is not None:
                removed.setdefault(c, {}).setdefault(item.removed, at)
        if version > floor.get(c, (0, ""))[0]:
            floor[c] = (version, why)
    values: dict[tuple[str, int], tuple[frozenset[tuple[str, int, bool, bool]], ReadOp]] = {}
    for r in reads:
        if r.view is None:
            continue
        first = values.setdefault((r.view.cluster, r.view.index), (r.view.members, r))
        if first[0] != r.view.members:
            out.append(Violation("read-divergent", f"index {r.view.index} of cluster {r.view.cluster[:8]}: h{first[1].host} "
                                 f"and h{r.host} answered different memberships"))
    return out
