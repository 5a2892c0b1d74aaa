"""Continuous batching in real worker processes (tests/worker/worker_cluster.py): one stage,
and two, three and four stages over the real MLX ring on loopback.

8 concurrent greedy requests with different prompt lengths and max_tokens give exactly
each request's unbatched greedy tokens (mlx-lm's generate_step); a long prompt arriving
while another request decodes does not stall it (its tokens keep arriving during the long
prompt's chunked prefill); a bad request in the batch is refused alone; cancel frees a
slot at once; beyond the queue a request gets "busy". Through 3 and 4 stages (one decode
group per stage, so several micro-batches are in flight along the ring) 8 concurrent
requests, greedy and sampled, get exactly the tokens each gets alone."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from tests.fixtures.tiny_model import make_tiny_model
from tests.worker.test_pipeline_generation import greedy_reference
from tests.worker.worker_cluster import Cluster, ClusterError

LAYERS = 8
PREFILL_CHUNK = 8
SETUPS = {
    "1 stage llama": ("llama", [[0, 8]]),
    "2 stages qwen2 [0,3) [3,8)": ("qwen2", [[0, 3], [3, 8]]),
}
DEEP = {
    "3 stages qwen3 [0,1) [1,5) [5,8)": ("qwen3", [[0, 1], [1, 5], [5, 8]]),
    "4 stages llama [0,2) [2,4) [4,7) [7,8)": ("llama", [[0, 2], [2, 4], [4, 7], [7, 8]]),
}
WORDS = "Several Macs joined by Thunderbolt cables form one ring and serve a model together".split()


def prompt(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def collect(cluster: Cluster, ids: set[str], timeout_s: float = 240.0, running: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Rank 0's events until every id in `ids` has its done or error event (tokens of the
    `running` ids may come meanwhile)."""
    deadline = time.monotonic() + timeout_s
    events: list[dict[str, Any]] = []
    left = set(ids)
    while left:
        event = cluster.next_event(0, deadline)
        if event.get("event") not in ("token", "done", "error") or event.get("id") not in ids | running:
            raise ClusterError(f"unexpected event {event}\n{cluster.stderrs()}")
        events.append(event)
        if event["event"] != "token":
            left.discard(event["id"])
    return events


def tokens_of(events: list[dict[str, Any]], rid: str) -> list[int]:
    return [e["token"] for e in events if e["id"] == rid and e["event"] == "token"]


