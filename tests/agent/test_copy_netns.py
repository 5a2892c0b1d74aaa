"""scripts/bench_copy.py --netns-cables 2: one file striped over two veth cables between two
network namespaces (scripts/copy_netns.py) arrives whole (the bench checks every byte of
each copy) and the bench ends with its figures as one JSON line. Speeds are the bench's to
report (docs/benchmarks.md), not asserted here. Needs root (skipped with the reason
otherwise; CI runs it)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.agent.harness import ROOT
from tests.agent.netns import require_root


def test_one_file_striped_over_two_veth_cables_arrives_whole_and_is_reported() -> None:
    require_root()
    r = subprocess.run([sys.executable, "scripts/bench_copy.py", "--netns-cables", "2", "--cable-mbit", "2000",
                        "--mib", "8", "--runs", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["cables"] == 2 and figures["cable_mbit"] == 2000 and figures["bytes"] == 8 << 20
    for key in ("tcp_1_cable_mb_s", "copy_1_cable_mb_s", "copy_2_cables_mb_s", "ratio_to_1_cable_tcp"):
        assert figures[key] > 0, (key, figures)
    assert "striped over 2 cables" in r.stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert "p2pc" not in listed  # the bench's namespaces are gone
