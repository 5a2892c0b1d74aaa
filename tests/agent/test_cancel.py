"""A client that hangs up frees its request's slot at once (issue 15), with real agent
processes and a real worker on loopback; meanwhile every Mac's status shows the head's batch.

Two agents; the model is small enough that one Mac serves it, so the other agent is an
origin only: its client's hang-up crosses the wire (InferCancel) to the head, whose worker
runs with room for exactly one request (`--max-batch 1 --max-queue 0`). The head cancels the
request in its worker, and the next request is served instead of refused as busy.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import p2pmesh
from tests.agent.harness import ROOT, AgentProc, loopback_agents, make_model, one_cluster, wait_for

FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 90
CANCEL_TIMEOUT_S = 20
CONTEXT = 4096
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-llama-512"
    make_model(out, family="llama", layers=6, hidden=512, seed=3)
    return out


def _agents(tmp_path: Path) -> list[AgentProc]:
    return loopback_agents(tmp_path, 2, 9, lambda i, host: ["--max-batch", "1", "--max-queue", "0"])


def test_a_client_that_hangs_up_on_another_mac_frees_the_heads_only_slot(tmp_path: Path, slow_model: Path) -> None:
    agents = _agents(tmp_path)
    try:
        for a in agents:
            a.start()
        wait_for(lambda: one_cluster(agents, 2), FORM_TIMEOUT_S, "one cluster of two")
        r = subprocess.run([sys.executable, "-m", "p2pmesh", "model", "set", str(slow_model), "--context-tokens", str(CONTEXT),
                            "--state-dir", str(agents[0].state_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

        def serving() -> list[str] | None:
            p = (agents[0].status() or {}).get("placement") or {}
            return [s["node_id"] for s in p["stages"]] if p.get("serving") and "pending" not in p else None

        stages = wait_for(serving, SERVE_TIMEOUT_S, "the model serving")
        by_id = {(a.status() or {}).get("node_id"): a for a in agents}
        head = by_id[stages[0]]
        origin = next(a for a in agents if a is not head)
        if len(stages) > 1:
            pytest.fail(f"the planner split a model that fits one Mac: {stages}")

        with p2pmesh.Client(origin.state_dir / "agent.sock") as client:
            first = client.generate(PROMPT, max_tokens=4000)
            assert next(iter(first))  # it runs: the head's one slot is taken
            # Any Mac's status shows the serving head's batch (its worker's heartbeat, sent on to
            # every member): here the other Mac's, with the one request running.
            requests = wait_for(lambda: (r := client.status().requests) and r.active == 1 and r.tokens_per_s > 0 and r,
                                CANCEL_TIMEOUT_S, "the origin's status showing the head's batch")
            assert requests.head == stages[0] and requests.queued == 0
            first.close()  # the client hangs up mid-stream
            wait_for(lambda: "its client hung up; cancelling it" in head.log_text(), CANCEL_TIMEOUT_S,
                     "the head cancelling the request in its worker")
            # The slot is free again: the next request is served, not refused as busy (the
            # first one alone would hold the slot for its 4,000 tokens).
            deadline = time.monotonic() + CANCEL_TIMEOUT_S
            while True:
                try:
                    result = client.generate(PROMPT, max_tokens=4).collect()
                    break
                except p2pmesh.Busy:
                    assert time.monotonic() < deadline, "the hung-up request still holds the worker's slot"
                    time.sleep(0.2)
            assert result.finish == "length" and len(result.tokens) == 4
            wait_for(lambda: (r := client.status().requests) and r.active == 0 and r.queued == 0, CANCEL_TIMEOUT_S,
                     "the head's batch empty again")
    finally:
        for a in agents:
            a.stop()