def final_of(events: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    return next(e for e in events if e["id"] == rid and e["event"] != "token")


@pytest.mark.parametrize(("family", "stages"), SETUPS.values(), ids=SETUPS.keys())
def test_concurrent_requests_get_their_unbatched_tokens(family: str, stages: list[list[int]], tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / family, family, LAYERS, 64)
    _, tokenizer = mlx_lm.load(str(model))
    specs = {f"r{i}": (tokenizer.encode(prompt(2 + 5 * i)), 6 + 3 * i) for i in range(8)}
    expected = {rid: greedy_reference(model, ids, n) for rid, (ids, n) in specs.items()}
    long_ids = tokenizer.encode(prompt(90))
    assert len(long_ids) >= 10 * PREFILL_CHUNK
    expected_long = greedy_reference(model, long_ids, 4)
    runner_ids = tokenizer.encode(prompt(5))
    expected_runner = greedy_reference(model, runner_ids, 60)

    cluster = Cluster(model, stages, tmp_path, ["--prefill-chunk", str(PREFILL_CHUNK)])
    try:
        cluster.start()
        cluster.wait_ready()

        # 8 requests at once: each gets exactly its own greedy tokens, and they interleave.
        for rid, (ids, n) in specs.items():
            cluster.send({"op": "generate", "id": rid, "prompt_tokens": ids, "max_tokens": n})
        events = collect(cluster, set(specs))
        for rid in specs:
            assert tokens_of(events, rid) == expected[rid], rid
            assert final_of(events, rid) == {"event": "done", "id": rid, "tokens": len(expected[rid]),
                                             "finish": "length" if len(expected[rid]) == specs[rid][1] else "stop",
                                             "text": final_of(events, rid)["text"]}
            firsts = [e for e in events if e["id"] == rid and e["event"] == "token"][:1]
            assert firsts and firsts[0]["prompt_tokens"] == specs[rid][0]
        order = [e["id"] for e in events if e["event"] == "token"]
        last_r0 = max(i for i, rid in enumerate(order) if rid == "r0")
        assert set(order[: last_r0 + 1]) - {"r0"}, "requests ran one after another, not batched"

        # A long prompt (>= 10 chunks) arrives while "run" decodes: run's tokens keep coming
        # between the long request's arrival and its first token, and both stay exact.
        cluster.send({"op": "generate", "id": "run", "prompt_tokens": runner_ids, "max_tokens": 60})
        first = cluster.next_event(0, time.monotonic() + 60)
        assert first["event"] == "token" and first["id"] == "run", first
        cluster.send({"op": "generate", "id": "long", "prompt_tokens": long_ids, "max_tokens": 4})
        events = [first, *collect(cluster, {"run", "long"})]
        assert tokens_of(events, "run") == expected_runner
        assert tokens_of(events, "long") == expected_long
        order = [e["id"] for e in events if e["event"] == "token"]
        during = order[1 : order.index("long")]  # after the long one was sent, before its first token
        chunks = -(-len(long_ids) // PREFILL_CHUNK)
        assert during.count("run") >= chunks // 2, (chunks, order)

        # A bad request in a running batch is refused alone; a duplicate id too.
        cluster.send({"op": "generate", "id": "ok1", "prompt_tokens": specs["r3"][0], "max_tokens": specs["r3"][1]})
        cluster.send({"op": "generate", "id": "bad", "prompt_tokens": [1, 999999]})
        cluster.send({"op": "generate", "id": "ok1", "prompt": "again"})
        cluster.send({"op": "generate", "id": "ok2", "prompt_tokens": specs["r5"][0], "max_tokens": specs["r5"][1]})
        events = collect(cluster, {"ok1", "bad", "ok2"})
        bad = final_of(events, "bad")
        assert bad["event"] == "error" and bad["code"] == "request_invalid" and "vocabulary" in bad["message"]
        dup = [e for e in events if e["id"] == "ok1" and e["event"] == "error"]
        assert len(dup) == 1 and dup[0]["code"] == "request_invalid" and "already running" in dup[0]["message"]
        assert tokens_of(events, "ok1") == expected["r3"] and tokens_of(events, "ok2") == expected["r5"]
        assert [e["event"] for e in events if e["id"] == "ok1"][-1] == "done"

        assert cluster.shutdown() == [0] * len(stages), cluster.stderrs()
    finally:
        cluster.close()


@pytest.mark.parametrize(("family", "stages"), SETUPS.values(), ids=SETUPS.keys())
def test_cancel_frees_a_slot_and_a_full_queue_says_busy(family: str, stages: list[list[int]], tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / family, family, 4, 64)
    _, tokenizer = mlx_lm.load(str(model))
    ids = tokenizer.encode(prompt(6))
    expected = greedy_reference(model, ids, 5)
    cluster = Cluster(model, [[0, 4]] if len(stages) == 1 else [[0, 2], [2, 4]], tmp_path,
                      ["--max-batch", "2", "--max-queue", "1"])
    try:
        cluster.start()
        cluster.wait_ready()
        endless = {"prompt_tokens": ids, "max_tokens": 4000}
        cluster.send({"op": "generate", "id": "a", **endless})
        cluster.send({"op": "generate", "id": "b", **endless})
        cluster.send({"op": "generate", "id": "c", "prompt_tokens": ids, "max_tokens": 5})  # queued
        cluster.send({"op": "generate", "id": "d", "prompt_tokens": ids, "max_tokens": 5})  # beyond the queue
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while not any(e["id"] == "d" for e in events) or not tokens_of(events, "a"):
            events.append(cluster.next_event(0, deadline))
        busy = final_of(events, "d")
        assert busy["event"] == "error" and busy["code"] == "busy", busy
        assert not tokens_of(events, "c")  # waits for a slot
        # The head's heartbeat reports its batch: a and b running, c waiting.
        cluster.wait_head_beat(lambda beat: (beat["running"], beat["queued"]) == (2, 1))

        cluster.send({"op": "cancel", "id": "a"})
        cluster.send({"op": "cancel", "id": "nobody"})  # unknown: ignored
        rest = collect(cluster, {"a", "c"}, running=frozenset({"b"}))
        done_a = final_of(rest, "a")
        assert done_a["finish"] == "cancelled" and done_a["tokens"] == len(tokens_of(events + rest, "a"))
        assert tokens_of(rest, "c") == expected  # c got a's slot and its exact tokens
        assert rest.index(done_a) < next(i for i, e in enumerate(rest) if e["id"] == "c")
        cluster.send({"op": "cancel", "id": "b"})
        tail = collect(cluster, {"b"})  # b's tokens up to its cancel, then its done
        assert final_of(tail, "b")["finish"] == "cancelled"
        generated = len([e for e in events + rest + tail if e["event"] == "token"])
        cluster.wait_head_beat(lambda beat: (beat["running"], beat["queued"], beat["tokens"]) == (0, 0, generated))
        assert cluster.shutdown() == [0] * cluster.size, cluster.stderrs()
    finally:
        cluster.close()


SAMPLED = {"r2": (1.2, 0.9, 11), "r5": (0.8, 1.0, 2**31 - 5)}
"""Requests of the deep batch that sample: temperature, top_p, seed."""


@pytest.mark.parametrize(("family", "stages"), DEEP.values(), ids=DEEP.keys())
def test_deep_pipelines_serve_8_concurrent_requests_exactly(family: str, stages: list[list[int]], tmp_path: Path) -> None:
    """3 and 4 stages, 8 requests at once with different prompt lengths and max_tokens (the
    default micro-batches: one decode group per stage, all in flight along the ring): every
    greedy request gets its unbatched greedy tokens, and every sampled one (its own
    temperature, top_p and seed) the tokens it gets alone on the same workers."""
    model = make_tiny_model(tmp_path / family, family, LAYERS, 64)
    _, tokenizer = mlx_lm.load(str(model))
    specs = {f"r{i}": (tokenizer.encode(prompt(3 + 7 * i % 23)), 5 + (5 * i) % 13) for i in range(8)}
    expected = {rid: greedy_reference(model, ids, n) for rid, (ids, n) in specs.items() if rid not in SAMPLED}

    def command(rid: str, as_id: str) -> dict[str, Any]:
        ids, n = specs[rid]
        cmd: dict[str, Any] = {"op": "generate", "id": as_id, "prompt_tokens": ids, "max_tokens": n}
        if rid in SAMPLED:
            t, p, seed = SAMPLED[rid]
            cmd |= {"temperature": t, "top_p": p, "seed": seed}
        return cmd

    cluster = Cluster(model, stages, tmp_path, ["--prefill-chunk", str(PREFILL_CHUNK)])
    try:
        cluster.start()
        cluster.wait_ready()
        for rid in specs:
            cluster.send(command(rid, rid))
        events = collect(cluster, set(specs))
        for rid in specs:
            assert final_of(events, rid)["event"] == "done", final_of(events, rid)
        for rid, want in expected.items():
            assert tokens_of(events, rid) == want, rid
        order = [e["id"] for e in events if e["event"] == "token"]
        spans = {rid: (order.index(rid), len(order) - 1 - order[::-1].index(rid)) for rid in specs}
        overlap = max(sum(1 for a, b in spans.values() if a <= i <= b) for i in range(len(order)))
        assert overlap >= 3, f"requests ran one after another, not batched: {order}"

        # Each sampled request alone (no other request running) draws the same tokens, and
        # strays from greedy (so the comparison says something about sampling).
        for rid in SAMPLED:
            alone = cluster.generate(command(rid, f"{rid}-alone"))
            assert tokens_of(events, rid) == alone, rid
            assert alone != greedy_reference(model, specs[rid][0], specs[rid][1]), rid
        assert cluster.shutdown() == [0] * len(stages), cluster.stderrs()
    finally:
        cluster.close()
