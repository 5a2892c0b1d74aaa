"""The README's main job, `scripts/demo`, run for real: three agent processes, the shipped
model (scripts/demo_model), a Mac killed mid-generation and restarted; the demo exits 0 only
when every generation is identical, and it leaves no agent or directory behind."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.agent.harness import ROOT

pytestmark = pytest.mark.timeout(300)


def test_the_demo_survives_a_dead_mac_and_cleans_up() -> None:
    model = ROOT / "scripts" / "demo_model"
    assert (model / "config.json").is_file(), "the demo model is shipped in the repository"
    r = subprocess.run([sys.executable, "scripts/demo.py"], cwd=ROOT, capture_output=True, text=True, timeout=280,
                       env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "the generation that lost a Mac: identical to the first" in out
    assert "the generation after the rejoin: identical to the first" in out
    assert "[killed]" in out
    # The watch saw the killed Mac go down (printed live, and summed up at the end).
    assert re.search(r"events seen while the Mac was away and back: .*member_down x\d", out), out[-3000:]
    assert "is down" in out, out[-3000:]
    resumed = re.search(r"(\d+) request\(s\) resumed", out)
    assert resumed and int(resumed.group(1)) >= 1, out[-2000:]
    leftover = subprocess.run(["pgrep", "-f", "p2pmesh-demo-"], capture_output=True, text=True, timeout=10)
    assert leftover.stdout.strip() == "", "agents left running"
