"""wire.digest: the fingerprint the chaos tool compares committed entries by, across agents
and the simulator (scripts/chaos.py, sim/history.py)."""
from __future__ import annotations

import subprocess
import sys

from p2pmesh.core import wire
from p2pmesh.core.messages import Put, RemoveMember


def test_equal_values_have_equal_digests_and_different_ones_differ() -> None:
    a = wire.digest(Put("k", "v"))
    assert a == wire.digest(Put("k", "v")) and len(a) == 16 and int(a, 16) >= 0
    assert a != wire.digest(Put("k", "w"))
    assert wire.digest(RemoveMember("n" * 32, 1, "left")) != wire.digest(RemoveMember("n" * 32, 2, "left"))


def test_the_digest_is_the_same_in_another_process() -> None:
    code = "from p2pmesh.core import wire; from p2pmesh.core.messages import Put; print(wire.digest(Put('k', 'v')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == wire.digest(Put("k", "v"))
