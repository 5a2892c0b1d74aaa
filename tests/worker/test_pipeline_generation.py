"""Pipeline workers as real processes over a loopback MLX ring (tests/worker/worker_cluster.py).

1, 2 and 3 ranks with uneven stages serve a tiny model: greedy generations give exactly
mlx-lm's tokens (mlx_lm's generate_step with an argmax sampler in this process), a prompt
of several prefill chunks works, resuming with prompt + the first k tokens continues
identically (greedy and sampled), bad commands get error events without harming the
workers, and shutdown drains every rank to exit 0. A peer that dies makes rank 0 report
the request as failed and exit, instead of hanging.
"""
from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.fixtures.tiny_model import make_tiny_model
from tests.worker.worker_cluster import Cluster

LAYERS = 8
PREFILL_CHUNK = 8
"""Small, so the long prompt below needs many pipeline steps."""
SETUPS = {
    "1 rank llama": ("llama", [[0, 8]]),
    "2 ranks qwen2 [0,3) [3,8)": ("qwen2", [[0, 3], [3, 8]]),
    "3 ranks qwen3 [0,1) [1,5) [5,8)": ("qwen3", [[0, 1], [1, 5], [5, 8]]),
}
PROMPT = "The quick brown fox jumps over the lazy dog"
LONG_PROMPT = " ".join(["Several Macs joined by Thunderbolt cables form one ring."] * 6)
MAX_TOKENS = 12
RESUME_AFTER = 5


def greedy_reference(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    model, tokenizer = mlx_lm.load(str(path))
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


@pytest.mark.parametrize(("family", "stages"), SETUPS.values(), ids=SETUPS.keys())
def test_pipeline_serves_like_a_single_process(family: str, stages: list[list[int]], tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / family, family, LAYERS, 64, shards=2)
    _, tokenizer = mlx_lm.load(str(model))
    prompt_ids = tokenizer.encode(PROMPT)
    long_ids = tokenizer.encode(LONG_PROMPT)
    assert len(long_ids) > 4 * PREFILL_CHUNK
    expected = greedy_reference(model, prompt_ids, MAX_TOKENS)
    expected_long = greedy_reference(model, long_ids, MAX_TOKENS)
    assert len(set(expected)) > 3, "the tiny model should not just repeat one token"

    cluster = Cluster(model, stages, tmp_path, ["--prefill-chunk", str(PREFILL_CHUNK)])
    try:
        cluster.start()
        ready = cluster.wait_ready()
        assert [r["layers"] for r in ready] == stages and [r["rank"] for r in ready] == list(range(len(stages)))

        # Greedy from text: mlx-lm's tokens, and the streamed text is the decoded tokens.
        tokens, done = cluster.request({"op": "generate", "id": "g", "prompt": PROMPT, "max_tokens": MAX_TOKENS})
        assert [t["token"] for t in tokens] == expected
        assert done == {"event": "done", "id": "g", "tokens": len(expected), "finish": "length", "text": done["text"]}
        assert "".join(t["text"] for t in tokens) + done["text"] == tokenizer.decode(expected)

        # A long prompt, many prefill chunks.
        assert cluster.generate({"op": "generate", "id": "long", "prompt_tokens": long_ids, "max_tokens": MAX_TOKENS}) == expected_long

        # Resume: prompt + the first k generated tokens yields the rest, unchanged.
        resumed = cluster.generate({"op": "generate", "id": "resume", "prompt_tokens": prompt_ids + expected[:RESUME_AFTER],
                                    "max_tokens": MAX_TOKENS - RESUME_AFTER})
        assert resumed == expected[RESUME_AFTER:]

        # Sampling is reproducible from the seed, and resumes exactly too.
        sampled = {"op": "generate", "prompt_tokens": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 1.5, "top_p": 0.95, "seed": 7}
        first = cluster.generate({**sampled, "id": "s1"})
        assert cluster.generate({**sampled, "id": "s2"}) == first
        assert first != expected  # a hot temperature strays from greedy
        tail = cluster.generate({**sampled, "id": "s3", "prompt_tokens": prompt_ids + first[:RESUME_AFTER],
                                 "max_tokens": MAX_TOKENS - RESUME_AFTER})
        assert tail == first[RESUME_AFTER:]

        # Bad commands: an error event each, and the workers keep serving.
        bad = [
            ('{"op": "generate", "id": "b1", "prompt": "x", "max_tokens": 0}', "b1", "max_tokens"),
            ('{"op": "generate", "id": "b2", "prompt_tokens": [1, 999999]}', "b2", "outside the model's vocabulary"),
            ('{"op": "generate", "id": "b3", "prompt_tokens": []}', "b3", "empty"),
            ('{"op": "generate", "id": "b4", "prompt": "x", "top_p": 0}', "b4", "top_p"),
            ('{"op": "dance"}', None, "unknown op"),
            ("[1, 2", None, "not JSON"),
        ]
        for line, rid, message in bad:
            cluster.send(line)
            event = cluster.next_event(0, time.monotonic() + 30)
            assert event["event"] == "error" and event.get("id") == rid and message in event["message"], event
            # The agent acts on the code, not the text: a request's own fault is final, a line
            # with no id is nobody's request.
            assert event["code"] == ("request_invalid" if rid is not None else "command_invalid"), event
        assert cluster.generate({"op": "generate", "id": "after", "prompt": PROMPT, "max_tokens": MAX_TOKENS}) == expected

        assert cluster.shutdown() == [0] * len(stages), cluster.stderrs()
        assert all(n >= 1 for n in cluster.heartbeats), cluster.heartbeats
    finally:
        cluster.close()


def test_a_dead_peer_fails_the_request_instead_of_hanging(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "qwen2", 4, 64)
    cluster = Cluster(model, [[0, 2], [2, 4]], tmp_path)
    try:
        cluster.start()
        cluster.wait_ready()
        cluster.procs[1].kill()
        cluster.procs[1].wait(timeout=10)
        _, final = cluster.request({"op": "generate", "id": "x", "prompt": PROMPT, "max_tokens": 50}, timeout_s=60)
        assert final["event"] == "error" and final["id"] == "x" and "generation failed" in final["message"]
        assert final["code"] == "pipeline_broken"  # not the request's fault: the agent resumes it elsewhere
        assert cluster.procs[0].wait(timeout=30) == 1
    finally:
        cluster.close()


@pytest.mark.parametrize(
    ("stages", "rank", "message"),
    [
        ("[[0, 3], [4, 8]]", "0", "not contiguous"),
        ("[[0, 3]]", "0", "the model has 8 layers"),
        ("[[0, 8]]", "1", "not one of the 1 stages"),
        ("[[0, 4], [4, 8]]", "0", "MLX_RANK and MLX_HOSTFILE"),
        ("nonsense", "0", "JSON list"),
    ],
)
def test_bad_arguments_exit_2_with_an_error_event(stages: str, rank: str, message: str, tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    model = make_tiny_model(tmp_path / "m", "llama", LAYERS, 64)
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    r = subprocess.run([sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(model), "--stages", stages, "--rank", rank],
                       env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    events = [json.loads(line) for line in r.stdout.splitlines() if b"heartbeat" not in line]
    assert r.returncode == 2, r.stderr
    assert events and events[-1]["event"] == "error" and message in events[-1]["message"], events
    assert events[-1]["code"] == "unusable"
