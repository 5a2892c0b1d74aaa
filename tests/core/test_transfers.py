"""core/transfers.py: each Mac's fetch progress as its members see it (MB/s, seconds left,
at most one report per REPORT_MS, stale reports gone), on explicit time."""
from __future__ import annotations

import math

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import FetchReport
from p2pmesh.core.transfers import (HUB_FILES_MAX, REPORT_MS, REPORTS_MAX, STALE_MS, Transfers, fresh, hub_downloads,
                                    report_problem)

ME, PEER = NodeId("me"), NodeId("peer")
MB = 1_000_000


def test_rate_and_time_left_from_the_byte_counter_and_reports_at_most_twice_a_second() -> None:
    t = Transfers(ME)
    first = t.local("peer", 0, 100 * MB, 0)
    assert first == FetchReport(ME, "peer", 0, 100 * MB, 0.0, None)  # no rate yet: no ETA
    assert t.local("peer", 10 * MB, 100 * MB, REPORT_MS // 2) is None  # too soon: kept, not sent
    report = t.local("peer", 20 * MB, 100 * MB, 1000)
    assert report == FetchReport(ME, "peer", 20 * MB, 100 * MB, 20.0, 4.0)  # 20 MB in 1 s, 80 MB left
    assert fresh(t.reports, 1000) == [report]  # its own, in status as well
    end = t.local("peer", 100 * MB, 100 * MB, 1100)  # the end always goes out
    assert end is not None and end.bytes_done == end.bytes_total and end.eta_s == 0.0
    # Another transfer (the hub this time) starts its rate again.
    assert t.local("hub", 0, 50 * MB, 2000) == FetchReport(ME, "hub", 0, 50 * MB, 0.0, None)


def test_members_reports_are_checked_kept_per_node_and_forgotten_when_stale() -> None:
    t = Transfers(ME)
    good = FetchReport(PEER, "hub", 5, 10, 1.5, 3.3)
    assert t.heard(PEER, good, 0) and fresh(t.reports, STALE_MS) == [good]
    assert fresh(t.reports, STALE_MS + 1) == []  # its Mac finished, died or left
    assert not t.heard(ME, FetchReport(ME, "hub", 1, 2, 0.0, None), 0)  # nobody speaks for us
    assert not t.heard(PEER, FetchReport(NodeId("x"), "hub", 1, 2, 0.0, None), 0)  # nor for another
    for bad in (FetchReport(PEER, "ftp", 1, 2, 0.0, None), FetchReport(PEER, "peer", 3, 2, 0.0, None),
                FetchReport(PEER, "peer", -1, 2, 0.0, None), FetchReport(PEER, "peer", 1, 2, -1.0, None),
                FetchReport(PEER, "peer", 1, 2, math.nan, None), FetchReport(PEER, "peer", 1, 2, 1.0, -5.0)):
        assert report_problem(bad) is not None and not t.heard(PEER, bad, 0)
    # Bounded: one report per node, REPORTS_MAX nodes.
    for i in range(REPORTS_MAX + 5):
        n = NodeId(f"n{i:03d}")
        t.heard(n, FetchReport(n, "peer", 0, 1, 0.0, None), 10_000)
    assert len(t.reports) == REPORTS_MAX


def test_the_files_a_mac_downloads_from_the_hub_go_out_at_once_and_name_their_downloader() -> None:
    """Another Mac about to download the same file waits for this one (hub_share.py): a
    change of those files is sent at once, not held back by REPORT_MS."""
    t = Transfers(ME)
    assert t.local("hub", 0, 100 * MB, 0) is not None
    assert t.local("hub", MB, 100 * MB, 100) is None  # bytes alone: held back
    started = t.local("hub", 2 * MB, 100 * MB, 200, ("m: w1",))
    assert started is not None and started.hub_files == ("m: w1",)  # a new file: sent now
    assert t.local("hub", 3 * MB, 100 * MB, 300, ("m: w1",)) is None
    assert t.local("hub", 4 * MB, 100 * MB, 400, ()) is not None  # it ended: sent now
    heard = Transfers(PEER)
    assert heard.heard(ME, started, 1000)
    assert hub_downloads(heard.reports, PEER, 1000) == {"m: w1": ME}
    assert hub_downloads(heard.reports, PEER, 1000 + STALE_MS + 1) == {}  # its Mac went quiet: nobody
    assert hub_downloads(t.reports, ME, 400) == {}  # never this Mac's own
    many = FetchReport(PEER, "hub", 1, 2, 0.0, None, tuple(f"m: w{i}" for i in range(HUB_FILES_MAX + 1)))
    assert report_problem(many) is not None
    assert report_problem(FetchReport(PEER, "hub", 1, 2, 0.0, None, ("m: " + "x" * 5000,))) is not None
