#!/usr/bin/env python3
"""Continuous batching through real agents (issue 15): 8 concurrent requests on a 2-stage pipeline.

    .venv/bin/python scripts/bench_batch_agents.py [--runs 2] [--tokens 64] [--long 1500] [--json [FILE]]

Two agents on loopback (127.0.0.2-3) and their MLX workers over the ring. The model is a
random llama (float32, 8 layers, hidden 128, 16 heads, 1 KV head, intermediate 512,
context 2048: no end-of-sequence token in the first 128 greedy tokens of these prompts, and
mlx-lm's batching gains 2x or more on it here); each agent's --memory-limit is such that
one Mac cannot hold it with the KV cache of one request and the two hold it with the cache
of 8, so the placement is a 2-stage pipeline serving 8 at once (checked: the figures are
refused otherwise). Per run, interleaved, the same 8 greedy prompts (8 to 45 tokens) of
scripts/bench_batch.py, --tokens each:
  (a) concurrent: the 8 sent at once through the client (p2pmesh.Client, one thread each);
      aggregate tokens/s = all tokens / wall time from the first send to the last result;
  (b) sequential: the same 8 one after another through the client;
  (c) mlx_lm.batch_generate of the same 8 prompts in this process (EOS ignored), and
      mlx-lm's generate_step one prompt after another: the reference (each twice per run);
      and mlx-lm's time to the first token of the long prompt alone;
  (d) a long prompt (--long tokens) among 8: the 8 and the long one (sent fifth) at once,
      the time to first token of each (GenerationResult.ttft_s, as the agent measured it);
      then the long one arriving while the 8 decode: the longest gap between two tokens of
      a running request while the long prompt is prefilled, against their median gap.
Best of --runs for the rates, all runs pooled for the TTFTs. Checks that every request got
all its tokens and that the concurrent tokens equal the sequential ones. A benchmark, not
a test: the numbers depend on the machine and its load (printed).
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_batch import MODEL, WORDS, prompts, run_mlx_batch, run_mlx_sequential  # noqa: E402
from benchlib import parser, row, table, write_json  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = (MODEL[k] for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"))
CONTEXT = 2048
BATCH = 8
SPACING_S = 0.02
TIMEOUT_S = 180.0
MODEL_NAME = (f"random llama float32, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, {KV_HEADS} KV head, "
              f"intermediate {INTERMEDIATE}, context {CONTEXT}")


class Request:
    """One generation through the client, in a thread: its tokens, when each arrived, its TTFT."""

    def __init__(self, sock: Path, ids: list[int], max_tokens: int) -> None:
        self.sock, self.ids, self.max_tokens = sock, ids, max_tokens
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.ttft_s: float | None = None
        self.finish = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Request:
        self.thread.start()
        return self

    def _run(self) -> None:
        from p2pmesh.client import Client

        try:
            with Client(self.sock) as client:
                for event in client.stream("generate", idle_timeout=TIMEOUT_S, prompt_tokens=self.ids, max_tokens=self.max_tokens):
                    now = time.monotonic()
                    for t in event.get("tokens") or []:
                        self.tokens.append(int(t))
                        self.times.append(now)
                    if event.get("final"):
                        self.finish = str(event.get("finish"))
                        ms = event.get("ttft_ms")
                        self.ttft_s = ms / 1000 if isinstance(ms, int | float) else None
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def join(self) -> Request:
        self.thread.join(TIMEOUT_S)
        if self.thread.is_alive() or self.error is not None:
            raise SystemExit(f"a request failed: {self.error or 'no result in time'}")
        if len(self.tokens) != self.max_tokens:
            raise SystemExit(f"a request got {len(self.tokens)} of {self.max_tokens} tokens ({self.finish}): pick a model without EOS here")
        return self


def run_at_once(sock: Path, ids: list[list[int]], tokens: int) -> tuple[float, list[Request]]:
    t0 = time.monotonic()
    reqs = [Request(sock, p, tokens).start() for p in ids]
    done = [r.join() for r in reqs]
    return time.monotonic() - t0, done


def run_one_by_one(sock: Path, ids: list[list[int]], tokens: int) -> tuple[float, list[Request]]:
    t0 = time.monotonic()
    done = [Request(sock, p, tokens).start().join() for p in ids]
    return time.monotonic() - t0, done


def long_among(sock: Path, ids: list[list[int]], long_ids: list[int], tokens: int) -> tuple[list[float], float]:
    """The 8 and the long prompt (fifth) sent at once: the 8's TTFTs and the long one's."""
    order = [*ids[:4], long_ids, *ids[4:]]
    reqs = []
    for p in order:
        reqs.append(Request(sock, p, tokens if p is not long_ids else 4).start())
        time.sleep(SPACING_S)  # arrival order as listed
    for r in reqs:
        r.join()
    short = [r.ttft_s for i, r in enumerate(reqs) if i != 4]
    assert reqs[4].ttft_s is not None and all(t is not None for t in short)
    return short, reqs[4].ttft_s  # type: ignore[return-value]


def long_while_running(sock: Path, ids: list[list[int]], long_ids: list[int], tokens: int) -> tuple[float, float, float]:
    """The long prompt sent once the 8 all decode: its TTFT, the running requests' longest
    gap between two tokens during its prefill, and their median gap before it arrived."""
    reqs = [Request(sock, p, 3 * tokens).start() for p in ids]
    deadline = time.monotonic() + TIMEOUT_S
    while not all(len(r.times) >= tokens // 2 for r in reqs):
        if time.monotonic() > deadline or any(r.error for r in reqs):
            raise SystemExit("the 8 requests did not get going")
        time.sleep(0.005)
    t_long = time.monotonic()
    long_req = Request(sock, long_ids, 4).start().join()
    t_first = long_req.times[0]
    for r in reqs:
        r.join()
    before = [b - a for r in reqs for a, b in zip(r.times, r.times[1:]) if b < t_long]
    during = [b - a for r in reqs for a, b in zip(r.times, r.times[1:]) if b > t_long and a < t_first]
    assert long_req.ttft_s is not None
    return long_req.ttft_s, max(during) if during else 0.0, statistics.median(before)


def mlx_ttft(model: Any, ids: list[int]) -> float:
    """mlx-lm alone: the seconds to the first token of `ids` (its prefill, 128-token steps as
    the workers' chunks)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.monotonic()
    for _ in generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=128, sampler=lambda x: mx.argmax(x, axis=-1)):
        pass
    return time.monotonic() - t0


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def start_cluster(root: Path, model: Path) -> tuple[list[Any], dict[str, Any]]:
    from p2pmesh.agent.models import describe
    from p2pmesh.drivers.keys import write_key
    from tests.agent.harness import AgentProc, free_port, one_cluster, wait_for

    info = describe(str(model), model, CONTEXT)
    a, k, e = info.layer_bytes, info.kv_bytes_per_token_per_layer * CONTEXT, info.embed_bytes
    # Half the layers with the cache of 8 fit, all of them with the cache of one do not.
    memory = e + LAYERS // 2 * (a + BATCH * k) + a // 2
    assert memory < 2 * e + LAYERS * (a + k), "the model would fit one Mac: change its shape"
    key = root / "key"
    write_key(key, bytes(range(11, 43)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(2)]
    data = random.Random().randrange(20000, 40000)
    agents = []
    for i, listen in enumerate(listens):
        ag = AgentProc(root / f"m{i}", listen, peers=[x for x in listens if x != listen], key_file=key,
                       extra=["--no-mdns", "--memory-limit", str(memory), "--data-port", str(data), "--max-batch", str(BATCH)])
        ag.state_dir.mkdir()
        agents.append(ag)
    for ag in agents:
        ag.start()
    wait_for(lambda: one_cluster(agents, 2), TIMEOUT_S, "one cluster of two")
    from p2pmesh.client import Client

    with Client(agents[0].state_dir / "agent.sock") as client:
        client.load(str(model), context_tokens=CONTEXT, timeout=TIMEOUT_S)

    def serving() -> dict[str, Any] | None:
        p = (agents[0].status() or {}).get("placement") or {}
        return p if p.get("serving") and "pending" not in p else None

    placement = wait_for(serving, TIMEOUT_S, "the model serving")
    return agents, placement


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1500, help="tokens of the long prompt")
    args = ap.parse_args()

    import mlx_lm

    from tests.fixtures.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="p2pmesh-bench-batch-"))
    model = make_tiny_model(root / "model", "llama", LAYERS, HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                            intermediate=INTERMEDIATE, vocab=512)
    mlx_model, tokenizer = mlx_lm.load(str(model))
    ids = prompts(tokenizer, BATCH)
    long_ids: list[int] = []
    while len(long_ids) < args.long:
        long_ids += tokenizer.encode(" ".join(WORDS))
    long_ids = long_ids[: args.long]
    total = BATCH * args.tokens
    agents, placement = start_cluster(root, model)
    stages = [s["node_id"] for s in placement["stages"]]
    batch = placement.get("batch")
    try:
        if len(stages) != 2 or batch != BATCH:
            raise SystemExit(f"the placement is {len(stages)} stage(s) with batch {batch}, not 2 stages with batch {BATCH}")
        head = next(a for a in agents if (a.status() or {}).get("node_id") == stages[0])
        sock = head.state_dir / "agent.sock"
        load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
        best: dict[str, float] = {}
        same = True
        ttft_at_once: list[float] = []
        ttft_short: list[float] = []
        ttft_long: list[float] = []
        running: list[tuple[float, float, float]] = []
        mlx_long: list[float] = []
        run_at_once(sock, ids, args.tokens)  # warm-up: the workers' first steps compile and allocate
        for _ in range(args.runs):
            t_c, conc = run_at_once(sock, ids, args.tokens)
            t_s, seq = run_one_by_one(sock, ids, args.tokens)
            # The references twice per run (they take seconds; the cluster's runs take longer).
            (t_m, n_m), (t_q, n_q) = (min(run_mlx_batch(mlx_model, tokenizer, ids, args.tokens) for _ in range(2)),
                                      min(run_mlx_sequential(mlx_model, ids, args.tokens) for _ in range(2)))
            mlx_long.append(mlx_ttft(mlx_model, long_ids))
            assert n_m == total and n_q == total, (n_m, n_q)
            same = same and [r.tokens for r in conc] == [r.tokens for r in seq]
            ttft_at_once += [r.ttft_s for r in conc if r.ttft_s is not None]
            short, long_ttft = long_among(sock, ids, long_ids, args.tokens)
            ttft_short += short
            ttft_long.append(long_ttft)
            running.append(long_while_running(sock, ids, long_ids, args.tokens))
            for key, t in (("cluster_concurrent", t_c), ("cluster_sequential", t_s), ("mlx_batch_generate", t_m),
                           ("mlx_sequential", t_q)):
                best[key] = max(best.get(key, 0.0), total / t)
            if hasattr(os, "getloadavg"):
                load.append(os.getloadavg()[0])
    finally:
        for a in agents:
            a.stop()
    result = {
        "command": " ".join(["scripts/bench_batch_agents.py", *sys.argv[1:]]),
        "model": MODEL_NAME, "stages": len(stages), "batch": batch, "prompts": BATCH,
        "prompt_tokens": [len(p) for p in ids], "tokens_each": args.tokens, "long_prompt_tokens": args.long,
        "runs": args.runs, "load_average": [round(x, 2) for x in load],
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "concurrent_vs_sequential": round(best["cluster_concurrent"] / best["cluster_sequential"], 2),
        "concurrent_vs_mlx_batch_generate": round(best["cluster_concurrent"] / best["mlx_batch_generate"], 2),
        "mlx_batch_gain": round(best["mlx_batch_generate"] / best["mlx_sequential"], 2),
        "sequential_vs_mlx_sequential": round(best["cluster_sequential"] / best["mlx_sequential"], 2),
        "concurrent_tokens_equal_sequential": same,
        "ttft_s": {
            "8_at_once_p50": round(pct(ttft_at_once, 50), 3), "8_at_once_p99": round(pct(ttft_at_once, 99), 3),
            "with_long_short_p50": round(pct(ttft_short, 50), 3), "with_long_short_p99": round(pct(ttft_short, 99), 3),
            "with_long_long_p50": round(pct(ttft_long, 50), 3), "with_long_long_p99": round(pct(ttft_long, 99), 3),
            "long_while_8_run": round(min(x[0] for x in running), 3),
            "long_alone_mlx_lm": round(min(mlx_long), 3),
        },
        "running_gap_s": {"during_long_prefill_max": round(min(x[1] for x in running), 3),
                          "before_median": round(min(x[2] for x in running), 4)},
    }
    table(f"{BATCH} prompts x {args.tokens} tokens, best of {args.runs}", "tok/s")
    for key, rate in result["tok_s"].items():
        row(key, f"{rate:.1f}")
    print()
    table("ratio", "value", "target")
    targets = {"concurrent_vs_mlx_batch_generate": ">= 0.8x", "concurrent_vs_sequential": ">= 2x", "mlx_batch_gain": ">= 2x"}
    for key in [k for k in result if "_vs_" in k or k.endswith("_gain")]:
        row(key, f"{result[key]:.2f}x", targets.get(key, ""))
    print()
    table("time to first token (agent-measured)", "seconds")
    for key, v in result["ttft_s"].items():
        row(key, f"{v:.3f}")
    for key, v in result["running_gap_s"].items():
        row(f"running requests' gap between tokens, {key}", f"{v:.4f}")
    print(f"\n{MODEL_NAME}; {len(stages)} stages, batch {batch}; load average {result['load_average']}; "
          f"concurrent tokens {'equal' if same else 'DIFFER FROM'} the sequential ones")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
