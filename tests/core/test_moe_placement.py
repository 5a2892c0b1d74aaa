"""The planner with a mixture of experts (issue 17): a tensor group's time follows the bytes a
token reads (attention, shared and active experts), its memory every expert; the scenario's
optional active_layer_bytes / attention_bytes; and the MoE scenarios of docs/placement.md."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from p2pmesh.core.placement import ModelSpec, NodeSpec, ScenarioError, SplitShape, parse_scenario, solve_placement
from p2pmesh.core.placement_cost import TICKS_PER_MS, cost_context
from p2pmesh.core.ring import Link
from p2pmesh.core.tensor_cost import split_cost, tensor_context, tensor_shape

MOE = Path(__file__).resolve().parent.parent / "fixtures" / "plans" / "moe"
GB = 10**9

# An MoE layer: 0.1 GB of attention, 6.4 GB of experts of which a token reads 0.2 GB.
EXPERTS = ModelSpec(layers=60, layer_bytes=6_500_000_000, kv_bytes_per_token_per_layer=1152, context_tokens=8192,
                    activation_bytes=14336, embed_bytes=500_000_000,
                    split=SplitShape(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                                     intermediate_size=18432, active_layer_bytes=300_000_000, attention_bytes=100_000_000))


def _with(model: ModelSpec, **split: int) -> ModelSpec:
    """The model with some fields of its split shape changed."""
    return dataclasses.replace(model, split=dataclasses.replace(model.split, **split))


def test_reads_and_memory_each_add_up_to_their_layer() -> None:
    sh = tensor_shape(EXPERTS)
    assert sh is not None
    cache = EXPERTS.kv_bytes_per_token_per_layer * EXPERTS.context_tokens
    assert sh.kv_heads * sh.attn_bytes_per_kv + sh.blocks * sh.mlp_bytes_per_block == pytest.approx(EXPERTS.bytes_per_layer)
    assert sh.kv_heads * sh.attn_read_per_kv + sh.blocks * sh.mlp_read_per_block == pytest.approx(300_000_000 + cache)
    assert sh.read_bytes == 300_000_000 + cache
    dense = tensor_shape(_with(EXPERTS, active_layer_bytes=0, attention_bytes=0))
    assert dense is not None and dense.read_bytes == dense.layer_bytes
    assert (dense.attn_read_per_kv, dense.mlp_read_per_block) == (dense.attn_bytes_per_kv, dense.mlp_bytes_per_block)


def test_a_rank_holding_all_the_attention_pays_its_share_of_the_reads_not_of_the_weights() -> None:
    """One KV head: the first rank runs all of the attention. Its time is layer_ms x (attention
    + KV cache) / (what a token reads): 35% of the layer's time, not the 1.7% that its share of
    all weights (every expert) would say."""
    model = _with(EXPERTS, num_attention_heads=1, num_key_value_heads=1, hidden_size=7168)
    nodes = [NodeSpec("a", 384 * GB, 1.0), NodeSpec("b", 384 * GB, 1.0)]
    links = [Link("a", "b", "thunderbolt", 80, 0.3, rdma=True)]
    ctx = cost_context(model, nodes, links)
    tctx = tensor_context(model, nodes, links, ctx.ms)
    assert tctx is not None
    cost = split_cost(tctx, (0, 1), [1, 0], [144, 144])
    cache = model.kv_bytes_per_token_per_layer * model.context_tokens
    read = model.split.active_layer_bytes + cache
    attention = (model.split.attention_bytes + cache) / read  # 1.0 ms x its share
    mlp = (model.split.active_layer_bytes - model.split.attention_bytes) / 2 / read
    allreduce = cost.entry_act / TICKS_PER_MS
    assert cost.per_layer / TICKS_PER_MS == pytest.approx(attention + mlp + 2 * allreduce, abs=1e-6)
    dense_view = split_cost(tensor_context(_with(model, active_layer_bytes=0), nodes, links, ctx.ms),  # type: ignore[arg-type]
                            (0, 1), [1, 0], [144, 144])
    assert cost.per_layer > 1.3 * dense_view.per_layer  # weights-only costing hid the attention's rank


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"active_layer_bytes": 7 * GB}, "model.active_layer_bytes must be in"),
        ({"attention_bytes": 400_000_000}, "model.attention_bytes must be in"),
        ({"active_layer_bytes": -1}, "model.active_layer_bytes must be in"),
    ],
)
def test_active_fields_are_checked_and_named(edit: dict[str, int], needle: str) -> None:
    data = json.loads((MOE / "deepseek-v3-4bit-4x512.json").read_text(encoding="utf-8"))
    data["model"].update(edit)
    data["model"]["layer_bytes"] = 6_500_000_000
    data["model"]["active_layer_bytes"] = edit.get("active_layer_bytes", 300_000_000)
    with pytest.raises(ScenarioError, match=needle):
        parse_scenario(data)


def test_active_fields_are_optional_and_read() -> None:
    data = json.loads((MOE / "deepseek-v3-4bit-4x512.json").read_text(encoding="utf-8"))
    model, _, _ = parse_scenario(data)
    assert (model.split.active_layer_bytes, model.split.attention_bytes) == (data["model"]["active_layer_bytes"],
                                                                 data["model"]["attention_bytes"])
    for key in ("active_layer_bytes", "attention_bytes"):
        del data["model"][key]
    model, _, _ = parse_scenario(data)
    assert model.read_layer_bytes == model.layer_bytes and model.split.attention_bytes == 0


def test_deepseek_v3_on_four_512gb_ultras_is_tensor_parallel_within_memory() -> None:
    data = json.loads((MOE / "deepseek-v3-4bit-4x512.json").read_text(encoding="utf-8"))
    model, nodes, links = parse_scenario(data)
    assert model.layers * model.layer_bytes > nodes[0].memory_bytes  # needs at least two Macs
    plan = solve_placement(model, nodes, links)
    assert plan.parallelism == "tensor" and len(plan.groups[0].node_ids) == 4
    pipeline = solve_placement(model, nodes, links, parallelism="pipeline")
    assert plan.tpot_ms < 0.5 * pipeline.tpot_ms
    # layer_ms came from the bytes a token reads (scripts/moe_plans.py), about 1/20 of the layer's weights.
    read = model.split.active_layer_bytes + model.kv_bytes_per_token_per_layer * model.context_tokens
    assert nodes[0].layer_ms == pytest.approx(read / 819e9 * 1e3, abs=1e-4)
    assert model.split.active_layer_bytes < model.layer_bytes / 15


def test_the_cluster_carries_active_bytes_to_the_planner() -> None:
    """A committed model (ModelInfo, from the checkpoint: core/model_spec.py) gives the planner
    what a token reads; a record that says more than the layer holds is refused."""
    from p2pmesh.core.fit import model_spec as planner_spec
    from p2pmesh.core.messages import ModelInfo
    from p2pmesh.core.validate import model_problem

    info = ModelInfo("m", 60, 6_500_000_000, 1152, 8192, 14336, 500_000_000, hidden_size=7168,
                     num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                     active_layer_bytes=300_000_000, attention_bytes=100_000_000)
    assert model_problem(info) is None
    spec = planner_spec(info)
    assert (spec.split.active_layer_bytes, spec.split.attention_bytes) == (300_000_000, 100_000_000)
    assert model_problem(dataclasses.replace(info, active_layer_bytes=7_000_000_000)) is not None
    assert model_problem(dataclasses.replace(info, attention_bytes=400_000_000)) is not None
    assert planner_spec(dataclasses.replace(info, active_layer_bytes=0, attention_bytes=0)).read_layer_bytes == 6_500_000_000
