"""Tensor groups with real agents on loopback (issue 16): two agents, a tiny model with its
shape, `p2pmesh load --parallelism tensor`:

- status shows parallelism "tensor" and one group of both Macs, and a generation gives the
  greedy tokens of one plain mlx-lm process, as the same agents do with --parallelism pipeline;
- the non-head rank's worker, then the head rank's, SIGKILLed mid-generation: each time the
  cluster re-plans (a new epoch) and the request completes with the same greedy tokens;
- a parallelism the agent does not know, or tensor for a model without its shape, is refused
  with bad_request before anything is committed.

Auto would rightly not pick tensor here (loopback all-reduces cost more than they save), so
the test forces it, as the issue's contract allows.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import AgentProc, ROOT, formed_cluster, make_model, wait_for
from tests.agent.test_inference_loopback import CONTEXT, PROMPT, _agents, _generate, _references

FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 120
LAYERS = 4
TOKENS = 160


@pytest.fixture(scope="module")
def shaped_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Slow enough per token that a worker can be killed mid-stream; heads that split in two."""
    out = tmp_path_factory.mktemp("model") / "tiny-llama-shaped"
    make_model(out, family="llama", layers=LAYERS, hidden=512, heads=8, kv_heads=4, intermediate=1024, seed=5)
    return out


def _status(a: AgentProc) -> dict[str, Any]:
    s = a.status()
    assert s is not None
    return s


def _serving_as(a: AgentProc, kinds: tuple[str, ...]) -> dict[str, Any] | None:
    p = (a.status() or {}).get("placement")
    if not p or not p["serving"] or "pending" in p or p.get("parallelism") not in kinds:
        return None
    return p


def _load(a: AgentProc, model: Path, parallelism: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "load", str(model), "--context-tokens", str(CONTEXT), "--json",
                        "--parallelism", parallelism, "--timeout", str(SERVE_TIMEOUT_S), "--state-dir", str(a.state_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S + 30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _worker_pids(agent: AgentProc, rank: int) -> list[int]:
    """The agent's worker processes of global rank ``rank`` (its children running serve)."""
    assert agent.proc is not None
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == agent.proc.pid and b"p2pmesh.worker.serve" in cmd and cmd[cmd.index(b"--rank") + 1] == str(rank).encode():
            out.append(int(entry))
    return out


def _generate_killing(via: AgentProc, victim: AgentProc, rank: int) -> tuple[list[int], dict[str, Any], list[int]]:
    """Generate TOKENS through ``via``, SIGKILLing ``victim``'s worker of ``rank`` after 2 tokens."""
    killed, victims = threading.Event(), []

    def on_token(count: int) -> None:
        if count >= 2 and not killed.is_set():
            killed.set()
            victims.extend(_worker_pids(victim, rank))
            for pid in victims:
                os.kill(pid, signal.SIGKILL)

    tokens, last = _generate(via, TOKENS, on_token)
    assert killed.is_set(), "the generation ended before the kill"
    return tokens, last, victims


@pytest.fixture
def two_agents(tmp_path: Path, shaped_model: Path) -> Any:
    with formed_cluster(_agents(tmp_path, 2, [1 << 32] * 2), FORM_TIMEOUT_S) as agents:
        yield agents


def test_a_bad_parallelism_is_refused_before_anything_is_committed(two_agents: list[AgentProc], tmp_path: Path,
                                                                   shaped_model: Path) -> None:
    from p2pmesh.client import BadRequest, Client

    a = two_agents[0]
    with pytest.raises(BadRequest) as info:  # the raw op (the CLI refuses such a value itself)
        Client(a.state_dir).call("model", name=str(shaped_model), context_tokens=CONTEXT, parallelism="sideways")
    assert info.value.error_code == "bad_request" and "parallelism" in str(info.value)
    shapeless = tmp_path / "shapeless"
    make_model(shapeless, family="llama", layers=LAYERS, hidden=64, seed=1)
    config = json.loads((shapeless / "config.json").read_text())
    del config["intermediate_size"]  # the shape is unknown: no tensor plan
    (shapeless / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadRequest) as info:
        Client(a.state_dir).set_model(shapeless, context_tokens=CONTEXT, parallelism="tensor")
    assert info.value.error_code == "bad_request" and "shape" in str(info.value)
    assert _status(a)["placement"]["model"] is None


def test_tensor_serves_the_greedy_tokens_and_survives_a_killed_rank(two_agents: list[AgentProc], shaped_model: Path) -> None:
    reference = _references(shaped_model, [PROMPT], TOKENS)[0]
    a, b = two_agents
    ids = [_status(x)["node_id"] for x in two_agents]
    loaded = _load(a, shaped_model, "tensor")
    assert loaded["parallelism"] == "tensor" and sorted(loaded["groups"][0]["node_ids"]) == sorted(ids)
    p = wait_for(lambda: _serving_as(b, ("tensor",)), SERVE_TIMEOUT_S, "a serving tensor group")
    assert len(p["groups"]) == 1 and sorted(p["groups"][0]["node_ids"]) == sorted(ids)
    assert p["groups"][0]["layers"] == [0, LAYERS] and len(p["stages"]) == 2
    tokens, last = _generate(a, 24)
    assert tokens == reference[:24] and last["finish"] == "length"

    # SIGKILL the non-head rank's worker after a few tokens, then the head rank's (rank 0: it
    # samples and streams the tokens), each through another agent: each time a new epoch and
    # the same tokens, the ones already streamed not repeated.
    for via, rank in ((a, 1), (b, 0)):
        victim_agent = two_agents[ids.index(p["stages"][rank]["node_id"])]
        epoch, resumed = p["epoch"], _status(via)["requests_resumed"]
        tokens, last, victims = _generate_killing(via, victim_agent, rank)
        assert len(victims) == 1 and last["finish"] == "length", (rank, victims, last)
        assert tokens == reference, rank
        assert _status(via)["requests_resumed"] > resumed  # it really moved epochs
        p = wait_for(lambda: _serving_as(a, ("tensor",)), SERVE_TIMEOUT_S, f"a tensor group serving after rank {rank} died")
        assert p["epoch"] > epoch

    # The same agents as a pipeline (or one Mac): the same greedy tokens.
    _load(a, shaped_model, "pipeline")
    wait_for(lambda: _serving_as(a, ("single", "pipeline")), SERVE_TIMEOUT_S, "serving as a pipeline")
    tokens, _ = _generate(b, 24)
    assert tokens == reference[:24]
