#!/usr/bin/env python3
"""Tensor parallelism on this machine: decode tokens/s of one process, a 2-stage pipeline, a
2-rank tensor group and a 2x2 hybrid, each against the planner's prediction.

    .venv/bin/python scripts/bench_tensor.py [--hidden 512] [--layers 8] [--tokens 32]
        [--rounds 3] [--runs 4] [--no-pin] [--json [FILE]]

Every mode runs the same greedy request on the same model with the same worker
(`p2pmesh.worker.tensor_run`, tests/worker/tensor_cluster.py): MLX ring groups on loopback
for tensor groups, TCP hops between groups. Tokens/s = (n - 1) / decode seconds on the last
group's rank 0; a mode's figure in a round is the median of --runs requests after one
warm-up in the same processes.

Rounds: this VM's speed drifts by 20% from one second to the next (other tenants), so each
round measures the cost model's inputs and then runs every mode, and a round's ratio
compares figures taken within seconds of each other; the table gives every round's ratio
and their median. Rank r of every group runs on the r-th CPU (tensor_run --cpu; --no-pin:
wherever Linux puts it), as each rank has its own Mac's cores; the probes are pinned alike.

Prediction: core/placement.predict_plan on 4 equal Macs with the inputs measured in the round:
- layer_ms and layer_fixed_ms: worker/measure.layer_times at the requests' mean context (the
  layer whole and cut to a quarter: the part of it that a split does not divide);
- every link's rtt_ms: what one 2-rank all-sum of an activation costs inside a decode step
  (a 2-rank group's step over every layer cut in half, less the same half layers computed
  by two processes alone, per all-sum; the cost model's 2-rank all-reduce is 2 steps of
  rtt/2), or the lockstep all-sum's latency if that is more; a nominal loopback bandwidth;
- the stage overhead: one hop of tensor_run's messages between two processes, the receiver
  idle for the other stage's compute, less the wire's rtt/2 (the runtime's send and receive).
Ratio = measured / predicted tokens/s (target: within 30%, i.e. 0.7-1.3).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import parser, row, table, write_json  # noqa: E402

T = TypeVar("T")
PROMPT = "Once upon a time there was a small model"
LOOPBACK_GBPS = 20.0
"""Loopback TCP on this VM moves ~2.6-3 GB/s (research/mlx-distributed.md 5); the activations
here are a few KiB, so the figure barely matters."""
PROBE_STEPS, PROBE_WARMUP = 200, 20
PIN = "import os\nif os.environ.get('BENCH_CPU'):\n    os.sched_setaffinity(0, {int(os.environ['BENCH_CPU'])})\n"
"""Each probe's first lines: run on the CPU the bench gives it (before MLX starts threads)."""
ALLREDUCE_PROBE = PIN + r"""
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
RANK_LAYER_PROBE = PIN + r"""
import json, statistics, sys
from pathlib import Path
import mlx.core as mx
from p2pmesh.worker.measure import LayerClock
from p2pmesh.worker.model import load_shard
from p2pmesh.worker.tensor import even_shares, shard_layer
path, layers, together = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "group"  # argv[4]: context
g = mx.distributed.init(strict=True, backend="ring") if together else mx.distributed.init()
shard = load_shard(path, 0, layers)
for layer in shard.model.model.layers:
    shard_layer(layer, shard.config, even_shares(shard.config, 2), g.rank(), g)
clock = LayerClock(shard, int(sys.argv[4]))
clock.steps(%d)
print(json.dumps({"median_ms": statistics.median(clock.steps(%d))}))
""" % (PROBE_WARMUP, PROBE_STEPS)


HOP_PROBE = PIN + r"""
import json, socket, statistics, sys, time
import mlx.core as mx
from p2pmesh.worker.tensor_run import HEADER, _from_bytes, _read, _send, _to_bytes
role, port, hidden, wait_s, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
if role == "a":
    server = socket.create_server(("127.0.0.1", port))
    print("listening", flush=True)
    s, _ = server.accept()
else:
    s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
one_way = []

def recv():
    (n,) = HEADER.unpack(_read(s, HEADER.size))
    header = json.loads(_read(s, n))
    payload = _read(s, int(header["nbytes"]))
    return header, payload

for i in range(steps):
    # As a pipeline's stages: one sends and then sleeps in recv while the other "computes"
    # (wait_s), so every message wakes a process that has been idle that long.
    if (role == "a") == (i % 2 == 0):
        x = mx.random.normal((1, 1, hidden))
        mx.eval(x)
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        if role == "a":
            payload = _to_bytes(x)
        else:
            payload = int(mx.argmax(x).item()).to_bytes(4, "little")
        _send(s, {"nbytes": len(payload), "t0": t0}, payload)
    else:
        header, payload = recv()
        if len(payload) > 4:
            mx.eval(mx.array(_from_bytes(payload, (1, 1, hidden))))
        else:
            int.from_bytes(payload, "little")
        one_way.append((time.perf_counter() - header["t0"]) * 1000)
        t_end = time.perf_counter() + wait_s
        while time.perf_counter() < t_end:  # computing: a busy core, as a stage's is
            pass
