"""Models the workers split only evenly (issue 16/17: DeepSeek-V3's MLA and gpt-oss's attention
have no per-head projections to cut unevenly; core/model_spec.TENSOR_SPLITS): the planner gives
every rank of a group the same share, and plans no group whose size does not divide the KV
heads, whatever the Macs' speeds; families without a tensor path get no shape at all."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from p2pmesh.core.model_spec import split_shape, tensor_split
from p2pmesh.core.placement import ScenarioError, parse_scenario, solve_placement

PLANS = Path(__file__).resolve().parent.parent / "fixtures" / "plans"


def _load(name: str, **model: object) -> tuple:
    data = json.loads((PLANS / f"{name}.json").read_text(encoding="utf-8"))
    data["model"] = {**data["model"], **model}
    return parse_scenario(data)


def test_unequal_macs_split_an_even_only_model_equally() -> None:
    model, nodes, links = _load("tp2-ultra-max-rdma")
    uneven = solve_placement(model, nodes, links, parallelism="tensor")
    assert len({(s.kv_heads, s.columns) for s in uneven.groups[0].shares}) == 2  # the premise: by speed
    even_model, _, _ = _load("tp2-ultra-max-rdma", even_split=True)
    assert even_model.split.even_split
    assert dataclasses.replace(even_model, split=dataclasses.replace(even_model.split, even_split=False)) == model
    even = solve_placement(even_model, nodes, links, parallelism="tensor")
    assert even.parallelism == "tensor" and len({(s.kv_heads, s.columns) for s in even.groups[0].shares}) == 1
    assert even.tpot_ms >= uneven.tpot_ms  # equal shares are never faster than the best split


def test_three_macs_and_eight_kv_heads_get_no_three_way_group_when_even_only() -> None:
    model, nodes, links = _load("tp3-ultra-rdma", even_split=True)
    assert model.split.num_key_value_heads == 8 and len(nodes) == 3
    plan = solve_placement(model, nodes, links)
    assert all(len(g.node_ids) in (1, 2) for g in plan.groups), plan.groups  # 8 does not divide by 3
    for g in plan.groups:
        assert len({(s.kv_heads, s.columns) for s in g.shares}) <= 1


def test_even_split_must_be_a_bool() -> None:
    with pytest.raises(ScenarioError, match="even_split"):
        _load("tp2-ultra-max-rdma", even_split="yes")


@pytest.mark.parametrize(("model_type", "split"), [
    ("llama", "uneven"), ("mistral", "uneven"), ("qwen3_moe", "uneven"), ("glm4_moe", "uneven"),
    ("deepseek_v3", "even"), ("kimi_k2", "even"), ("gpt_oss", "even"),
    ("mixtral", None), ("gemma3_text", None), ("phi3", None),
])
def test_which_families_have_a_tensor_path(model_type: str, split: str | None) -> None:
    config = {"model_type": model_type, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1024}
    assert tensor_split(config) == split
    assert split_shape(config).known == (split is not None)  # no shape: only one Mac or a pipeline
