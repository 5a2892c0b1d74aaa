#!/usr/bin/env python3
"""Continuous batching in one process: the worker's engine batched vs sequential vs mlx-lm.

    .venv/bin/python scripts/bench_batch.py [--model PATH | --hidden 256 --layers 8] [--tokens 64] [--runs 2] [--stages 2] [--json [FILE]]

The same 8 prompts (different lengths), each with max_tokens = --tokens, greedy, EOS ignored
so every run produces the same number of tokens:
  (a) batched: the worker's own scheduler and engine (core/batching.py, pipeline.Engine,
      one stage holding the whole model), --max-batch 8, all 8 submitted at once;
  (b) sequential: the same engine with max_batch 1 (what a worker did before issue 15);
  (c) mlx_lm.batch_generate of the same prompts (its BatchGenerator);
  (d) mlx-lm's generate_step, one prompt after another (its single-stream speed).
Aggregate tokens/s = all generated tokens / wall time of the run (prefill included); best of
--runs after a warm-up. Prints a table of the figures and the ratios (with --json, the raw
figures as the last line too, or into FILE). Also checks that (a) and (b) give the same tokens. A benchmark, not a test: numbers depend on the machine.
Without --model it writes a random llama with scripts/make_tiny_model.py (float32).
With --stages S (>= 2) it also runs real worker processes (tests/worker/worker_cluster.py)
over a loopback MLX ring, layers split evenly: the 8 requests sent at once vs one after
another, tokens/s from the first command to the last done event.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row, table, write_json  # noqa: E402

WORDS = "Several Macs joined by Thunderbolt cables form one ring and serve a model together".split()


def prompts(tokenizer: object, n: int = 8) -> list[list[int]]:
    return [tokenizer.encode(" ".join(WORDS[j % len(WORDS)] for j in range(4 + 3 * i))) for i in range(n)]  # type: ignore[attr-defined]


def run_engine(stage: object, ids: list[list[int]], tokens: int, max_batch: int) -> tuple[float, dict[str, list[int]]]:
    from p2pmesh.worker.pipeline import Engine
    from p2pmesh.core.batching import Sampling, Scheduler, Token

    sched = Scheduler(max_batch=max_batch, max_queue=len(ids), prefill_chunk=128)
    engine = Engine(stage, None)  # type: ignore[arg-type]
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        assert sched.submit(f"r{i}", p, tokens, Sampling(), frozenset())
    while not sched.idle:
        for step in sched.plan():
            engine.submit(step)
        while engine.pending:
            for o in sched.complete(*engine.collect()):
                if isinstance(o, Token):
                    out[o.rid].append(o.token)
    return time.perf_counter() - t0, out


def run_mlx_batch(model: object, tokenizer: object, ids: list[list[int]], tokens: int) -> tuple[float, int]:
    from mlx_lm import batch_generate

    t0 = time.perf_counter()
    # No stop tokens: the same token count as the others.
    eos = tokenizer.eos_token_ids  # type: ignore[attr-defined]
    tokenizer.eos_token_ids = set()  # type: ignore[attr-defined]
    try:
        r = batch_generate(model, tokenizer, ids, max_tokens=tokens, return_token_ids=True)
    finally:
        tokenizer.eos_token_ids = eos  # type: ignore[attr-defined]
    return time.perf_counter() - t0, sum(len(t) for t in r.token_ids)


def run_mlx_sequential(model: object, ids: list[list[int]], tokens: int) -> tuple[float, int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    n = 0
    for p in ids:
        for _ in generate_step(mx.array(p), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)):  # type: ignore[arg-type]
            n += 1
    return time.perf_counter() - t0, n


def run_workers(path: Path, layers: int, stages: int, ids: list[list[int]], tokens: int, work: Path) -> dict[str, float]:
    from tests.worker.worker_cluster import Cluster

    cut = [round(layers * i / stages) for i in range(stages + 1)]
    cluster = Cluster(path, [[cut[i], cut[i + 1]] for i in range(stages)], work)
    rates: dict[str, float] = {}
    try:
        cluster.start()
        cluster.wait_ready()
        for mode in ("warmup", "concurrent", "sequential"):
            t0 = time.perf_counter()
            groups = [list(range(len(ids)))] if mode != "sequential" else [[i] for i in range(len(ids))]
            n = 0
            for group in groups:
                for i in group:
                    cluster.send({"op": "generate", "id": f"{mode}{i}", "prompt_tokens": ids[i], "max_tokens": tokens})
                left = len(group)
                deadline = time.monotonic() + 600
                while left:
                    e = cluster.next_event(0, deadline)
                    n += e["event"] == "token"
                    left -= e["event"] in ("done", "error")
            rates[mode] = n / (time.perf_counter() - t0)
        assert cluster.shutdown() == [0] * stages, cluster.stderrs()
    finally:
        cluster.close()
    return {f"workers_{stages}_stages_{k}": v for k, v in rates.items() if k != "warmup"}


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", help="a model directory (default: a random llama written here)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--stages", type=int, default=0, help="also real worker processes with this many stages (>= 2)")
    args = ap.parse_args()

    import mlx_lm

    from p2pmesh.worker.model import load_shard
    from p2pmesh.worker.pipeline import Stage
    from scripts.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path, name = Path(args.model), args.model
        else:
            path = make_tiny_model(Path(tmp) / "m", "llama", args.layers, args.hidden, vocab=512)
            name = f"random llama float32, hidden {args.hidden}, {args.layers} layers"
        model, tokenizer = mlx_lm.load(str(path))
        cfg = json.loads((path / "config.json").read_text())
        shard = load_shard(path, 0, int(cfg["num_hidden_layers"]))
        ids = prompts(tokenizer)
        best: dict[str, float] = {}
        total = len(ids) * args.tokens
        same = True
        for run in range(args.runs + 1):  # run 0 warms up
            t_b, out_b = run_engine(Stage(shard), ids, args.tokens, 8)
            t_s, out_s = run_engine(Stage(shard), ids, args.tokens, 1)
            t_m, n_m = run_mlx_batch(model, tokenizer, ids, args.tokens)
            t_q, n_q = run_mlx_sequential(model, ids, args.tokens)
            same = same and out_b == out_s
            assert sum(map(len, out_b.values())) == total and n_m == total and n_q == total, (n_m, n_q)
            if run:
                for key, t in (("engine_batched", t_b), ("engine_sequential", t_s), ("mlx_batch_generate", t_m),
                               ("mlx_sequential", t_q)):
                    best[key] = max(best.get(key, 0.0), total / t)
        result = {
            "command": " ".join(["scripts/bench_batch.py", *sys.argv[1:]]),
            "model": name, "prompts": len(ids), "prompt_tokens": [len(p) for p in ids], "tokens_each": args.tokens,
            "tok_s": {k: round(v, 1) for k, v in best.items()},
            "batched_vs_sequential": round(best["engine_batched"] / best["engine_sequential"], 2),
            "batched_vs_mlx_batch_generate": round(best["engine_batched"] / best["mlx_batch_generate"], 2),
            "mlx_batch_gain": round(best["mlx_batch_generate"] / best["mlx_sequential"], 2),
            "engine_sequential_vs_mlx_sequential": round(best["engine_sequential"] / best["mlx_sequential"], 2),
            "batched_tokens_equal_sequential": same,
        }
        if args.stages >= 2:
            work = Path(tmp) / "workers"
            work.mkdir()
            w = run_workers(path, int(cfg["num_hidden_layers"]), args.stages, ids, args.tokens, work)
            result["tok_s"].update({k: round(v, 1) for k, v in w.items()})
            result[f"workers_{args.stages}_stages_concurrent_vs_sequential"] = round(
                w[f"workers_{args.stages}_stages_concurrent"] / w[f"workers_{args.stages}_stages_sequential"], 2)
    table(f"{result['prompts']} prompts x {args.tokens} tokens, best of {args.runs}", "tok/s")
    for key, rate in result["tok_s"].items():
        row(key, f"{rate:.1f}")
    print()
    table("ratio", "value")
    for key in [k for k in result if "_vs_" in k or k.endswith("_gain")]:
        row(key, f"{result[key]:.2f}x")
    print(f"\n{result['model']}: batched {result['batched_vs_sequential']:.2f}x sequential; batched tokens "
          f"{'equal' if same else 'DIFFER FROM'} the sequential ones")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