print(json.dumps({"median_ms": statistics.median(one_way[5:])}))
"""


def hop_ms(hidden: int, wait_ms: float, cpus: tuple[int, ...]) -> float:
    """One hop of a pipeline on this runtime (worker/tensor_run's messages over loopback TCP,
    the receiver idle in recv for the other stage's compute, wait_ms): from the sender's
    activation (or token) in hand to the receiver's in MLX, the median of both directions.
    Both ends on cpus[0], as the two rank 0s of a pinned pipeline are."""
    from tests.worker.test_mlx_ring import free_port_run

    port = free_port_run(1)
    args = [str(port), str(hidden), str(wait_ms / 1000), str(2 * PROBE_STEPS)]
    env = {**os.environ, "BENCH_CPU": str(cpus[0]) if cpus else ""}
    a = subprocess.Popen([sys.executable, "-c", HOP_PROBE, "a", *args], cwd=ROOT, stdout=subprocess.PIPE, env=env)
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == b"listening"
        b = subprocess.Popen([sys.executable, "-c", HOP_PROBE, "b", *args], cwd=ROOT, stdout=subprocess.PIPE, env=env)
        outs = [p.communicate(timeout=120)[0] for p in (a, b)]
    finally:
        for p in (a, b) if "b" in locals() else (a,):
            if p.poll() is None:
                p.kill()
    return statistics.median(json.loads(o.decode().strip().splitlines()[-1])["median_ms"] for o in outs)


def _two_ranks(code: str, args: list[str], work: Path, group: bool, cpus: tuple[int, ...]) -> float:
    """The median of two processes running `code` at once, in a 2-rank ring group or each
    alone (a group of one); the second on cpus[1], the first on cpus[0] (none: unpinned)."""
    from p2pmesh.core.mlx_hostfile import loopback_hostfile
    from tests.worker.test_mlx_ring import free_port_run

    env = {k: v for k, v in os.environ.items() if k not in ("MLX_HOSTFILE", "MLX_RANK")}
    if group:
        hostfile = work / "probe_hostfile.json"
        hostfile.write_text(json.dumps(loopback_hostfile(2, free_port_run(2))), encoding="utf-8")
        envs = [{**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)} for r in range(2)]
    else:
        envs = [dict(env), dict(env)]
    for r, e in enumerate(envs):
        if cpus:
            e["BENCH_CPU"] = str(cpus[r % len(cpus)])
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, env=e)
             for e in envs]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return statistics.median(json.loads(o.decode().strip().splitlines()[-1])["median_ms"] for o in outs)


def allreduce_ms(hidden: int, work: Path, cpus: tuple[int, ...]) -> float:
    """Median time of a 2-rank all-sum of one float32 activation [1, 1, hidden] on loopback,
    the two ranks doing nothing else (in lockstep)."""
    return _two_ranks(ALLREDUCE_PROBE, [str(hidden)], work, group=True, cpus=cpus)


def allreduce_in_stage_ms(model: Path, layers: int, context: int, work: Path,
                          cpus: tuple[int, ...]) -> tuple[float, float, float]:
    """What one all-sum costs a tensor rank inside a decode step: a 2-rank group's step of
    every layer cut in half (two all-sums a layer), less the same half layers' step in two
    processes computing at once alone, over 2 x layers. Also returns the two step times
    (group, alone), ms.

    Measured there because that is where it costs what it costs: on this VM an all-sum
    inside a graph of several layers takes a few times longer than in allreduce_ms' lockstep
    loop (0.2-0.4 ms against 0.07-0.1: each rank arrives after its own ops, whose times
    jitter on a shared machine, and MLX's CPU stream runs the all-sum in line)."""
    args = [str(model), str(layers)]
    group = _two_ranks(RANK_LAYER_PROBE, [*args, "group", str(context)], work, group=True, cpus=cpus)
    alone = _two_ranks(RANK_LAYER_PROBE, [*args, "alone", str(context)], work, group=False, cpus=cpus)
    return max(0.0, (group - alone) / (2 * layers)), group, alone


def decode_rates(model: Path, groups: list[Any], prompt: list[int], tokens: int, runs: int,
                 work: Path, cpus: tuple[int, ...]) -> tuple[list[float], list[int], list[dict[str, float]]]:
    """The decode tokens/s of each run after the warm-up, the tokens, and each group's rank 0
    phases (ms per decode step, worker/tensor_run.PHASES) averaged over those runs."""
    from tests.worker.tensor_cluster import run_plan

    results = run_plan(model, groups, prompt, tokens, work, repeat=runs + 1, timeout_s=600.0, cpus=cpus)
    head = results[-1][0]
    rates = [(len(r["tokens"]) - 1) / r["decode_s"] for r in head["runs"][1:]]
    phases = [{k: statistics.mean(r["phases_ms"][k] for r in group[0]["runs"][1:]) for k in group[0]["runs"][1]["phases_ms"]}
              for group in results]
    return rates, head["tokens"], phases


def _pinned(cpus: tuple[int, ...], fn: Callable[[], T]) -> T:
    """fn() run with this process on cpus only (as the ranks are), the mask restored after."""
    if not cpus:
        return fn()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, before)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (measure the inputs, run every mode once)")
    p.add_argument("--runs", type=int, default=4, help="timed requests per mode and round, after one warm-up")
    p.add_argument("--no-pin", action="store_true",
                   help="let Linux place the processes (default: rank r of every group on the r-th CPU of this process's set)")
    args = p.parse_args()
    cpus: tuple[int, ...] = ()
    if not args.no_pin and hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))

    from p2pmesh.core.placement import Group, ModelSpec, NodeSpec, Plan, SplitShape, Stage, predict_plan
    from p2pmesh.core.ring import Link
    from p2pmesh.worker.measure import layer_times, model_sizes, usable_memory_bytes
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
        figures: dict[str, Any] = {"model": {"family": "llama", "hidden": h, "layers": L, "heads": heads,
                                             "intermediate": 2 * h, "dtype": "float32"},
                                   "tokens": args.tokens, "rounds": [], "modes": {}}
        per_mode: dict[str, dict[str, list[Any]]] = {name: {"measured": [], "predicted": [], "phases": []} for name in modes}
        reference = None
        for r in range(args.rounds):
            # Inputs and modes in the same round, so a slow spell of this shared VM lands on
            # both sides of a round's ratio.
            context = len(prompt) + args.tokens // 2  # the requests' mean context
            times = _pinned(cpus[:1], lambda: layer_times(model, L, context=context))
            ar_idle = allreduce_ms(h, work, cpus)
            ar_stage, step_group, step_alone = allreduce_in_stage_ms(model, L, context, work, cpus)
            rtt = max(ar_idle, ar_stage)  # a 2-rank all-reduce is 2 steps of rtt / 2 in the model
            hop = hop_ms(h, k * times.layer_ms, cpus)
            overhead = max(0.0, hop - rtt / 2)  # the runtime's part of a hop: beyond the wire's rtt / 2
            nodes = [NodeSpec(n, usable_memory_bytes(), times.layer_ms, times.fixed_ms) for n in ids]
            links = [Link(a, b, "network", LOOPBACK_GBPS, rtt) for i, a in enumerate(ids) for b in ids[i + 1:]]
            figures["rounds"].append({"layer_ms": times.layer_ms, "layer_fixed_ms": times.fixed_ms,
                                      "split_ranks": times.split_ranks, "split_layer_ms": times.split_ms,
                                      "allreduce_idle_ms": ar_idle, "allreduce_in_stage_ms": ar_stage,
                                      "half_stage_step_ms": {"group": step_group, "alone": step_alone},
                                      "hop_ms": hop, "stage_overhead_ms": overhead})
            print(f"round {r + 1}: layer {times.layer_ms:.3f} ms ({times.fixed_ms:.3f} fixed: 1/{times.split_ranks} "
                  f"of it {times.split_ms:.3f} ms); all-sum {ar_stage:.3f} ms in a step (a step of {L} half layers "
                  f"{step_group:.3f} ms in a group, {step_alone:.3f} alone), {ar_idle:.3f} in lockstep; hop "
                  f"{hop:.3f} ms (stage overhead {overhead:.3f})", flush=True)
            for name, (groups, plan) in modes.items():
                rates, tokens, phases = decode_rates(model, groups, prompt, args.tokens, args.runs, work, cpus)
                reference = reference or tokens
                assert tokens == reference, f"{name} gave other tokens than one process"
                m = per_mode[name]
                m["measured"].append(statistics.median(rates))
                m["predicted"].append(1000.0 / predict_plan(spec, nodes, links, plan, overhead).tpot_ms)
                m["phases"].append(phases)
        print()
        table("mode", "measured tok/s", "predicted tok/s", "measured / predicted by round", "median")
        for name, m in per_mode.items():
            ratios = [a / b for a, b in zip(m["measured"], m["predicted"])]
            phases = [{key: statistics.mean(p[g][key] for p in m["phases"]) for key in PHASES}
                      for g in range(len(m["phases"][0]))]
            figures["modes"][name] = {"measured_tok_s": m["measured"], "predicted_tok_s": m["predicted"],
                                      "ratios": ratios, "ratio": statistics.median(ratios), "phases_ms": phases}
            row(name, " / ".join(f"{x:.1f}" for x in m["measured"]), " / ".join(f"{x:.1f}" for x in m["predicted"]),
                " / ".join(f"{x:.2f}" for x in ratios), f"{statistics.median(ratios):.2f}")
        print("\nwhere a decode step goes, ms on each group's rank 0 (worker/tensor_run.PHASES, mean of all runs):")
        table("mode", "group", *PHASES)
        for name, figure in figures["modes"].items():
            for g, phases in enumerate(figure["phases_ms"]):
                row(name, str(g), *(f"{phases[key]:.2f}" for key in PHASES))
        print(f"\nevery mode gave the same {args.tokens} greedy tokens; tokens/s: the median of {args.runs} requests "
              f"per mode and round")
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
