#!/usr/bin/env python3
"""Tensor parallelism on this machine: decode tokens/s of one process, a 2-stage pipeline, a
2-rank tensor group and a 2x2 hybrid, each against the planner's prediction.

    .venv/bin/python scripts/bench_tensor.py [--hidden 512] [--layers 8] [--tokens 32] [--runs 2] [--json [FILE]]

Every mode runs the same greedy request on the same model with the same worker
(`p2pmesh.worker.tensor_run`, tests/worker/tensor_cluster.py): MLX ring groups on loopback
for tensor groups, TCP hops between groups. Tokens/s = (n - 1) / decode seconds on the last
group's rank 0, best of --runs after one warm-up run in the same processes.

Prediction: core/placement.predict_plan on 4 equal Macs whose layer_ms is the measured
decode time of one layer here (worker/measure.layer_decode_ms) and whose links all have
rtt_ms = the measured latency of a 2-rank all-sum of one activation on loopback (the cost
model's 2-rank all-reduce is 2 steps of rtt/2) and a nominal loopback bandwidth; ratio =
measured / predicted tokens/s (target: within 30%, i.e. 0.7-1.3).

Expected here: tensor is slower than one process: a decode step of a small model is far
cheaper than the two all-reduces per layer over MLX's ring (TCP), and the 2 cores are shared
by all ranks (MLX's ring busy-polls a core while it waits).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import parser, row, table, write_json  # noqa: E402

PROMPT = "Once upon a time there was a small model"
LOOPBACK_GBPS = 20.0
"""Loopback TCP on this VM moves ~2.6-3 GB/s (research/mlx-distributed.md 5); the activations
here are a few KiB, so the figure barely matters."""
PROBE_STEPS, PROBE_WARMUP = 200, 20
ALLREDUCE_PROBE = r"""
import json, statistics, sys, time
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
x = mx.zeros((1, 1, int(sys.argv[1])), dtype=mx.float32)
ts = []
for i in range(%d + %d):
    t0 = time.perf_counter()
    mx.eval(mx.distributed.all_sum(x, group=g))
    if i >= %d:
        ts.append((time.perf_counter() - t0) * 1000)
