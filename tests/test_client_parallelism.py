"""The --parallelism contract on the client side (issue 16): `p2pmesh load`/`model set`
--parallelism and client.load()/set_model(parallelism=) carry it in the model op (sync and
async clients share one plan), a refusal is BadRequest with its code, and status's placement
`parallelism` and `groups` reach the typed values. The agent is a scripted Unix socket; the
agent's own checks run against real agents in tests/agent/test_tensor_loopback.py."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import p2pmesh
from tests.agent.harness import ROOT
from tests.fixtures.control_socket import control_sockets, scripted  # noqa: F401 (a fixture)

A, B = "a" * 32, "b" * 32
PLACEMENT = {"epoch": 3, "model": "m", "serving": True, "batch": 1, "batch_asked": 1, "parallelism": "tensor",
             "parallelism_asked": "tensor",
             "stages": [{"node_id": A, "layers": [0, 4]}, {"node_id": B, "layers": [0, 4]}],
             "groups": [{"node_ids": [A, B], "layers": [0, 4],
                         "shares": [{"node_id": A, "heads": 2, "kv_heads": 1, "columns": 64},
                                    {"node_id": B, "heads": 2, "kv_heads": 1, "columns": 64}]}]}
STATUS = {"node_id": A, "pid": 1, "cluster_id": "c1", "role": "leader", "term": 1, "leader": A, "commit_index": 3,
          "applied_index": 3, "healthy": True, "members": [], "placement": PLACEMENT}
MODEL = {"name": "m", "layers": 4, "layer_bytes": 10, "context_tokens": 64, "batch": 1, "parallelism": "tensor"}


@pytest.fixture
def agent(control_sockets: Any) -> Callable[[list[dict[str, Any]] | None], Path]:
    """A fake agent that records every request; the model op gets `refusal` if given."""
    def start(seen: list[dict[str, Any]], refusal: dict[str, Any] | None = None) -> Path:
        def answer(request: dict[str, Any]) -> list[dict[str, Any]]:
            seen.append(request)
            if request["op"] == "status":
                return [{"ok": True, "status": STATUS}]
            return [refusal or {"ok": True, "model": MODEL}]
        return control_sockets(scripted(answer)).path
    return start  # type: ignore[return-value]


def test_load_sends_the_parallelism_and_returns_the_groups_sync_and_async(agent: Any) -> None:
    seen: list[dict[str, Any]] = []
    path = agent(seen)
    loaded = p2pmesh.Client(path, quorum_timeout=2).load("m", context_tokens=64, parallelism="tensor", timeout=10)
    models = [r for r in seen if r["op"] == "model"]
    assert models and all(r["parallelism"] == "tensor" for r in models)
    p = loaded.placement
    assert p.parallelism == "tensor" and p.parallelism_asked == "tensor"
    assert p.groups == (p2pmesh.GroupInfo((A, B), 0, 4, (p2pmesh.ShareInfo(A, 2, 1, 64), p2pmesh.ShareInfo(B, 2, 1, 64))),)
    seen.clear()

    async def main() -> p2pmesh.ModelInfo | None:
        return await p2pmesh.AsyncClient(path, quorum_timeout=2).set_model("m", context_tokens=64, parallelism="hybrid")

    info = trio.run(main)
    assert info is not None and info.parallelism == "tensor"  # as the agent described it
    assert [r.get("parallelism") for r in seen if r["op"] == "model"] == ["hybrid"]


def test_the_default_asks_nothing_new(agent: Any) -> None:
    seen: list[dict[str, Any]] = []
    p2pmesh.Client(agent(seen), quorum_timeout=2).set_model("m", context_tokens=64)
    assert [r for r in seen if r["op"] == "model"] == [{"op": "model", "name": "m", "context_tokens": 64}]


def test_a_refused_parallelism_is_bad_request_with_its_code(agent: Any) -> None:
    refusal = {"ok": False, "code": "bad_request", "error": "parallelism is one of auto, pipeline, tensor, hybrid",
               "param": "parallelism"}
    with pytest.raises(p2pmesh.BadRequest) as info:
        p2pmesh.Client(agent([], refusal), quorum_timeout=2).set_model("m", context_tokens=64, parallelism="sideways")
    assert info.value.error_code == "bad_request" and "parallelism" in str(info.value)


def test_the_cli_refuses_an_unknown_parallelism_before_asking_the_agent(tmp_path: Path) -> None:
    for cmd in (["load", "m"], ["model", "set", "m"]):
        r = subprocess.run([sys.executable, "-m", "p2pmesh", *cmd, "--parallelism", "sideways", "--state-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--parallelism" in r.stderr and "tensor" in r.stderr, r.stderr


def test_the_human_status_shows_the_groups() -> None:
    from p2pmesh.cli.terminal import placement_text

    text = placement_text(PLACEMENT).plain
    assert "tensor" in text and "group 0:" in text and "layers 0-3" in text and "stage 1" not in text
    pipeline = {**PLACEMENT, "parallelism": "pipeline", "parallelism_asked": "auto", "groups": []}
    assert "stage 1:" in placement_text(pipeline).plain
