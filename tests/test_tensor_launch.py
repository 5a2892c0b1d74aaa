"""What each rank of an epoch with tensor groups is started with (core/tensor_launch.py through
agent/tasks/workers.py group_launch and worker_command): the WORKER CONTRACT's options
(--group-sizes, --shares, --side-listen/--side-next/--side-head) and one MLX group per tensor
group (MLX_RANK in the group, its own hostfile); a pipeline exactly as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pmesh.agent.tasks.workers import WorkersConfig, group_launch, worker_command
from p2pmesh.core import dataplane
from p2pmesh.core.dataplane import WantedWorker
from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Capabilities, ClusterState, Member, RingHop, Stage
from p2pmesh.core.mlx_hostfile import EPOCH_PORT_SLOTS, EPOCH_PORT_STRIDE, MlxConfigError, epoch_base_port
from p2pmesh.core.tensor_launch import SIDE_PORT_OFFSET, side_port

A, B, C, D = (NodeId(c * 32) for c in "abcd")
IP = {A: "127.0.0.2", B: "127.0.0.3", C: "127.0.0.4", D: "127.0.0.5"}
PORT = 30000
EPOCH = 7
MEMBERS = tuple(Member(n, 1, True, True, (f"{IP[n]}:7741",), Capabilities(0, "", PORT)) for n in (A, B, C, D))
CONFIG = WorkersConfig(A, Path("/nonexistent"), PORT)
SIDE = PORT + SIDE_PORT_OFFSET + EPOCH
MLX = epoch_base_port(PORT, EPOCH)


def _hops(stages: tuple[Stage, ...]) -> tuple[RingHop, ...]:
    """The epoch's committed hops as the leader computes them (dataplane.pipeline_hops)."""
    state = ClusterState("c", MEMBERS, 1, tuple(m.node_id for m in MEMBERS), ())
    return dataplane.pipeline_hops(state, stages)


def _launch(stages: tuple[Stage, ...], rank: int) -> tuple[list[str], dict[str, str], dict[str, str], str]:
    launch = group_launch(WantedWorker(EPOCH, "m", stages, rank), _hops(stages), PORT, MEMBERS)
    cmd = worker_command("m", [[s.start, s.end] for s in stages], rank, launch.backend, CONFIG, 1, launch.args)
    return cmd, launch.env, {k: json.loads(v) for k, v in launch.files.items()}, launch.backend


def _opts(cmd: list[str]) -> dict[str, str]:
    at = cmd.index("--stages")
    return {cmd[i]: cmd[i + 1] for i in range(at, len(cmd) - 1, 2)}


def test_the_side_port_is_above_every_epochs_mlx_ports() -> None:
    top = max(epoch_base_port(PORT, e) + EPOCH_PORT_STRIDE - 1 for e in range(EPOCH_PORT_SLOTS))
    ports = {side_port(A, MEMBERS, e, PORT) for e in range(EPOCH_PORT_SLOTS)}
    assert min(ports) > top and len(ports) == EPOCH_PORT_SLOTS  # an active and a pending epoch never share one


def test_a_two_mac_tensor_group() -> None:
    stages = (Stage(A, 0, 6, 2, 1, 64), Stage(B, 0, 6, 2, 1, 64))
    cmd, env, files, backend = _launch(stages, 0)
    o = _opts(cmd)
    assert json.loads(o["--stages"]) == [[0, 6], [0, 6]] and o["--rank"] == "0" and backend == "ring"
    assert json.loads(o["--group-sizes"]) == [2] and json.loads(o["--shares"]) == [[2, 1, 64], [2, 1, 64]]
    assert json.loads(o["--side-listen"]) == [f"{IP[A]}:{SIDE}"]  # where its member reaches it
    assert "--side-next" not in o and "--side-head" not in o  # one group: no hop between groups
    assert env == {"MLX_RANK": "0"} and files["hostfile"] == [[f"{IP[A]}:{MLX}"], [f"{IP[B]}:{MLX + 1}"]]
    cmd, env, files, _ = _launch(stages, 1)
    o = _opts(cmd)
    assert o["--side-head"] == f"{IP[A]}:{SIDE}" and "--side-listen" not in o
    assert env == {"MLX_RANK": "1"} and files["hostfile"] == [[f"{IP[A]}:{MLX}"], [f"{IP[B]}:{MLX + 1}"]]


