"""The MoE plans of docs/placement.md ("Mixtures of experts on Mac Studios", issue 17): writes
the `plan solve` scenarios of Mixtral 8x7B, Qwen3-235B-A22B and DeepSeek-V3 at 4 and 8 bits
on 2 and 4 Mac Studios (M3 Ultra, 512 GB and 256 GB) over TB5 with RDMA, solves them, and
prints the table; then what expert parallelism would gain in the same cost model.

    .venv/bin/python scripts/moe_plans.py            # (re)write tests/fixtures/plans/moe/, print the tables
    .venv/bin/python scripts/moe_plans.py --check    # exit 1 when a fixture differs from what this writes

Inputs are published figures, not measurements: the model block is `p2pmesh plan model
CONFIG --bits B --context-tokens 8192 --json` of tests/fixtures/hf_configs/; usable memory
75% of RAM (as the issue-16 targets); layer_ms = (the bytes a token reads of a layer, on
average, + its KV cache at 8k) / 819 GB/s (M3 Ultra; the 256 GB model has the same
bandwidth): a decode step is memory-bound and reads the active experts only.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pmesh.core.model_size import ModelSize, model_size, planner_model  # noqa: E402
from p2pmesh.core.placement import PlacementError, parse_scenario, solve_placement  # noqa: E402
from p2pmesh.core.tensor_cost import RDMA_LATENCY_MS, tensor_shape  # noqa: E402

CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
OUT = ROOT / "tests" / "fixtures" / "plans" / "moe"
MODELS = (("mixtral-8x7b", "Mixtral 8x7B"), ("qwen3-235b-a22b", "Qwen3-235B-A22B"), ("deepseek-v3", "DeepSeek-V3"))
BITS = (4, 8)
CLUSTERS = ((2, 512), (4, 512), (2, 256), (4, 256))  # Macs, GB of RAM each
CONTEXT = 8192
BANDWIDTH_GBS = 819.0
USABLE = 0.75
TB5_GBPS, TB5_RTT_MS = 80, 0.3


def scenario(name: str, bits: int, macs: int, ram_gb: int) -> dict[str, object]:
    config = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    model = planner_model(config, bits, CONTEXT)
    read = model["active_layer_bytes"] + model["kv_bytes_per_token_per_layer"] * CONTEXT
    layer_ms = round(read / (BANDWIDTH_GBS * 1e9) * 1e3, 4)
    ids = [f"ultra{i}" for i in range(macs)]
    return {
        "note": f"{macs}x M3 Ultra {ram_gb} GB ({USABLE:.0%} usable), TB5 full mesh with RDMA; {name} at {bits} bits, "
                f"{CONTEXT} tokens; layer_ms = active layer bytes with KV / {BANDWIDTH_GBS:g} GB/s (scripts/moe_plans.py)",
        "model": model,
        "nodes": [{"id": i, "memory_bytes": int(ram_gb * 1e9 * USABLE), "layer_ms": layer_ms} for i in ids],
        "links": [{"a": a, "b": b, "kind": "thunderbolt", "gbps": TB5_GBPS, "rtt_ms": TB5_RTT_MS, "rdma": True}
                  for a, b in itertools.combinations(ids, 2)],
    }


def memory_per_mac(data: dict[str, object]) -> dict[str, float]:
    """GB each Mac of the plan holds: its layers (or its share of them) with their KV cache,
    plus the embeddings/head on a first or last stage."""
    model, nodes, links = parse_scenario(data)
    plan = solve_placement(model, nodes, links)
    shape = tensor_shape(model)
    out: dict[str, float] = {}
    groups = plan.layout
    for pos, g in enumerate(groups):
        extra = model.embed_bytes * ((pos == 0) + (pos == len(groups) - 1))
        if len(g.node_ids) == 1:
            out[g.node_ids[0]] = (g.layers * model.bytes_per_layer + extra) / 1e9
            continue
        assert shape is not None
        for node, share in zip(g.node_ids, g.shares):
            per_layer = share.kv_heads * shape.attn_bytes_per_kv + share.columns // shape.block * shape.mlp_bytes_per_block
            out[node] = (g.layers * per_layer + extra) / 1e9
    return out


def expected_max_load(experts: int, k: int, macs: int) -> float:
    """E[the most of a token's k routed experts that one Mac holds], the experts spread evenly
    (experts / macs each) and chosen uniformly without replacement: exact, over every count."""
    per = experts // macs
    total = math.comb(experts, k)
    e = 0.0
    for counts in itertools.product(range(min(k, per) + 1), repeat=macs):
        if sum(counts) == k:
            e += max(counts) * math.prod(math.comb(per, c) for c in counts) / total
    return e


def expert_parallel(size: ModelSize, bits: int, macs: int, context: int, latency_ms: float) -> dict[str, float]:
    """ms per token, in this cost model, of one token through every layer on ``macs`` equal
    Macs: tensor parallel (each Mac 1/macs of every active byte, two all-reduces a layer) and
    expert parallel (each Mac experts/macs of every layer's experts; attention replicated, or
    split by heads as in TP; a dispatch and a combine all_to_all a layer). ``latency_ms``: one
    step of a collective (RDMA_LATENCY_MS over JACCL, rtt/2 over TCP)."""
    bw = BANDWIDTH_GBS * 1e9
    act = size.hidden_size * size.dtype_bytes
    step = latency_ms + act / macs * 8 / (TB5_GBPS * 1e6)  # one ring step of an all-reduce
    a2a = latency_ms + size.experts_per_token * act * 8 / (TB5_GBPS * 1e6)  # one exchange, all pairs at once
    load = expected_max_load(size.experts, size.experts_per_token, macs)
    tp = ep = ep_tp = 0.0
    for layer in size.layers:
        kv = context * layer.kv_elements * size.dtype_bytes
        attn = layer.attention.nbytes(bits, size.dtype_bytes) + kv
        always = layer.always.nbytes(bits, size.dtype_bytes)
        expert = layer.expert.nbytes(bits, size.dtype_bytes)
        routed = expert * min(layer.experts_per_token, layer.experts)
        allreduces = 2 * 2 * (macs - 1) * step
        tp += (attn + always + routed) / macs / bw * 1e3 + allreduces
        if layer.experts:
            ep += (attn + always + load * expert) / bw * 1e3 + 2 * a2a
            ep_tp += (attn / macs + always + load * expert) / bw * 1e3 + 2 * (macs - 1) * step + 2 * a2a
        else:  # a dense layer: tensor parallel in every scheme
            ep += (attn + always) / macs / bw * 1e3 + allreduces
            ep_tp += (attn + always) / macs / bw * 1e3 + allreduces
    return {"tp": tp, "ep": ep, "ep_tp": ep_tp, "load": load}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare tests/fixtures/plans/moe/ instead of writing it")
    args = parser.parse_args()
    differ = []
    print("| model | bits | Macs | weights | memory per Mac used | chosen | tpot | tok/s | best pipeline | one Mac |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, title), bits, (macs, ram) in itertools.product(MODELS, BITS, CLUSTERS):
        data = scenario(name, bits, macs, ram)
        path = OUT / f"{name}-{bits}bit-{macs}x{ram}.json"
        text = json.dumps(data, indent=1) + "\n"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                differ.append(path.name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        weights = data["model"]["total_bytes"] / 1e9  # type: ignore[index]
        model, nodes, links = parse_scenario(data)
        single = solve_placement(model, nodes[:1], links, parallelism="pipeline") if model.total_bytes <= nodes[0].memory_bytes else None
        one = f"{1000 / single.tpot_ms:.1f} tok/s" if single else "does not fit"
        try:
            plan = solve_placement(model, nodes, links)
        except PlacementError:
            print(f"| {title} | {bits} | {macs}x {ram} GB | {weights:.0f} GB | does not fit | - | - | - | - | {one} |")
            continue
        try:
            piped = f"{1000 / solve_placement(model, nodes, links, parallelism='pipeline').tpot_ms:.1f} tok/s"
        except PlacementError:  # whole layers per Mac do not add up where shares of every layer do
            piped = "does not fit"
        mem = memory_per_mac(data)
        used = ", ".join(f"{v:.0f}" for v in mem.values())
        kind = plan.parallelism + (f" ({len(plan.layout[0].node_ids)} Macs)" if plan.parallelism == "tensor" else "")
        print(f"| {title} | {bits} | {macs}x {ram} GB | {weights:.0f} GB | {used} GB | {kind} | {plan.tpot_ms:.2f} ms "
              f"| {1000 / plan.tpot_ms:.1f} | {piped} | {one} |")
    print("\nExpert parallelism against tensor parallelism, 4 Macs, 4-bit, 8k context (ms per token, layers only;"
          " speed against TP in brackets):\n")
    print("| model | links | E[most experts on one Mac] (of k) | tensor parallel | EP, attention replicated "
          "| EP, attention by heads |")
    print("|---|---|---|---|---|---|")
    for (name, title), (links, latency) in itertools.product(MODELS, (("TB5 RDMA", RDMA_LATENCY_MS),
                                                                      ("TB5 TCP", TB5_RTT_MS / 2))):
        size = model_size(json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8")))
        r = expert_parallel(size, 4, 4, CONTEXT, latency)
        print(f"| {title} | {links} | {r['load']:.2f} of {size.experts_per_token} | {r['tp']:.2f} | {r['ep']:.2f} "
              f"({r['tp'] / r['ep'] - 1:+.0%}) | {r['ep_tp']:.2f} ({r['tp'] / r['ep_tp'] - 1:+.0%}) |")
    if differ:
        print(f"\nthese fixtures differ from what this script writes: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
