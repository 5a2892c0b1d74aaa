"""The serving worker (`python -m p2pmesh.worker.serve`) runs tensor groups and hybrids
(issue 16): real processes on loopback, one MLX ring per tensor group, the side channel
(worker/side_link.py) between group heads and to each group's members
(tests/worker/worker_cluster.py, `group_sizes`).

- 2-rank tensor, for llama, qwen3 and qwen3_moe: greedy tokens equal mlx-lm's, and two
  requests at once (one batch) get the tokens each gets alone; shutdown exits 0 everywhere.
- 3-rank tensor with uneven shares (heads 6/4/2: worker/tensor.py's own sharding) and a 2x2
  hybrid, for the same three families; a [1, 2] mixed plan (llama): the same tokens, batched
  too; idle, no rank spins a core.
- bad --group-sizes / --shares / stages / side options: exit 2 with an `unusable` event.
- a member SIGKILLed mid-generation: rank 0 reports the request as pipeline_broken, and
  every survivor exits non-zero within a bounded time.

The models are test_tensor.py's tiny float32 ones (12 heads over 6 KV heads, 192 MLP
columns, 4 layers), whose well spread logits make token-exact comparisons meaningful.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from tests.worker.test_batch_serving import collect, final_of, tokens_of
from tests.worker.test_pipeline_generation import greedy_reference
from tests.worker.test_tensor import LAYERS, make_model
from tests.worker.worker_cluster import ROOT, Cluster

MAX_TOKENS = 8
IDLE_S = 1.5
PROMPTS = ["Once upon a time there was", "The quick brown fox jumps over the lazy dog and the"]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model, prompt ids, greedy reference of each prompt) for a family."""
    return _model(tmp_path_factory.mktemp(request.param), request.param)


def _model(where: Path, family: str) -> tuple[Path, list[list[int]], list[list[int]]]:
    model = make_model(where / family, family)
    _, tokenizer = mlx_lm.load(str(model))
    ids = [tokenizer.encode(p) for p in PROMPTS]
    refs = [greedy_reference(model, i, MAX_TOKENS) for i in ids]
    assert all(len(set(r)) > 2 for r in refs), refs  # real sequences, not one token repeated
    return model, ids, refs


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    return _model(tmp_path_factory.mktemp("llama"), "llama")


def stages_of(sizes: list[int]) -> list[list[int]]:
    """The layers split as evenly as may be over the groups, one entry per rank."""
    bounds = [round(LAYERS * g / len(sizes)) for g in range(len(sizes) + 1)]
    return [[bounds[g], bounds[g + 1]] for g, n in enumerate(sizes) for _ in range(n)]


def serve_and_compare(model: Path, ids: list[list[int]], refs: list[list[int]], sizes: list[int], tmp_path: Path,
                      extra: list[str] | None = None) -> None:
    """Each prompt alone, then both at once: mlx-lm's greedy tokens; a clean shutdown."""
    stages = stages_of(sizes)
    cluster = Cluster(model, stages, tmp_path, extra, group_sizes=sizes)
    try:
        cluster.start()
        ready = cluster.wait_ready()
        assert [(r["rank"], r["layers"]) for r in ready] == list(enumerate(stages))
        for i, (prompt, ref) in enumerate(zip(ids, refs)):
            assert cluster.generate({"op": "generate", "id": f"alone{i}", "prompt_tokens": prompt, "max_tokens": MAX_TOKENS}) == ref
        for i, prompt in enumerate(ids):
            cluster.send({"op": "generate", "id": f"both{i}", "prompt_tokens": prompt, "max_tokens": MAX_TOKENS})
        events = collect(cluster, {f"both{i}" for i in range(len(ids))}, timeout_s=120)
        for i, ref in enumerate(refs):
            assert final_of(events, f"both{i}")["event"] == "done"
            assert tokens_of(events, f"both{i}") == ref, (i, cluster.stderrs())
        before = cluster.cpu_s()
        time.sleep(IDLE_S)
        after = cluster.cpu_s()
        if before is not None and after is not None:  # Linux's /proc: idle ranks wait in the kernel, no core spins
            assert all(b - a < IDLE_S / 3 for a, b in zip(before, after)), (before, after)
        assert cluster.shutdown() == [0] * len(stages), cluster.stderrs()
        assert all(n >= 1 for n in cluster.heartbeats), cluster.heartbeats
    finally:
        cluster.close()


def test_two_rank_tensor_group_serves_mlx_lm_tokens(family_model: tuple[Path, list[list[int]], list[list[int]]], tmp_path: Path) -> None:
    serve_and_compare(*family_model, [2], tmp_path)


