"""The state directory holds the wal, the cluster key and the control socket: it is closed
to other users even when something else made it first (`key set` under a loose umask), but
a shared sticky directory such as /tmp is never touched."""
from __future__ import annotations

import stat
from pathlib import Path

from p2pmesh.drivers.keys import write_key
from p2pmesh.drivers.storage import Storage


def test_a_loose_state_directory_is_tightened_on_open(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    Storage.open(state).close()
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_key_set_before_the_first_start_makes_a_private_directory(tmp_path: Path) -> None:
    write_key(tmp_path / "fresh" / "cluster.key", bytes(range(32)))
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700


def test_a_sticky_shared_directory_is_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    Storage.open(shared).close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