def test_a_two_by_two_hybrid_has_one_mlx_group_per_tensor_group() -> None:
    stages = (Stage(A, 0, 3, 2, 1, 64), Stage(B, 0, 3, 2, 1, 64), Stage(C, 3, 6, 2, 1, 64), Stage(D, 3, 6, 2, 1, 64))
    seen = {}
    for rank in range(4):
        cmd, env, files, backend = _launch(stages, rank)
        o = _opts(cmd)
        assert json.loads(o["--group-sizes"]) == [2, 2] and o["--rank"] == str(rank) and backend == "ring"
        assert env == {"MLX_RANK": str(rank % 2)}  # its index in its own group
        seen[rank] = (o, files["hostfile"])
    # Group 0's ring is A, B; group 1's is C, D, each rank on its global rank's epoch port.
    assert seen[0][1] == seen[1][1] == [[f"{IP[A]}:{MLX}"], [f"{IP[B]}:{MLX + 1}"]]
    assert seen[2][1] == seen[3][1] == [[f"{IP[C]}:{MLX + 2}"], [f"{IP[D]}:{MLX + 3}"]]
    head0, head1 = seen[0][0], seen[2][0]
    assert json.loads(head0["--side-listen"]) == [f"{IP[A]}:{SIDE}"]  # from C (the previous head) and B
    assert head0["--side-next"] == f"{IP[C]}:{SIDE}" and head1["--side-next"] == f"{IP[A]}:{SIDE}"
    assert json.loads(head1["--side-listen"]) == [f"{IP[C]}:{SIDE}"]
    assert seen[1][0]["--side-head"] == f"{IP[A]}:{SIDE}" and seen[3][0]["--side-head"] == f"{IP[C]}:{SIDE}"


def test_a_mac_alone_in_a_hybrid_gets_no_mlx_group_but_the_side_channel() -> None:
    stages = (Stage(A, 0, 3), Stage(B, 3, 6, 2, 1, 64), Stage(C, 3, 6, 2, 1, 64))
    cmd, env, files, backend = _launch(stages, 0)
    o = _opts(cmd)
    assert env == {} and files == {} and backend == "ring"
    assert json.loads(o["--group-sizes"]) == [1, 2] and o["--side-next"] == f"{IP[B]}:{SIDE}"
    assert json.loads(o["--side-listen"]) == [f"{IP[A]}:{SIDE}"] and json.loads(o["--shares"])[0] == [0, 0, 0]


def test_a_pipeline_is_rendered_exactly_as_before() -> None:
    stages = (Stage(A, 0, 2), Stage(B, 2, 4), Stage(C, 4, 6))
    for rank in range(3):
        cmd, env, files, backend = _launch(stages, rank)
        assert not any(a.startswith(("--side", "--group-sizes", "--shares")) for a in cmd)
        assert env == {"MLX_RANK": str(rank)} and backend == "ring"
        assert files["hostfile"] == [[f"{IP[n]}:{MLX + i}"] for i, n in enumerate((A, B, C))]


def test_a_missing_hop_is_a_config_error_naming_it() -> None:
    stages = (Stage(A, 0, 6, 2, 1, 64), Stage(B, 0, 6, 2, 1, 64))
    with pytest.raises(MlxConfigError, match="no hop"):
        group_launch(WantedWorker(EPOCH, "m", stages, 1), _hops(stages)[:1], PORT, MEMBERS)
