#!/usr/bin/env python3
"""Continuous batching: the worker's engine and real 2-stage workers, batched vs sequential vs mlx-lm.

    .venv/bin/python scripts/bench_batch.py [--model PATH | --hidden 128 --layers 8 ...] [--tokens 64] [--runs 2]
        [--stages 2] [--baseline-tree DIR] [--json [FILE]]

The same 8 prompts (different lengths), each with max_tokens = --tokens, greedy, EOS ignored
so every run produces the same number of tokens:
  (a) batched: the worker's own scheduler and engine (core/batching.py, pipeline.Engine,
      one stage holding the whole model), --max-batch 8, all 8 submitted at once;
  (b) sequential: the same engine with max_batch 1 (what a worker did before issue 15);
  (c) mlx_lm.batch_generate of the same prompts (its BatchGenerator);
  (d) mlx-lm's generate_step, one prompt after another (its single-stream speed).
Aggregate tokens/s = all generated tokens / wall time of the run (prefill included); best of
--runs after a warm-up. Prints a table of the figures and the ratios (with --json, the raw
figures as the last line too, or into FILE). Also checks that (a) and (b) give the same tokens.
A benchmark, not a test: numbers depend on the machine.
Without --model it writes a random llama with tests/fixtures/tiny_model.py (float32; by
default the shape of MODEL below: no end-of-sequence token in these prompts' first 128
greedy tokens, which real workers, unlike (a)-(d), stop at).
With --stages S (>= 2) each run also starts real worker processes (tests/worker/worker_cluster.py)
over a loopback MLX ring, layers split evenly: the 8 requests sent at once (with the
default micro-batches, one per stage, and with one) vs one after another, tokens/s from the
first command to the last done event, and the workers' CPU milliseconds per token (all
ranks; Linux), a figure the machine's load moves much less than tokens/s; best and median
of the runs.
--baseline-tree DIR: the same workers run from another checkout too (e.g. `git archive main
| tar -x -C DIR`), interleaved run by run: before/after in one command, compared by medians.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import parser, row, table, write_json  # noqa: E402

WORDS = "Several Macs joined by Thunderbolt cables form one ring and serve a model together".split()
MODEL = {"hidden": 128, "layers": 8, "heads": 16, "kv_heads": 1, "intermediate": 512}
"""The random llama both batching benchmarks use: mlx-lm's batch_generate gains 2x or more over
its sequential generation on it on the development VM (CPU MLX), so batching has room to show."""


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


def run_workers(path: Path, layers: int, stages: int, ids: list[list[int]], tokens: int, work: Path,
                root: Path | None = None) -> dict[str, float]:
    """One start of real workers (from checkout `root`, default this one): tokens/s and CPU ms
    per token, the 8 at once with one micro-batch per stage, then with one micro-batch (a
    second start), then one after another."""
    from tests.worker.worker_cluster import ROOT as HERE
    from tests.worker.worker_cluster import Cluster

    cut = [round(layers * i / stages) for i in range(stages + 1)]
    out: dict[str, float] = {}
    for variant, extra in (("", []), ("_1_group", ["--micro-batches", "1"])):
        work.mkdir(parents=True, exist_ok=True)
        cluster = Cluster(path, [[cut[i], cut[i + 1]] for i in range(stages)], work, extra, root=root or HERE)
        try:
            cluster.start()
            cluster.wait_ready()
            for mode in ("warmup", "concurrent", "sequential"):
                if variant and mode == "sequential":
                    continue  # one request at a time is one group whatever the option
                cpu0 = cluster.cpu_s()
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
                rate = n / (time.perf_counter() - t0)
                cpu1 = cluster.cpu_s()
                if mode != "warmup":
                    if n != len(ids) * tokens:
                        raise SystemExit(f"the workers generated {n} of {len(ids) * tokens} tokens: the model stops at EOS here")
                    out[f"{mode}{variant}"] = rate
                    if cpu0 is not None and cpu1 is not None:
                        out[f"{mode}{variant}_cpu_ms_per_token"] = (sum(cpu1) - sum(cpu0)) / n * 1000
            assert cluster.shutdown() == [0] * stages, cluster.stderrs()
        finally:
            cluster.close()
    return out


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", help="a model directory (default: a random llama written here)")
    for key, value in MODEL.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--stages", type=int, default=0, help="also real worker processes with this many stages (>= 2)")
    ap.add_argument("--baseline-tree", type=Path, help="also run the workers from this checkout, interleaved (before/after)")
    args = ap.parse_args()

    import mlx_lm

    from p2pmesh.worker.model import load_shard
    from p2pmesh.worker.pipeline import Stage
    from tests.fixtures.tiny_model import make_tiny_model

    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path, name = Path(args.model), args.model
        else:
            path = make_tiny_model(Path(tmp) / "m", "llama", args.layers, args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                   intermediate=args.intermediate, vocab=512)
            name = (f"random llama float32, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
                    f"{args.kv_heads} KV heads, intermediate {args.intermediate}")
        model, tokenizer = mlx_lm.load(str(path))
        cfg = json.loads((path / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        shard = load_shard(path, 0, layers)
        ids = prompts(tokenizer)
        best: dict[str, float] = {}
        cpu: dict[str, float] = {}
        samples: dict[str, list[float]] = {}  # the workers' rates, every run: medians beside the best
        total = len(ids) * args.tokens
        same = True
        trees = [("workers", None)] + ([("baseline", args.baseline_tree)] if args.baseline_tree else [])
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
                if args.stages >= 2:
                    for label, root in trees:
                        w = run_workers(path, layers, args.stages, ids, args.tokens, Path(tmp) / f"{label}{run}", root)
                        for k, v in w.items():
                            key = f"{label}_{args.stages}_stages_{k}"
                            samples.setdefault(key, []).append(v)
                            if k.endswith("_cpu_ms_per_token"):
                                cpu[key] = min(cpu.get(key, v), v)
                            else:
                                best[key] = max(best.get(key, 0.0), v)
            if hasattr(os, "getloadavg"):
                load.append(os.getloadavg()[0])
        result: dict[str, Any] = {
            "command": " ".join(["scripts/bench_batch.py", *sys.argv[1:]]),
            "model": name, "prompts": len(ids), "prompt_tokens": [len(p) for p in ids], "tokens_each": args.tokens,
            "runs": args.runs, "stages": args.stages, "load_average": [round(x, 2) for x in load],
            "tok_s": {k: round(v, 1) for k, v in best.items()},
            "cpu_ms_per_token": {k: round(v, 2) for k, v in cpu.items()},
            "median": {k: round(statistics.median(v), 2) for k, v in samples.items()},
            "batched_vs_sequential": round(best["engine_batched"] / best["engine_sequential"], 2),
            "batched_vs_mlx_batch_generate": round(best["engine_batched"] / best["mlx_batch_generate"], 2),
            "mlx_batch_gain": round(best["mlx_batch_generate"] / best["mlx_sequential"], 2),
            "engine_sequential_vs_mlx_sequential": round(best["engine_sequential"] / best["mlx_sequential"], 2),
            "batched_tokens_equal_sequential": same,
        }
        if args.stages >= 2:
            w = f"workers_{args.stages}_stages_"
            result[f"{w}concurrent_vs_sequential"] = round(best[w + "concurrent"] / best[w + "sequential"], 2)
            result[f"{w}concurrent_vs_mlx_batch_generate"] = round(best[w + "concurrent"] / best["mlx_batch_generate"], 2)
            result[f"{w}1_group_vs_mlx_batch_generate"] = round(best[w + "concurrent_1_group"] / best["mlx_batch_generate"], 2)
            if args.baseline_tree:
                # Medians: on a shared machine one lucky run decides a best-of-N comparison.
                b, med = f"baseline_{args.stages}_stages_", result["median"]
                result["baseline_tree"] = str(args.baseline_tree)
                for mode in ("concurrent", "sequential", "concurrent_1_group"):
                    result[f"{w}{mode}_vs_baseline_medians"] = round(med[w + mode] / med[b + mode], 2)
    med = result["median"]
    table(f"{result['prompts']} prompts x {args.tokens} tokens, best of {args.runs}", "tok/s", "median tok/s",
          "CPU ms / token (best)", "CPU ms / token (median)")
    for key, rate in result["tok_s"].items():
        c = key + "_cpu_ms_per_token"
        row(key, f"{rate:.1f}", f"{med[key]:.1f}" if key in med else "", f"{cpu[c]:.2f}" if c in cpu else "",
            f"{med[c]:.2f}" if c in med else "")
    print()
    table("ratio", "value")
    for key in [k for k in result if "_vs_" in k or k.endswith("_gain")]:
        row(key, f"{result[key]:.2f}x")
    print(f"\n{result['model']}: batched {result['batched_vs_sequential']:.2f}x sequential; batched tokens "
          f"{'equal' if same else 'DIFFER FROM'} the sequential ones; load average {result['load_average']}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
