"""Real pipeline workers (`python -m p2pmesh.worker.serve`), one process per rank, on a
loopback MLX ring: what the agent does, minus the agent. Used by the tests and by
scripts/bench_pipeline.py. With `group_sizes` (a tensor or hybrid plan, issue 16): one
loopback MLX ring per tensor group of two or more, and the side channel's addresses
(--side-listen for each group's head, --side-next between heads, --side-head for members).

Every wait has a deadline and `close()` kills whatever is still running; the caller puts
it in a `finally`. Each rank's stdout is parsed by a reader thread into a queue of events;
stderr goes to a file that failures quote.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from p2pmesh.core.mlx_hostfile import loopback_hostfile
from tests.worker.test_mlx_ring import free_port_run

ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 90.0
"""The workers' own watchdog for forming the group and loading."""
KILL_WAIT_S = 5.0


class ClusterError(AssertionError):
    """A worker did not do what the protocol says within its deadline."""


class Cluster:
    def __init__(self, model: Path, stages: list[list[int]], workdir: Path, extra: list[str] | None = None,
                 *, timestamps: bool = False, root: Path = ROOT, group_sizes: list[int] | None = None) -> None:
        self.model, self.stages, self.workdir = model, stages, workdir
        self.group_sizes = group_sizes
        self.root = root  # the checkout whose worker runs (a benchmark compares two)
        self.timestamps = timestamps  # add "_t" = time.monotonic() on arrival to every event (the benchmark's clock)
        self.extra = extra or []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.events: list[queue.Queue[dict[str, Any]]] = []
        self.heartbeats = [0] * len(stages)
        self.head_beat: dict[str, Any] = {}
        """Rank 0's latest heartbeat (its batch load)."""
        self.errs = [workdir / f"rank{r}.err" for r in range(len(stages))]

    @property
    def size(self) -> int:
        return len(self.stages)

    def _ranks(self, env: dict[str, str]) -> list[tuple[dict[str, str], list[str]]]:
        """Each rank's environment and extra options."""
        sizes = self.group_sizes or [1] * self.size
        if max(sizes) == 1:  # a pipeline: one ring of every rank
            if self.size < 2:
                return [(env, [])]
            hostfile = self.workdir / "hostfile.json"
            hostfile.write_text(json.dumps(loopback_hostfile(self.size, free_port_run(self.size))), encoding="utf-8")
            return [({**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)}, []) for r in range(self.size)]
        base = free_port_run(self.size + len(sizes))
        side = [base + self.size + g for g in range(len(sizes))]
        out = []
        for g, n in enumerate(sizes):
            first = sum(sizes[:g])
            if n >= 2:
                hostfile = self.workdir / f"hostfile{g}.json"
                hostfile.write_text(json.dumps(loopback_hostfile(n, base + first)), encoding="utf-8")
            for i in range(n):
                opts = ["--group-sizes", json.dumps(sizes)]
                if i:
                    opts += ["--side-head", f"127.0.0.1:{side[g]}"]
                else:
                    opts += ["--side-listen", json.dumps([f"127.0.0.1:{side[g]}"])]
                    if len(sizes) >= 2:
                        opts += ["--side-next", f"127.0.0.1:{side[(g + 1) % len(sizes)]}"]
                out.append(({**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(i)} if n >= 2 else env, opts))
        return out

    def start(self) -> Cluster:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("MLX_RANK", None)
        env.pop("MLX_HOSTFILE", None)
        for rank, (rank_env, opts) in enumerate(self._ranks(env)):
            cmd = [sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(self.model), "--stages",
                   json.dumps(self.stages), "--rank", str(rank), "--timeout-s", str(WORKER_TIMEOUT_S), *opts, *self.extra]
            with self.errs[rank].open("wb") as err:
                proc = subprocess.Popen(cmd, cwd=self.root, env=rank_env, stdout=subprocess.PIPE, stderr=err,
                                        stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL)
            self.procs.append(proc)
            q: queue.Queue[dict[str, Any]] = queue.Queue()
            self.events.append(q)
            threading.Thread(target=self._read, args=(rank, proc, q), daemon=True).start()
        return self

    def _read(self, rank: int, proc: subprocess.Popen[bytes], q: queue.Queue[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                event = {"event": "raw", "line": raw.decode(errors="replace")}
            if self.timestamps:
                event["_t"] = time.monotonic()
            if event.get("event") == "heartbeat":
                self.heartbeats[rank] += 1
                if rank == 0:
                    self.head_beat = event
            else:
                q.put(event)
        q.put({"event": "eof"})

    def wait_head_beat(self, predicate: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        """Rank 0's first heartbeat (from now on) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout_s
        seen = self.head_beat
        while time.monotonic() < deadline:
            beat = self.head_beat
            if beat is not seen and predicate(beat):
                return beat
            time.sleep(0.05)
        raise ClusterError(f"rank 0: no heartbeat like that within {timeout_s:g} s (last: {self.head_beat})\n{self.stderrs()}")

    def next_event(self, rank: int, deadline: float) -> dict[str, Any]:
        try:
            return self.events[rank].get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise ClusterError(f"rank {rank}: no event before the deadline\n{self.stderrs()}") from None

    def wait_ready(self, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        ready = []
        for rank in range(self.size):
            event = self.next_event(rank, deadline)
            if event.get("event") != "ready":
                raise ClusterError(f"rank {rank}: expected ready, got {event}\n{self.stderrs()}")
            ready.append(event)
        return ready

    def send(self, command: dict[str, Any] | str) -> None:
        assert self.procs[0].stdin is not None
        line = command if isinstance(command, str) else json.dumps(command)
        self.procs[0].stdin.write(line.encode() + b"\n")
        self.procs[0].stdin.flush()

    def request(self, command: dict[str, Any], timeout_s: float = 120.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send a generate command; return its token events and its final event (done or error)."""
        self.send(command)
        deadline = time.monotonic() + timeout_s
        tokens = []
        while True:
            event = self.next_event(0, deadline)
            if event.get("id") != command.get("id") or event["event"] not in ("token", "done", "error"):
                raise ClusterError(f"unexpected event {event} while serving {command.get('id')}\n{self.stderrs()}")
            if event["event"] == "token":
                tokens.append(event)
            else:
                return tokens, event

    def generate(self, command: dict[str, Any], timeout_s: float = 120.0) -> list[int]:
        tokens, final = self.request(command, timeout_s)
        if final["event"] != "done":
            raise ClusterError(f"request {command.get('id')} failed: {final}\n{self.stderrs()}")
        return [t["token"] for t in tokens]

    def shutdown(self, timeout_s: float = 60.0) -> list[int]:
        """{"op": "shutdown"}, close stdin, and every rank's exit code."""
        self.send({"op": "shutdown"})
        assert self.procs[0].stdin is not None
        self.procs[0].stdin.close()
        return self.wait_exit(timeout_s)

    def wait_exit(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        codes = []
        for rank, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise ClusterError(f"rank {rank} still running after {timeout_s} s\n{self.stderrs()}") from None
        return codes

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass

    def cpu_s(self) -> list[float] | None:
        """Each rank's CPU seconds so far (user + system; Linux's /proc), None elsewhere."""
        try:
            out = []
            for proc in self.procs:
                with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
            return out
        except (OSError, ValueError, IndexError):
            return None

    def stderrs(self) -> str:
        return "\n".join(f"--- rank {i} stderr:\n{p.read_text(errors='replace')[-3000:]}" for i, p in enumerate(self.errs) if p.exists())