def test_three_ranks_with_uneven_shares(family_model: tuple[Path, list[list[int]], list[list[int]]], tmp_path: Path) -> None:
    serve_and_compare(*family_model, [3], tmp_path, ["--shares", json.dumps([[6, 3, 96], [4, 2, 64], [2, 1, 32]])])


def test_a_two_by_two_hybrid_serves_mlx_lm_tokens(family_model: tuple[Path, list[list[int]], list[list[int]]], tmp_path: Path) -> None:
    serve_and_compare(*family_model, [2, 2], tmp_path)


def test_a_mixed_one_plus_two_plan_serves_mlx_lm_tokens(llama: tuple[Path, list[list[int]], list[list[int]]], tmp_path: Path) -> None:
    serve_and_compare(*llama, [1, 2], tmp_path)


BAD = [
    # (stages, group sizes, shares, rank, side options, words of the message)
    ([[0, 4], [0, 4]], "[1, 2]", None, 0, [], "add up to 3 ranks"),
    ([[0, 2], [0, 4]], "[2]", None, 0, [], "must all hold the same layers"),
    ([[0, 2], [0, 2], [3, 4], [3, 4]], "[2, 2]", None, 0, [], "not contiguous"),
    ([[0, 4], [0, 4]], "[2, 0]", None, 0, [], "at least one rank"),
    ([[0, 4], [0, 4]], "two", None, 0, [], "--group-sizes"),
    ([[0, 4], [0, 4]], "[2]", "[[6, 3, 96]]", 0, [], "one per rank"),
    ([[0, 4], [0, 4]], "[2]", "[[6, 3, 96], [6, 3, 64]]", 0, ["--side-listen", '["127.0.0.1:1"]'], "add up to 6 KV heads"),
    ([[0, 4]] * 4, "[4]", None, 0, ["--side-listen", '["127.0.0.1:1"]'], "do not split evenly over 4"),
    ([[0, 4], [0, 4]], "[2]", None, 0, [], "--side-listen"),
    ([[0, 4], [0, 4]], "[2]", None, 1, [], "--side-head"),
    ([[0, 2], [0, 2], [2, 4]], "[2, 1]", None, 0, ["--side-listen", '["127.0.0.1:1"]'], "--side-next"),
]


@pytest.mark.parametrize(("stages", "sizes", "shares", "rank", "side", "message"), BAD, ids=[b[-1] for b in BAD])
def test_a_bad_plan_exits_2_at_once_with_an_unusable_event(stages: list[list[int]], sizes: str, shares: str | None, rank: int,
                                                           side: list[str], message: str,
                                                           llama: tuple[Path, list[list[int]], list[list[int]]], tmp_path: Path) -> None:
    # A valid MLX environment for the rank's group, so only the plan can be at fault.
    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{47000 + i}"] for i in range(4 if sizes == "[4]" else 2)]), encoding="utf-8")
    env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(llama[0]), "--stages", json.dumps(stages),
           "--rank", str(rank), "--group-sizes", sizes, *(["--shares", shares] if shares else []), *side]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    events = [json.loads(line) for line in r.stdout.splitlines() if b"heartbeat" not in line]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert events and events[-1]["event"] == "error" and events[-1]["code"] == "unusable", events
    assert message in events[-1]["message"], events
    assert time.monotonic() - t0 < 30  # no group formed, nothing waited for


@pytest.mark.parametrize(("sizes", "victim"), [([2], 1), ([2, 2], 3)], ids=["tensor, member 1", "hybrid, member 3"])
def test_a_killed_member_breaks_the_request_and_nobody_exits_0(sizes: list[int], victim: int,
                                                               llama: tuple[Path, list[list[int]], list[list[int]]],
                                                               tmp_path: Path) -> None:
    model, ids, _ = llama
    cluster = Cluster(model, stages_of(sizes), tmp_path, group_sizes=sizes)
    try:
        cluster.start()
        cluster.wait_ready()
        cluster.send({"op": "generate", "id": "x", "prompt_tokens": ids[0], "max_tokens": 2000})
        deadline = time.monotonic() + 60
        first = cluster.next_event(0, deadline)
        assert first["event"] == "token" and first["id"] == "x", first  # mid-generation
        cluster.procs[victim].kill()
        t_kill = time.monotonic()
        final: dict[str, Any] = first
        while final["event"] == "token":  # bounded: the deadline
            final = cluster.next_event(0, t_kill + 30)
        assert final["event"] == "error" and final["id"] == "x" and final["code"] == "pipeline_broken", final
        codes = cluster.wait_exit(30)
        assert all(c != 0 for c in codes), (codes, cluster.stderrs())
        assert time.monotonic() - t_kill < 30
    finally:
        cluster.close()
