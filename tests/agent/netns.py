"""The namespace bench (p2pmesh/cli/netns.py) for tests: skip without root outside CI, fail in
CI where these tests must run; agents started inside the bench's hosts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2pmesh.cli import netns
from p2pmesh.cli.netns import Cable, ip  # noqa: F401 - re-exported for the tests
from tests.agent.harness import AgentProc


def require_root() -> None:
    why = netns.usable()
    if why is not None:
        if os.environ.get("CI"):
            raise AssertionError(f"namespace tests must run in CI: {why}")
        pytest.skip(f"{why}; CI runs these")


class Bench(netns.Bench):
    def agents(self, root: Path, key: Path, tag: str = "n") -> list[AgentProc]:
        """One (not yet started) agent per host, state under ``root``. ":7741" binds every
        address inside the host's own namespace (its cables only), so links plugged later
        are served without a restart."""
        out = []
        for i in range(len(self.hosts)):
            state = root / f"{tag}{i}"
            state.mkdir(exist_ok=True)
            out.append(AgentProc(state, "", key_file=key, extra=[], prefix=self.exec_prefix(i), listens=[":7741"]))
        return out
