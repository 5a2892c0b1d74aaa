"""Real tensor-group workers (`python -m p2pmesh.worker.tensor_run`) on loopback: one process
per rank, one MLX ring (hostfile) per group of two or more, TCP hops between the groups'
rank 0s. Used by tests/worker/test_tensor.py and scripts/bench_tensor.py.

Every wait has one deadline and every process is killed in a `finally`; a failure quotes
each rank's stderr.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pmesh.core.mlx_hostfile import loopback_hostfile
from tests.worker.test_mlx_ring import free_port_run

ROOT = Path(__file__).resolve().parents[2]
KILL_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Layers [start, end) on `size` ranks; shares as --shares takes them (None: even)."""
    start: int
    end: int
    size: int
    shares: list[list[int]] | None = None


class TensorRunError(AssertionError):
    """A rank failed or did not finish before the deadline."""


def run_plan(model: Path, groups: list[GroupPlan], prompt: list[int], max_tokens: int, workdir: Path,
             *, repeat: int = 1, timeout_s: float = 180.0, cpus: Sequence[int] = ()) -> list[list[dict[str, Any]]]:
    """Each group's ranks' final JSON lines, in group and rank order. cpus: rank r of every
    group runs on cpus[r % len(cpus)] only (tensor_run --cpu; none: wherever Linux puts it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLX_RANK", None)
    env.pop("MLX_HOSTFILE", None)
    total = sum(g.size for g in groups) + (2 * len(groups) if len(groups) > 1 else 0)
    ports = iter(range(free_port_run(total), 1 << 16))
    hostfiles = []
    for gi, g in enumerate(groups):
        if g.size > 1:
            path = workdir / f"hostfile{gi}.json"
            path.write_text(json.dumps(loopback_hostfile(g.size, next(ports))), encoding="utf-8")
            for _ in range(g.size - 1):
                next(ports)
            hostfiles.append(path)
        else:
            hostfiles.append(None)
    hop_ports = [next(ports) for _ in groups] if len(groups) > 1 else []
    fan_ports = [next(ports) for _ in groups] if len(groups) > 1 else []
    procs: list[tuple[int, int, subprocess.Popen[bytes], Path]] = []
    try:
        for gi, g in enumerate(groups):
            for rank in range(g.size):
                cmd = [sys.executable, "-m", "p2pmesh.worker.tensor_run", "--model", str(model),
                       "--layers", str(g.start), str(g.end), "--group", str(gi), str(len(groups)),
                       "--prompt-ids", json.dumps(prompt), "--max-tokens", str(max_tokens), "--repeat", str(repeat),
                       "--timeout-s", str(timeout_s - 10)]
                if g.shares is not None:
                    cmd += ["--shares", json.dumps(g.shares)]
                if cpus:
                    cmd += ["--cpu", str(cpus[rank % len(cpus)])]
                if hop_ports:
                    cmd += ["--hop-fan", f"127.0.0.1:{fan_ports[gi]}"]
                    if rank == 0:
                        cmd += ["--hop-listen", str(hop_ports[gi]), "--hop-next", f"127.0.0.1:{hop_ports[(gi + 1) % len(groups)]}"]
                rank_env = dict(env)
                if hostfiles[gi] is not None:
                    rank_env |= {"MLX_HOSTFILE": str(hostfiles[gi]), "MLX_RANK": str(rank)}
                err = workdir / f"g{gi}r{rank}.err"
                with err.open("wb") as f:
                    procs.append((gi, rank, subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=subprocess.PIPE, stderr=f), err))
        deadline = time.monotonic() + timeout_s
        out: list[list[dict[str, Any]]] = [[] for _ in groups]
        for gi, rank, proc, _ in procs:
            try:
                stdout, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TensorRunError(f"group {gi} rank {rank} still running after {timeout_s} s\n{_stderrs(procs)}") from None
            lines = stdout.decode(errors="replace").strip().splitlines()
            if proc.returncode != 0 or not lines:
                raise TensorRunError(f"group {gi} rank {rank} exited {proc.returncode}: {lines[-1:]}\n{_stderrs(procs)}")
            out[gi].append(json.loads(lines[-1]))
        return out
    finally:
        for _, _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        for _, _, proc, _ in procs:
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass


def _stderrs(procs: list[tuple[int, int, subprocess.Popen[bytes], Path]]) -> str:
    return "\n".join(f"--- group {gi} rank {r} stderr:\n{err.read_text(errors='replace')[-2500:]}"
                     for gi, r, _, err in procs if err.exists())
