"""Every Mac's copy or download of its stage's files, as status shows it (`transfers`).

Each agent's fetch task tells its core how many bytes of its stage's missing files have
arrived (node_io.FetchProgressed, at most twice a second). The core turns that into a
FetchReport (MB/s over the last RATE_WINDOW_MS, seconds left at that rate) and sends it to
every member: the cheapest honest carrier, like the serving head's LoadReport, since a
transfer lasts seconds to minutes and only the members' status and `watch` read it. Nothing
of it goes into the replicated log.

Sans I/O: ``now_ms`` is an argument. Bounded: one report per member (REPORTS_MAX in all), a
report older than STALE_MS says nothing (the Mac finished, died or left), and a node sends
at most one report per REPORT_MS (its last one, at the end, always goes out).
"""
from __future__ import annotations

from collections import deque

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import FetchReport

SOURCES = ("peer", "hub")
RATE_WINDOW_MS = 5_000
"""MB/s is over about the last 5 s of the byte counter."""
REPORT_MS = 500
"""A node sends its members at most one report per half second."""
STALE_MS = 3_000
"""A report older than this says nothing: the transfer ended (or its Mac went)."""
REPORTS_MAX = 64
SAMPLES_MAX = 64
HUB_FILES_MAX = 16
"""Files a report names as downloading from the hub (a Mac downloads one at a time)."""
HUB_FILE_CHARS_MAX = 1024


def report_problem(report: FetchReport) -> str | None:
    """Why a report from a member is nonsense (it is then dropped), or None."""
    if report.source not in SOURCES:
        return f"unknown source {report.source!r}"
    if not 0 <= report.bytes_done <= report.bytes_total:
        return "bytes_done is not within 0..bytes_total"
    if not report.mb_s >= 0 or (report.eta_s is not None and not report.eta_s >= 0):
        return "a negative (or NaN) rate or time left"
    if len(report.hub_files) > HUB_FILES_MAX or any(len(f) > HUB_FILE_CHARS_MAX for f in report.hub_files):
        return f"at most {HUB_FILES_MAX} hub files of at most {HUB_FILE_CHARS_MAX} characters"
    return None


class Transfers:
    """This node's own transfer and the latest report of each other member."""

    def __init__(self, me: NodeId) -> None:
        self.me = me
        self.reports: dict[NodeId, tuple[FetchReport, int]] = {}
        """node -> (its latest report, when it was made or heard)."""
        self._samples: deque[tuple[int, int]] = deque(maxlen=SAMPLES_MAX)
        """(ms, bytes done) of this node's transfer, for its rate."""
        self._source = ""
        self._sent_ms: int | None = None
        self._sent_hub_files: tuple[str, ...] = ()

    def local(self, source: str, done: int, total: int, now_ms: int,
              hub_files: tuple[str, ...] = ()) -> FetchReport | None:
        """This node's fetch task reported its bytes: the report to send to every member now,
        or None when one went out less than REPORT_MS ago (the next one carries it). A
        change of the files downloading from the hub goes out at once: another Mac may be
        about to download the same file."""
        done, total = max(0, done), max(0, total)
        done = min(done, total)
        samples = self._samples
        if source != self._source or (samples and done < samples[-1][1]):
            samples.clear()  # another transfer (a new stage, or the other source): a new rate
            self._source = source
        samples.append((now_ms, done))
        while len(samples) > 2 and now_ms - samples[1][0] >= RATE_WINDOW_MS:
            samples.popleft()  # keep one sample at or before the window's start
        first_ms, first = samples[0]
        rate = (done - first) * 1000 / (now_ms - first_ms) if now_ms > first_ms else 0.0  # bytes/s
        eta = round((total - done) / rate, 1) if rate > 0 else (0.0 if done >= total else None)
        hub_files = hub_files[:HUB_FILES_MAX]
        report = FetchReport(self.me, source, done, total, round(rate / 1e6, 1), eta, hub_files)
        self._put(self.me, report, now_ms)
        if (self._sent_ms is not None and now_ms - self._sent_ms < REPORT_MS and done < total
                and hub_files == self._sent_hub_files):
            return None
        self._sent_ms, self._sent_hub_files = now_ms, hub_files
        return report

    def heard(self, src: NodeId, report: FetchReport, now_ms: int) -> bool:
        """A member's report; False (dropped) when it speaks for another node or is nonsense."""
        if report.src != src or src == self.me or report_problem(report) is not None:
            return False
        self._put(src, report, now_ms)
        return True

    def _put(self, node: NodeId, report: FetchReport, now_ms: int) -> None:
        self.reports = {n: (r, at) for n, (r, at) in self.reports.items() if now_ms - at <= STALE_MS}
        if node not in self.reports and len(self.reports) >= REPORTS_MAX:
            return  # full of fresh reports: a larger cluster than status shows transfers for
        self.reports[node] = (report, now_ms)


def fresh(reports: dict[NodeId, tuple[FetchReport, int]], now_ms: int) -> list[FetchReport]:
    """The reports not older than STALE_MS, by node id (what status shows)."""
    return [r for n, (r, at) in sorted(reports.items()) if now_ms - at <= STALE_MS]


def hub_downloads(reports: dict[NodeId, tuple[FetchReport, int]], me: NodeId, now_ms: int) -> dict[str, NodeId]:
    """The files ("model: file") other members are downloading from the hub, by fresh
    reports: a report goes stale STALE_MS after its Mac stopped sending (finished or died)."""
    return {f: r.src for r in fresh(reports, now_ms) if r.src != me for f in r.hub_files}


def fetch_step(source: str, done: int, total: int) -> tuple[str, int]:
    """What a `fetch_progress` watch event is emitted on a change of (the client's watch
    and the dashboard's alike): the source and the tenth of the bytes done (10: all), so a
    transfer gives about a dozen events, not one per status."""
    return source, done * 10 // total if total > 0 else 10


def fetch_sentence(node: str, source: str, done: int, total: int, mb_s: float, eta_s: float | None) -> str:
    """A `fetch_progress` event's sentence."""
    where = "from the hub" if source == "hub" else "from the other Macs"
    if done >= total:
        return f"{node[:8]} has its stage's files ({total / 1e6:.1f} MB {where})"
    left = f"{eta_s:.0f} s left" if eta_s is not None else "time left unknown"
    return f"{node[:8]} fetching {where}: {done / 1e6:.1f} of {total / 1e6:.1f} MB, {mb_s:g} MB/s, {left}"
