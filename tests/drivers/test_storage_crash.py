"""Real process crashes: a child process saves a stream of Readies and is SIGKILLed.

The child (storage_stream.py run as a script) saves the deterministic stream
ready_stream(STREAM_SEED) into one state directory and prints "ack K" after save K
returned. The parent kills it at a seeded random moment, opens the directory and loads it.
Because a save is atomic, what loads must equal sim.disk.SimDisk fed the first K Readies
(K the last acknowledgment), or the first K+1 (the save in flight had landed but was not
acknowledged yet): nothing acknowledged is lost, nothing is half there, no torn tail stops
a restart. The next child resumes the stream from what loaded, in the same directory, so
later runs also start from cut torn tails and rewritten wals.

A SIGKILL practically never lands inside one write() on Linux, so real torn tails are rare
here. When the save in flight landed as an appended batch, the parent therefore tears that
batch at a random byte (what a crash inside its write leaves) and checks the directory
then loads exactly the acknowledged saves; the next child continues after the cut tail.
"""
from __future__ import annotations

import itertools
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from p2pmesh.core.machine import PersistedState, Ready
from p2pmesh.drivers import records, storage
from p2pmesh.drivers.storage import WAL_FILE, Storage
from sim.disk import SimDisk
from tests.drivers.storage_stream import ready_stream

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("storage_stream.py")
RUNS = 30
KILL_SEED = 20_251_202
STREAM_SEED = 11
REWRITE_MIN_BYTES = 16 * 1024
"""Small, so that size-triggered rewrites happen (and get killed) too."""
KILL_AFTER_OPEN_S_MAX = 0.25
KILL_AFTER_SPAWN_S = (0.05, 0.5)
"""Every fifth run is killed this long after spawning, which may fall before or during
Storage.open (cutting a torn tail) instead of during saves."""
CHILD_TIMEOUT_S = 15.0


class _States:
    """SimDisk's loaded state after the first k Readies of the stream, for any k."""

    def __init__(self, seed: int) -> None:
        self._stream: Iterator[Ready] = ready_stream(seed)
        self._disk = SimDisk()
        self._states: list[PersistedState | None] = [None]

    def at(self, k: int) -> PersistedState | None:
        while len(self._states) <= k:
            self._disk.write(next(self._stream))
            self._disk.sync()
            self._states.append(self._disk.load())
        return self._states[k]


def _run_and_kill(state_dir: Path, start: int, rng: random.Random, wait_for_open: bool) -> tuple[list[int], bytes, int | None]:
    """Run a child from Ready ``start``; kill it; return its acknowledgments."""
    cmd = [sys.executable, str(CHILD), str(state_dir), str(STREAM_SEED), str(start), str(REWRITE_MIN_BYTES)]
    # Unbuffered, so reading the "open" line consumes nothing beyond it.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    first = b""
    try:
        assert proc.stdout is not None
        if wait_for_open:
            readable, _, _ = select.select([proc.stdout], [], [], CHILD_TIMEOUT_S)
            assert readable, "the child did not open the storage in time"
            first = proc.stdout.readline()
            time.sleep(rng.uniform(0, KILL_AFTER_OPEN_S_MAX))
        else:
            time.sleep(rng.uniform(*KILL_AFTER_SPAWN_S))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=CHILD_TIMEOUT_S)
    lines = (first + out).split(b"\n")[:-1]  # the last piece is a partial line or empty
    assert proc.returncode == -signal.SIGKILL, f"child exited with {proc.returncode}: {err.decode(errors='replace')}"
    assert b"done" not in lines, "the child ran out of Readies before it was killed"
    if wait_for_open:
        assert lines[:1] == [b"open"], (lines[:3], err)
    acks = [int(line.split()[1]) for line in lines if line.startswith(b"ack ")]
    return acks, err, proc.returncode


def _last_batch_start(wal: Path) -> int | None:
    """Where the wal's last batch starts, if the wal holds more than one batch (a rewrite
    leaves exactly one, and tearing that would undo an atomic rename, not a write)."""
    _, found = storage.scan_wal(wal.read_bytes(), wal, torn_tail_ok=False)
    ends = [r for r in found[:-1] if r.end]  # END records before the final one (after the format record)
    if not ends:
        return None
    last_end = ends[-1]
    return last_end.offset + records.HEADER_BYTES + len(last_end.payload)


def test_sigkill_never_loses_an_acknowledged_save(tmp_path: Path) -> None:
    rng = random.Random(KILL_SEED)
    states = _States(STREAM_SEED)
    state_dir = tmp_path / "state"
    durable = 0
    outcomes: Counter[str] = Counter()
    for run in range(RUNS):
        acks, err, _ = _run_and_kill(state_dir, durable, rng, wait_for_open=run % 5 != 4)
        assert acks == list(range(durable + 1, durable + 1 + len(acks))), "acknowledgments out of order"
        acked = acks[-1] if acks else durable
        with Storage.open(state_dir) as st:
            loaded = st.load()
        if loaded == states.at(acked):
            durable = acked
            outcomes["exactly the acknowledged saves"] += 1
        elif loaded == states.at(acked + 1):
            durable = acked + 1
            outcomes["plus the unacknowledged save in flight"] += 1
            wal = state_dir / WAL_FILE
            start = _last_batch_start(wal)
            if start is not None:
                data = wal.read_bytes()
                wal.write_bytes(data[: rng.randrange(start, len(data))])
                with Storage.open(state_dir) as st:
                    assert st.load() == states.at(acked), f"run {run}: a torn unacknowledged batch was not dropped"
                durable = acked
                outcomes["in flight, then torn by the parent"] += 1
        else:
            expected = states.at(acked)
            raise AssertionError(
                f"run {run}: after ack {acked} the directory loads neither state {acked} nor {acked + 1}\n"
                f"loaded hard {loaded and loaded.hard}, snapshot {loaded and loaded.snapshot.index}, "
                f"entries {loaded and [e.index for e in loaded.entries][-5:]}\n"
                f"expected hard {expected and expected.hard}, snapshot {expected and expected.snapshot.index}, "
                f"entries {expected and [e.index for e in expected.entries][-5:]}\nchild stderr: {err.decode(errors='replace')}"
            )
        acked_state = states.at(acked)
        if loaded is not None and acked_state is not None and loaded.hard.inc == acked_state.hard.inc:
            assert loaded.hard.term >= acked_state.hard.term, f"run {run}: term went back"
    # The test must have exercised something: many saves, and snapshots/rewrites among them.
    assert durable >= 200 and outcomes["in flight, then torn by the parent"] >= 3, (durable, outcomes)
    kinds = Counter(
        "snapshot" if r.snapshot is not None else "truncate" if r.log_truncate_from is not None else "hard"
        for r in itertools.islice(ready_stream(STREAM_SEED), durable)
    )
    assert kinds["snapshot"] >= 10 and kinds["truncate"] >= 100, kinds