print(json.dumps({"median_ms": statistics.median(ts)}))
""" % (PROBE_WARMUP, PROBE_STEPS, PROBE_WARMUP)


def allreduce_ms(hidden: int, work: Path) -> float:
    """Median time of a 2-rank all-sum of one float32 activation [1, 1, hidden] on loopback."""
    from p2pmesh.core.mlx_hostfile import loopback_hostfile
    from tests.worker.test_mlx_ring import free_port_run

    hostfile = work / "probe_hostfile.json"
    hostfile.write_text(json.dumps(loopback_hostfile(2, free_port_run(2))), encoding="utf-8")
    procs = [subprocess.Popen([sys.executable, "-c", ALLREDUCE_PROBE, str(hidden)], cwd=ROOT, stdout=subprocess.PIPE,
                              env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return statistics.median(json.loads(o.decode().strip().splitlines()[-1])["median_ms"] for o in outs)


def decode_rate(model: Path, groups: list[Any], prompt: list[int], tokens: int, runs: int,
                work: Path) -> tuple[float, list[int], list[dict[str, float]]]:
    """The best decode tokens/s over the runs after the warm-up, the tokens, and that run's
    phases (ms per decode step) on each group's rank 0 (worker/tensor_run.PHASES)."""
    from tests.worker.tensor_cluster import run_plan

    results = run_plan(model, groups, prompt, tokens, work, repeat=runs + 1, timeout_s=600.0)
    head = results[-1][0]
    rates = [(len(r["tokens"]) - 1) / r["decode_s"] for r in head["runs"][1:]]
    best = 1 + rates.index(max(rates))
    return max(rates), head["tokens"], [group[0]["runs"][best]["phases_ms"] for group in results]


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()

    from p2pmesh.core.placement import Group, ModelSpec, NodeSpec, Plan, SplitShape, Stage, predict_plan
    from p2pmesh.core.ring import Link
    from p2pmesh.worker.measure import layer_decode_ms, model_sizes, usable_memory_bytes
    from p2pmesh.worker.model import load_tokenizer
    from p2pmesh.worker.tensor_run import PHASES
    from tests.fixtures.tiny_model import make_tiny_model
    from tests.worker.tensor_cluster import GroupPlan

    L, h = args.layers, args.hidden
    heads = max(2, h // 64)
    with tempfile.TemporaryDirectory(prefix="bench_tensor_") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", "llama", L, h, heads=heads, kv_heads=heads // 2, intermediate=2 * h)
        prompt = load_tokenizer(model).encode(PROMPT)
        layer_ms = layer_decode_ms(model, L)
        ar_ms = allreduce_ms(h, work)
        k = L // 2
        modes = {
            "single": ([GroupPlan(0, L, 1)], Plan((Stage("n0", 0, L),), 0.0)),
            "pipeline 2": ([GroupPlan(0, k, 1), GroupPlan(k, L, 1)], Plan((Stage("n0", 0, k), Stage("n1", k, L)), 0.0)),
            "tensor 2": ([GroupPlan(0, L, 2)], Plan((Stage("n0", 0, L),), 0.0, groups=(Group(("n0", "n1"), 0, L),))),
            "hybrid 2x2": ([GroupPlan(0, k, 2), GroupPlan(k, L, 2)],
                           Plan((Stage("n0", 0, k), Stage("n2", k, L)), 0.0,
                                groups=(Group(("n0", "n1"), 0, k), Group(("n2", "n3"), k, L)))),
        }
        sizes = model_sizes(str(model), model)
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
        spec = ModelSpec(L, sizes["layer_bytes"], sizes["kv_bytes_per_token_per_layer"], len(prompt) + args.tokens,
                         sizes["activation_bytes"], sizes["embed_bytes"],
                         SplitShape(h, config["num_attention_heads"], config["num_key_value_heads"],
                                    config["intermediate_size"]))
        ids = ["n0", "n1", "n2", "n3"]
        nodes = [NodeSpec(n, usable_memory_bytes(), layer_ms) for n in ids]
        links = [Link(a, b, "network", LOOPBACK_GBPS, ar_ms) for i, a in enumerate(ids) for b in ids[i + 1:]]
        figures: dict[str, Any] = {"model": {"family": "llama", "hidden": h, "layers": L, "heads": heads,
                                             "intermediate": 2 * h, "dtype": "float32"},
                                   "tokens": args.tokens, "layer_ms": layer_ms, "allreduce_ms": ar_ms, "modes": {}}
        reference = None
        table("mode", "measured tok/s", "predicted tok/s", "measured / predicted")
        for name, (groups, plan) in modes.items():
            rate, tokens, phases = decode_rate(model, groups, prompt, args.tokens, args.runs, work)
            reference = reference or tokens
            assert tokens == reference, f"{name} gave other tokens than one process"
            predicted = 1000.0 / predict_plan(spec, nodes, links, plan).tpot_ms
            figures["modes"][name] = {"measured_tok_s": rate, "predicted_tok_s": predicted, "ratio": rate / predicted,
                                      "phases_ms": phases}
            row(name, f"{rate:.1f}", f"{predicted:.1f}", f"{rate / predicted:.2f}")
        print("\nwhere a decode step goes, ms on each group's rank 0 (worker/tensor_run.PHASES):")
        table("mode", "group", *PHASES)
        for name, figure in figures["modes"].items():
            for g, phases in enumerate(figure["phases_ms"]):
                row(name, str(g), *(f"{phases[k]:.2f}" for k in PHASES))
        print(f"\nlayer decode {layer_ms:.3f} ms, 2-rank all-sum of one activation {ar_ms:.3f} ms on loopback; "
              f"every mode gave the same {args.tokens} greedy tokens")
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
